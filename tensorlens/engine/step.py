"""Statistics of every tensor of one saved step, computed in a batch with one host copy.

The training thread calls :meth:`StepStatistics.compute` with all the tensors of a step. Every
partial row and histogram is computed on the tensors' device without a host sync; then one
``.cpu()`` of one concatenated buffer brings everything over. Only a step in which some tensor
holds NaN or Inf needs a second, smaller pass and copy. Histogram edges are derived exactly on the
host, off the training thread (:func:`~tensorlens.stats.edges.exact_edges`), when
:mod:`tensorlens.engine.assemble` builds the step's one record on the dispatcher thread.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tensorlens.engine.assemble import HostStatistics, _HostHistogram, _JobMeta
from tensorlens.engine.jobs import DerivedScalars, ReducedPiece, TensorJob, WorkerReducer, reduce_now, reduce_plan
from tensorlens.stats import native
from tensorlens.stats.histogram import (
    histogram_counts,
    histogram_range,
    histogram_scale,
    reject_outliers,
    sample_stride,
    strided_sample,
)
from tensorlens.stats.moments import (
    COL,
    PARTIALS,
    as_values,
    merge_partials,
    native_partial_rows,
    needed_columns,
    nonfinite_counts,
    partial_rows,
    partial_rows_and_samples,
)
from tensorlens.stats.sparse import is_sparse, sparse_summary


@dataclasses.dataclass
class _DeviceHistograms:
    """Histograms of several jobs, still on the device."""

    index: list[int]  # job indices, one per row below
    counts: torch.Tensor  # int64 [G, bins]
    # float64 [G, 9]: bin low, bin high, scale, data min, data max, binned, rejected, underflow, overflow
    extra: torch.Tensor
    sampled: list[bool]
    dtype: torch.dtype  # the dtype values were binned in; the host derives exact edges in it


_OWN_COMPUTE_DTYPE = (torch.float32, torch.float64)  # dtypes that compute_dtype keeps as they are


class StepStatistics:
    """Computes :class:`HostStatistics` for a list of :class:`TensorJob`.

    Keeps one scratch buffer per (device, dtype), grown to the largest tensor seen, so the
    two-pass variance does not allocate (and page-fault) a fresh buffer for every tensor.
    ``host_copies`` counts device-to-host copies, for tests and benchmarks.
    """

    def __init__(self) -> None:
        self._scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.host_copies = 0
        self._warned_complex = False

    def _scratch_for(self, values: torch.Tensor) -> torch.Tensor:
        key = (values.device, values.dtype)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < values.numel():
            buf = torch.empty(values.numel(), dtype=values.dtype, device=values.device)
            self._scratch[key] = buf
        return buf

    def release(self) -> None:
        """Free the scratch buffers (the hook calls this on close)."""
        self._scratch.clear()

    def _values(self, job: TensorJob) -> torch.Tensor:
        """The job's values, flat in the compute dtype; for a reduced job, its histogram sample."""
        if len(job.pieces) == 1 and not isinstance(job.pieces[0], ReducedPiece) and job.pieces[0].dtype in _OWN_COMPUTE_DTYPE \
                and job.pieces[0].layout == torch.strided and job.pieces[0].device.type != "meta":
            return job.pieces[0].detach().reshape(-1)  # the usual parameter or gradient: a flat view
        if any(isinstance(piece, ReducedPiece) for piece in job.pieces):
            return torch.cat([piece.sample for piece in self._reduced_pieces(job)])
        pieces = []
        for piece in job.pieces:
            piece = _plain(piece.detach())
            if piece.is_complex():
                if not self._warned_complex:
                    warnings.warn(
                        f"tensorlens: complex tensor {job.name!r} is summarised by its magnitude |z| "
                        "(this warning is shown once)",
                        stacklevel=2,
                    )
                    self._warned_complex = True
                piece = piece.abs()
            pieces.append(as_values(piece))
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces)

    def _prepared(self, job: TensorJob) -> TensorJob:
        """``job`` with its sparse pieces summarised (their stored values and implicit zeros);
        tensors of other layouts become plain strided tensors in :meth:`_values`."""
        if not any(isinstance(p, torch.Tensor) and is_sparse(p) for p in job.pieces):
            return job
        histogram = job.histogram if job.histogram is not None and job.histogram.enabled and not job.plain_scalar else None
        pieces: list[torch.Tensor | ReducedPiece] = []
        for piece in job.pieces:
            if isinstance(piece, torch.Tensor) and is_sparse(piece):
                row, sample = sparse_summary(
                    piece, needed_columns(job.stats), histogram.sample if histogram else None, histogram is not None
                )
                pieces.append(ReducedPiece(None, sample, piece.shape, piece.dtype, piece.device, partial_row=row))
            else:
                pieces.append(piece)
        raw = None
        if job.save_raw:  # the raw tensor asked for is the dense one
            raw = torch.cat([as_values(_plain(p.to_dense() if is_sparse(p) else p).reshape(-1)) for p in job.pieces])
        return dataclasses.replace(job, pieces=pieces, raw=raw)

    @staticmethod
    def _reduced_pieces(job: TensorJob) -> list[ReducedPiece]:
        """Every piece of a job with a reduced one, reduced (a module whose calls were captured
        both ways, which only a change of device or dtype between calls can cause)."""
        out = []
        for piece in job.pieces:
            if not isinstance(piece, ReducedPiece):
                plan = reduce_plan(job.stats, job.histogram)
                reduced = reduce_now(piece, plan) if plan is not None else None
                if reduced is None:  # e.g. a dense tensor saved next to a sparse one: a partial row of its own
                    values = as_values(_plain(piece.detach()))
                    row = partial_rows([values], [needed_columns(job.stats)])[0]
                    row[[COL["nan_count"], COL["inf_count"]]] = nonfinite_counts(values)
                    hist = job.histogram
                    sample = strided_sample(values, hist.sample) if hist is not None and hist.enabled else values.new_empty(0)
                    reduced = ReducedPiece(None, sample, piece.shape, piece.dtype, piece.device, partial_row=row)
                piece = reduced
            out.append(piece)
        return out

    def _to_host(self, tensor: torch.Tensor) -> np.ndarray:
        self.host_copies += 1
        return tensor.cpu().numpy()

    def compute(
        self, jobs: Sequence[TensorJob], reducer: WorkerReducer | None = None, warn: Callable[[str], None] | None = None,
        derived: DerivedScalars | None = None,
    ) -> HostStatistics:
        """Statistics of ``jobs`` (and the ``derived`` values, in the same host copy). A tensor
        that cannot be summarised costs only itself: it is left out of the result with one
        warning naming it (``warn``), never the step."""
        jobs, failed = self._isolate(jobs, warn)
        if reducer is not None:
            # every rank must make the same collectives: a failed job keeps its place with an
            # empty piece, then leaves the result
            host = self._compute(jobs, reducer, derived)
        else:
            try:
                host = self._compute(jobs, None, derived)
            except Exception:
                if len(jobs) - len(failed) < 2:
                    raise
                # a batched op failed on one tensor: find it, so the others are still recorded
                host = self._one_by_one([job for i, job in enumerate(jobs) if i not in failed], warn)
                if derived is not None:
                    host.derived_names, host.derived_values = derived.names, self._to_host(derived.values)
                return host
        return host.without(failed) if failed else host

    def _isolate(self, jobs: Sequence[TensorJob], warn: Callable[[str], None] | None) -> tuple[list[TensorJob], set[int]]:
        """Jobs whose values can be read, prepared; the others replaced by an empty piece."""
        out, failed = [], set()
        for i, job in enumerate(jobs):
            try:
                job = self._prepared(job)
                self._values(job)  # raises here, per tensor, for what cannot be read
                out.append(job)
            except Exception as err:
                failed.add(i)
                _warn(warn, job.name, err)
                out.append(dataclasses.replace(job, pieces=[torch.empty(0)], save_raw=False, save_shape=False))
        return out, failed

    def _one_by_one(self, jobs: Sequence[TensorJob], warn: Callable[[str], None] | None) -> HostStatistics:
        parts = []
        for job in jobs:
            try:
                parts.append(self._compute([job], None))
            except Exception as err:
                _warn(warn, job.name, err)
        return HostStatistics.concat(parts)

    def _compute(self, jobs: Sequence[TensorJob], reducer: WorkerReducer | None, derived: DerivedScalars | None = None) -> HostStatistics:
        metas = [
            _JobMeta(
                job.name,
                job.stats,
                job.histogram if job.histogram is not None and job.histogram.enabled and not job.plain_scalar else None,
                job.plain_scalar,
                _shape_of(job) if job.save_shape else None,
                int(job.pieces[0].shape[-1]) if job.pieces and job.pieces[0].dim() > 0 else 1,
                sum(p.numel() for p in job.pieces),
            )
            for job in jobs
        ]
        if not jobs:
            host = HostStatistics(metas, np.zeros((0, len(PARTIALS))), {}, {})
            if derived is not None:
                host.derived_names, host.derived_values = derived.names, self._to_host(derived.values)
            return host
        values = [self._values(job) for job in jobs]
        device = values[0].device
        values = [v if v.device == device else v.to(device) for v in values]
        partitioned = [job.partitioned for job in jobs]
        reduced = [i for i, job in enumerate(jobs) if any(isinstance(p, ReducedPiece) for p in job.pieces)]
        rows, gathered = self._rows(jobs, values, metas, reduced)
        local_rows = rows
        if reducer is not None:
            rows = reducer.merge_rows(rows, torch.tensor(partitioned, device=device))
        hist_index = [i for i, meta in enumerate(metas) if meta.histogram is not None]
        device_hists = self._histograms(
            hist_index, values, metas, rows[:, COL["min"]], rows[:, COL["max"]], None, partitioned, reducer, gathered
        )
        host_rows, host_hists, host_derived = self._copy(rows, device_hists, derived.values if derived is not None else None)

        # Second pass, only for tensors holding NaN/Inf (sum, min and max reveal them).
        nonempty = host_rows[:, COL["count"]] > 0
        with np.errstate(invalid="ignore"):
            finite = np.isfinite(host_rows[:, [COL["sum"], COL["min"], COL["max"]]]).all(axis=1)
        nonfinite = nonempty & ~finite
        host_rows[~nonfinite, COL["nan_count"]] = 0.0
        host_rows[~nonfinite, COL["inf_count"]] = 0.0
        redo = np.flatnonzero(nonfinite).tolist()
        if redo:
            # a reduced job's values are only its sample: its exact counts are in its own row
            counts = torch.stack([
                local_rows[i, [COL["nan_count"], COL["inf_count"]]] if i in reduced else nonfinite_counts(values[i])
                for i in redo
            ]).to(torch.float64)
            # Collectives only for partitioned tensors: their merged rows and agreed edges are the
            # same on every rank, so every rank redoes the same ones (a replicated tensor's local
            # data must not decide a collective), and a replicated tensor's counts are already whole.
            shared_redo = [j for j, i in enumerate(redo) if partitioned[i]] if reducer is not None else []
            if shared_redo:
                at = torch.tensor(shared_redo, device=counts.device)
                counts[at] = reducer.sum(counts[at])  # NaN/Inf are partitioned exactly like the values
            again = [i for i in redo if i in host_hists]
            shared_again = [i for i in again if partitioned[i]] if reducer is not None else []
            low, high, masks = [], [], {}
            for i in again:
                sample = strided_sample(values[i], metas[i].histogram.sample, metas[i].period)
                is_finite = torch.isfinite(sample)
                masks[i] = is_finite
                # an empty sample (a rank without this tensor) must not move the agreed range: +-inf
                low.append(torch.where(is_finite, sample, math.inf).amin() if sample.numel() else torch.tensor(math.inf, device=device))
                high.append(torch.where(is_finite, sample, -math.inf).amax() if sample.numel() else torch.tensor(-math.inf, device=device))
            lows = torch.full((len(values),), math.nan, dtype=torch.float64, device=device)
            highs = lows.clone()
            if again:
                where = torch.tensor(again, device=device)
                lows[where] = torch.stack(low).to(torch.float64)
                highs[where] = torch.stack(high).to(torch.float64)
                if shared_again:  # a sample's finite range is local: agree on it
                    at = torch.tensor(shared_again, device=device)
                    lows[at], highs[at] = reducer.min_max(lows[at], highs[at])
            redo_hists = self._histograms(shared_again, values, metas, lows, highs, masks, partitioned, reducer)
            redo_hists += self._histograms(
                [i for i in again if i not in shared_again], values, metas, lows, highs, masks, partitioned, None
            )
            extra_rows, extra_hists, _ = self._copy(counts, redo_hists)
            for j, i in enumerate(redo):
                host_rows[i, COL["nan_count"]] = extra_rows[j, 0]
                host_rows[i, COL["inf_count"]] = extra_rows[j, 1]
            host_hists.update(extra_hists)

        raw = {
            i: (job.raw if job.raw is not None else values[i]).reshape(_shape_of(job)).cpu().numpy().copy()
            for i, job in enumerate(jobs) if job.save_raw
        }
        host = HostStatistics(metas, host_rows, host_hists, raw)
        if derived is not None:
            host.derived_names, host.derived_values = derived.names, host_derived
        return host

    def _rows(
        self, jobs: Sequence[TensorJob], values: list[torch.Tensor], metas: list[_JobMeta], reduced: list[int]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Partial rows of every job, and the histogram samples already gathered: reduced jobs
        bring theirs (rows of several calls merged), the others are reduced here."""
        device = values[0].device
        rows = torch.full((len(jobs), len(PARTIALS)), math.nan, dtype=torch.float64, device=device)
        gathered: dict[int, torch.Tensor] = {}
        if reduced:
            pieces = [self._reduced_pieces(jobs[i]) for i in reduced]
            # every piece's row converted at once; a module called several times merges its rows
            flat = [p for ps in pieces for p in ps]
            native_at = [k for k, p in enumerate(flat) if p.partial_row is None]
            piece_rows = torch.empty((len(flat), len(PARTIALS)), dtype=torch.float64)
            if native_at:
                piece_rows[native_at] = torch.from_numpy(native_partial_rows(np.stack([flat[k].native_row for k in native_at])))
            for k, p in enumerate(flat):
                if p.partial_row is not None:
                    piece_rows[k] = p.partial_row.to(torch.float64).cpu()
            starts = np.cumsum([0] + [len(ps) for ps in pieces]).tolist()
            merged = [
                piece_rows[a] if b - a == 1 else merge_partials(piece_rows[a:b])
                for a, b in zip(starts[:-1], starts[1:], strict=True)
            ]
            rows.index_copy_(0, torch.tensor(reduced, device=device), torch.stack(merged).to(device))
            for i in reduced:
                if metas[i].histogram is not None:  # the samples of several calls: at most `sample` of them
                    gathered[i] = strided_sample(values[i], metas[i].histogram.sample)
        rest = [i for i in range(len(jobs)) if i not in set(reduced)]
        if rest:
            strides = {
                k: sample_stride(values[i].numel(), metas[i].histogram.sample, metas[i].period)
                for k, i in enumerate(rest)
                if metas[i].histogram is not None and metas[i].histogram.reject_outliers <= 0.0
            }
            rest_rows, rest_gathered = partial_rows_and_samples(
                [values[i] for i in rest], [needed_columns(jobs[i].stats) for i in rest], self._scratch_for, strides
            )
            rows = rest_rows if len(rest) == len(jobs) else rows.index_copy(0, torch.tensor(rest, device=device), rest_rows)
            gathered.update({rest[k]: sample for k, sample in rest_gathered.items()})
        return rows, gathered

    def _histograms(
        self,
        index: list[int],
        values: list[torch.Tensor],
        metas: list[_JobMeta],
        lows: torch.Tensor,
        highs: torch.Tensor,
        masks: dict[int, torch.Tensor] | None,
        partitioned: list[bool],
        reducer: WorkerReducer | None,
        gathered: dict[int, torch.Tensor] | None = None,
    ) -> list[_DeviceHistograms]:
        """Histograms of the jobs in ``index``, batched by (bins, dtype, fixed range).

        ``lows``/``highs`` ``[N]`` give each tensor's range unless its config fixes one or rejects
        outliers; ``masks[i]`` (over the sample) leaves values out. ``gathered[i]``, where given,
        is tensor ``i``'s strided sample, already gathered (by the compiled kernel).
        """
        groups: dict[tuple[int, torch.dtype, tuple[float, float] | None], list[int]] = {}
        for i in index:
            config = metas[i].histogram
            groups.setdefault((config.bins, values[i].dtype, config.range), []).append(i)
        out = []
        for (bins, dtype, fixed), members in groups.items():
            native_group = self._native_histograms(members, values, metas, lows, highs, masks, bins, dtype, fixed, gathered or {})
            if native_group is not None:
                out.append(_merge_workers(native_group, partitioned, reducer))
                continue
            device = values[members[0]].device
            where = torch.tensor(members, device=device)
            samples, group_masks, sampled = [], [], []
            low, high = lows[where].clone(), highs[where].clone()
            rejected = torch.zeros(len(members), dtype=torch.float64, device=device)
            for g, i in enumerate(members):
                config = metas[i].histogram
                sample = strided_sample(values[i], config.sample, metas[i].period)
                mask = masks.get(i) if masks else None
                if config.reject_outliers > 0.0:  # rare: a per-tensor median and quantile
                    kept, n_rejected = reject_outliers(sample, config.reject_outliers)
                    mask = kept if mask is None else mask & kept
                    rejected[g] = n_rejected.to(torch.float64)
                    if sample.numel():
                        low[g] = torch.where(kept, sample, math.inf).amin().to(torch.float64)
                        high[g] = torch.where(kept, sample, -math.inf).amax().to(torch.float64)
                samples.append(sample)
                group_masks.append(mask)
                sampled.append(sample.numel() < metas[i].numel)
            if reducer is not None and any(metas[i].histogram.reject_outliers > 0 for i in members):
                low, high = reducer.min_max(low, high)
            data_low, data_high = low, high  # reported as the histogram's min/max, also with a fixed range
            if fixed is not None:
                low, high = torch.full_like(low, fixed[0]), torch.full_like(high, fixed[1])
            low, high = histogram_range(low, high, dtype)  # also: no range (all NaN, empty) -> [-0.5, 0.5]
            counts, scale, below, above = histogram_counts(samples, low, high, bins, group_masks, clip=fixed is not None)
            extra = torch.stack(
                [low, high, scale, data_low, data_high, counts.sum(1), rejected, below, above]
            ).to(torch.float64).T.contiguous()
            out.append(_merge_workers(_DeviceHistograms(members, counts, extra, sampled, dtype), partitioned, reducer))
        return out

    def _native_histograms(
        self,
        members: list[int],
        values: list[torch.Tensor],
        metas: list[_JobMeta],
        lows: torch.Tensor,
        highs: torch.Tensor,
        masks: dict[int, torch.Tensor] | None,
        bins: int,
        dtype: torch.dtype,
        fixed: tuple[float, float] | None,
        gathered: dict[int, torch.Tensor],
    ) -> _DeviceHistograms | None:
        """The group binned by the compiled kernel (CPU tensors, no mask, no outlier rejection):
        the same ranges, scales and bins as the PyTorch path, without its per-tensor ops."""
        if (
            lows.device.type != "cpu"
            or (masks and any(i in masks for i in members))
            or any(metas[i].histogram.reject_outliers > 0.0 for i in members)
            or not all(native.supports(values[i]) for i in members)
            or not native.available()
        ):
            return None
        # in numpy: the same IEEE operations as the PyTorch path, without a dozen ops on 16 values
        data_low = lows.numpy().astype(np.float64, copy=False)[members]
        data_high = highs.numpy().astype(np.float64, copy=False)[members]
        low, high = (data_low, data_high) if fixed is None else (np.full_like(data_low, fixed[0]), np.full_like(data_high, fixed[1]))
        low, high = histogram_range(low, high, dtype)  # the same ranges and scales as the PyTorch path
        scale = histogram_scale(low, high, bins)
        strides = [sample_stride(values[i].numel(), metas[i].histogram.sample, metas[i].period) for i in members]
        # a sample gathered by the moments kernel is read contiguously; else every stride-th value
        sources = [gathered[i] if i in gathered else values[i] for i in members]
        read_every = [1 if i in gathered else stride for i, stride in zip(members, strides, strict=True)]
        found = native.histograms(sources, read_every, low, high, scale, bins, clip=fixed is not None)
        if found is None:
            return None
        counts, below, above = found
        binned = counts.sum(1)
        extra = np.stack([low, high, scale, data_low, data_high, binned, np.zeros(len(members)), below, above]).astype(np.float64).T
        sampled = [
            (gathered[i].numel() if i in gathered else -(-values[i].numel() // stride)) < metas[i].numel
            for i, stride in zip(members, strides, strict=True)
        ]
        return _DeviceHistograms(members, torch.from_numpy(counts), torch.from_numpy(np.ascontiguousarray(extra)), sampled, dtype)

    def _copy(
        self, rows: torch.Tensor, hists: list[_DeviceHistograms], derived: torch.Tensor | None = None
    ) -> tuple[np.ndarray, dict[int, _HostHistogram], np.ndarray]:
        """One device-to-host copy of ``rows``, every histogram and the ``derived`` values."""
        parts = [rows.reshape(-1).to(torch.float64)]
        for h in hists:
            parts += [h.counts.reshape(-1).to(torch.float64), h.extra.reshape(-1)]
        if derived is not None:
            parts.append(derived.to(device=rows.device, dtype=torch.float64).reshape(-1))
        flat = self._to_host(torch.cat(parts))
        host_derived = flat[len(flat) - derived.numel():].copy() if derived is not None else np.zeros(0)
        n_rows = rows.numel()
        host_rows = flat[:n_rows].reshape(rows.shape).copy()
        out: dict[int, _HostHistogram] = {}
        offset = n_rows
        for h in hists:
            groups, bins = h.counts.shape
            counts = flat[offset : offset + groups * bins].reshape(groups, bins).astype(np.int64)
            offset += groups * bins
            extra = flat[offset : offset + groups * 9].reshape(groups, 9)
            offset += groups * 9
            dtype = np.dtype(str(h.dtype).removeprefix("torch."))
            for g, i in enumerate(h.index):
                low, high, scale, data_low, data_high, binned, rejected, underflow, overflow = extra[g]
                out[i] = _HostHistogram(
                    counts[g].copy(), float(low), float(high), float(scale), dtype, float(data_low), float(data_high),
                    int(binned), int(rejected), int(underflow), int(overflow), h.sampled[g],
                )
        return host_rows, out, host_derived


def _merge_workers(
    hists: _DeviceHistograms, partitioned: list[bool], reducer: WorkerReducer | None
) -> _DeviceHistograms:
    """Sum the counts of partitioned tensors over the workers (their ranges are agreed already).
    Replicated tensors are identical on every rank: summing them would count world_size times."""
    if reducer is None or not any(partitioned[i] for i in hists.index):
        return hists
    shared = torch.tensor([partitioned[i] for i in hists.index], device=hists.counts.device)
    counts = torch.where(shared[:, None], reducer.sum(hists.counts), hists.counts)
    extra = hists.extra.clone()
    extra[:, 5:] = torch.where(shared[:, None], reducer.sum(extra[:, 5:]), extra[:, 5:])
    return dataclasses.replace(hists, counts=counts, extra=extra)


def _shape_of(job: TensorJob) -> tuple[int, ...]:
    if len(job.pieces) == 1:
        return tuple(job.pieces[0].shape)
    return (sum(p.numel() for p in job.pieces),)


def _warn(warn: Callable[[str], None] | None, name: str, err: Exception) -> None:
    message = f"could not summarise {name}: {type(err).__name__}: {err} (left out of the record; the other tensors are recorded)"
    if warn is not None:
        warn(message)
    else:
        warnings.warn(f"tensorlens: {message}", stacklevel=3)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A strided tensor of plain values: quantized dequantized, nested flattened, mkldnn densified,
    lazy conjugation and negation resolved. Meta tensors hold no values: an error."""
    if tensor.device.type == "meta":
        raise ValueError("a meta tensor holds no values")
    if tensor.is_quantized:
        tensor = tensor.dequantize()
    if tensor.is_nested:
        parts = tensor.unbind()
        tensor = torch.cat([p.reshape(-1) for p in parts]) if parts else tensor.new_empty(0)
    if tensor.layout == torch._mkldnn:  # type: ignore[attr-defined]
        tensor = tensor.to_dense()
    if tensor.layout != torch.strided:
        raise ValueError(f"tensors of layout {tensor.layout} are not supported")
    return tensor.resolve_conj().resolve_neg()
