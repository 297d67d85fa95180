"""Statistics of every tensor of one saved step, computed in a batch with one host copy.

The training thread calls :meth:`StepStatistics.compute` with all the tensors of a step. Their
layout (:class:`~tensorlens.compute.plan.StepPlan`: what is reduced by the compiled kernel,
how the rest is grouped for PyTorch ops, the histogram groups) is built once and reused while the
jobs keep their shape. Every partial row and histogram is computed on the tensors' device; then
one ``.cpu()`` of one concatenated buffer brings everything over.

Tensors holding NaN or Inf: the compiled kernel counts them exactly in its one read. With PyTorch
ops the strategy depends on where the tensors live. On a CPU, reading a result costs nothing, so
the counts are taken only for tensors whose sum, min or max is not finite, in a few float ops.
On any other device (``sync_free``) the host must never wait: every tensor's NaN and Inf are
counted in the first pass, every histogram sample's finite range is taken, and the range is
chosen on the device. Either way a histogram of such a tensor spans its sample's finite values.

Histogram edges are derived exactly on the host, off the training thread
(:func:`~tensorlens.stats.edges.exact_edges`), when :mod:`tensorlens.dispatch.assemble` builds the
step's one record on the dispatcher thread.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from tensorlens.compute.host_statistics import HistogramBlock, HostStatistics
from tensorlens.compute.job_values import plain, prepared, reduced_pieces
from tensorlens.compute.jobs import DerivedScalars, ReducedPiece, TensorJob, WorkerReducer
from tensorlens.compute.plan import REDUCED, VALUES, HistogramGroup, StepPlan, plain_signature, shape_of, signature
from tensorlens.compute.plan_cache import PlanCache
from tensorlens.stats import native
from tensorlens.stats.histogram import (
    histogram_counts,
    histogram_range,
    histogram_scale,
    reject_outliers,
    stack_samples,
    strided_sample,
)
from tensorlens.stats.moments import COL, PARTIALS, as_values, merge_partials, native_partial_rows
from tensorlens.stats.torch_rows import finite_range_rows
from tensorlens.stats.triton.histograms import triton_histograms

_NAN, _INF = COL["nan_count"], COL["inf_count"]


@dataclasses.dataclass
class _DeviceHistograms:
    """Histograms of several jobs, still on the device."""

    index: list[int]  # job indices, one per row below
    counts: torch.Tensor  # int64 [G, bins]
    # float64 [G, 9]: bin low, bin high, scale, data min, data max, binned, rejected, underflow, overflow
    extra: torch.Tensor
    sampled: list[bool]
    dtype: torch.dtype  # the dtype values were binned in; the host derives exact edges in it

    def on_host(self, counts: np.ndarray, extra: np.ndarray) -> HistogramBlock:
        """These histograms as the host block of their copied ``counts`` and ``extra``."""
        return HistogramBlock(
            np.asarray(self.index, dtype=np.intp), counts, extra, np.asarray(self.sampled, dtype=bool),
            np.dtype(str(self.dtype).removeprefix("torch.")),
        )


class StepStatistics:
    """Computes :class:`HostStatistics` for a list of :class:`TensorJob`.

    Keeps the last few plans (:class:`PlanCache`, reused while the jobs keep their shape) and one
    scratch buffer per (device, dtype), grown to the largest tensor seen, so the two-pass variance does not
    allocate a fresh buffer for every tensor. ``host_copies`` counts device-to-host copies, and
    ``plans_built`` the plans, for tests and benchmarks. ``sync_free`` takes, on a CPU too, the
    path that never waits for the device (the one every other device takes; tests use it).
    """

    def __init__(self, sync_free: bool = False) -> None:
        self._scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.host_copies = 0
        self.plans_built = 0
        self.sync_free = sync_free
        self._plan: StepPlan | None = None  # the plan used last
        self._plans = PlanCache()
        self._plain: list[tuple[Any, ...] | None] = []  # the last _isolate's plain_signature of each job
        self._warned_complex = False

    def _scratch_for(self, values: torch.Tensor) -> torch.Tensor:
        key = (values.device, values.dtype)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < values.numel():
            buf = torch.empty(values.numel(), dtype=values.dtype, device=values.device)
            self._scratch[key] = buf
        return buf

    def release(self) -> None:
        """Free the scratch buffers and the plan (the hook calls this on close)."""
        self._scratch.clear()
        self._plan, self._plans = None, PlanCache()

    # ------------------------------------------------------------------ entry

    def compute(
        self, jobs: Sequence[TensorJob], reducer: WorkerReducer | None = None, warn: Callable[[str], None] | None = None,
        derived: DerivedScalars | None = None,
    ) -> HostStatistics:
        """Statistics of ``jobs`` (and the ``derived`` values, in the same host copy). A tensor
        that cannot be summarised costs only itself: it is left out of the result with one
        warning naming it (``warn``), never the step."""
        if not jobs and derived is None and reducer is None:  # an unsaved step's end: nothing to do
            return HostStatistics.empty()
        jobs, failed, converted = self._isolate(jobs, warn)
        if reducer is not None:
            # every rank must make the same collectives: a failed job keeps its place with an
            # empty piece, then leaves the result
            host = self._compute(jobs, reducer, converted, derived=derived)
        else:
            try:
                host = self._compute(jobs, None, converted, derived=derived)
            except Exception:
                if len(jobs) - len(failed) < 2:
                    raise
                # a batched op failed on one tensor: find it, so the others are still recorded
                kept = [i for i in range(len(jobs)) if i not in failed]
                host = self._one_by_one([jobs[i] for i in kept], [converted.get(i) for i in kept], warn)
                if derived is not None:
                    host.derived_names, host.derived_values = derived.names, self._to_host(derived.values)
                return host
        return host.without(failed) if failed else host

    def _isolate(
        self, jobs: Sequence[TensorJob], warn: Callable[[str], None] | None
    ) -> tuple[list[TensorJob], set[int], dict[int, torch.Tensor]]:
        """Jobs whose values can be read: plain tensors as they are; the others prepared (sparse
        summarised, mixed pieces reduced) and converted (``converted[i]``), or replaced by an empty
        piece when they cannot be read."""
        plain = self._plain = [plain_signature(job) for job in jobs]
        if None not in plain:  # the usual step: every job a plain tensor, used as it is
            return list(jobs), set(), {}
        out, failed, converted = [], set(), {}
        for i, job in enumerate(jobs):
            if plain[i] is not None:
                out.append(job)
                continue
            try:
                job = prepared(job)
                if any(isinstance(piece, ReducedPiece) for piece in job.pieces):
                    job = dataclasses.replace(job, pieces=reduced_pieces(job))
                else:
                    converted[len(out)] = self._values(job)  # raises here, per tensor, for what cannot be read
                out.append(job)
            except Exception as err:
                failed.add(i)
                _warn(warn, job.name, err)
                out.append(dataclasses.replace(job, pieces=[torch.empty(0)], save_raw=False, save_shape=False, raw=None))
        return out, failed, converted

    def _one_by_one(
        self, jobs: Sequence[TensorJob], converted: list[torch.Tensor | None], warn: Callable[[str], None] | None
    ) -> HostStatistics:
        parts = []
        for job, values in zip(jobs, converted, strict=True):
            try:
                parts.append(self._compute([job], None, {0: values} if values is not None else {}, keep_plan=False))
            except Exception as err:
                _warn(warn, job.name, err)
        return HostStatistics.concat(parts)

    def _compute(
        self, jobs: list[TensorJob], reducer: WorkerReducer | None, converted: dict[int, torch.Tensor], keep_plan: bool = True,
        derived: DerivedScalars | None = None,
    ) -> HostStatistics:
        if not jobs:
            host = HostStatistics.empty()
            if derived is not None:
                host.derived_names, host.derived_values = derived.names, self._to_host(derived.values)
            return host
        known = self._plain if keep_plan and len(self._plain) == len(jobs) else None
        sig = signature(jobs, known)
        plan = self._plans.find(sig, self.sync_free) if keep_plan else None
        if plan is None:
            plan = StepPlan(jobs, sig, self.sync_free, converted)
            self.plans_built += 1
        if keep_plan:
            self._plan = self._plans.keep(plan)
        with torch.no_grad():
            return _Step(self, plan, jobs, reducer, converted).run(derived)

    # ------------------------------------------------------------------ values of unusual jobs

    def _values(self, job: TensorJob) -> torch.Tensor:
        """The job's values, flat in the compute dtype."""
        pieces = []
        for piece in job.pieces:
            piece = plain(piece.detach())
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

    def _to_host(self, tensor: torch.Tensor) -> np.ndarray:
        self.host_copies += 1
        return tensor.cpu().numpy()


class _Step:
    """One execution of a plan: this step's tensors through the plan's groups."""

    def __init__(
        self, engine: StepStatistics, plan: StepPlan, jobs: list[TensorJob], reducer: WorkerReducer | None,
        converted: dict[int, torch.Tensor],
    ) -> None:
        self.engine, self.plan, self.jobs, self.reducer = engine, plan, jobs, reducer
        self.converted = converted
        self.cpu = plan.device.type == "cpu"
        self.samples: dict[int, torch.Tensor] = {}  # histogram samples known before binning

    def _dense(self, i: int) -> torch.Tensor:
        """Dense job ``i``'s values, flat, on the plan's device."""
        values = self.converted[i] if i in self.converted else self.jobs[i].pieces[0].view(-1)
        if values.device != self.plan.device:
            values = values.to(self.plan.device, non_blocking=True)
        return values

    def _torch_values(self, i: int) -> torch.Tensor:
        """Values for the PyTorch path: a small plain tensor as it is (they are flattened together),
        the others flat."""
        if i in self.plan.small_torch:
            piece = self.jobs[i].pieces[0]
            return piece if piece.device == self.plan.device else piece.to(self.plan.device, non_blocking=True)
        return self._dense(i)

    def _torch_inputs(self) -> list[torch.Tensor]:
        """The values of the PyTorch path's jobs, in the plan's order."""
        if self.plan.torch_direct:  # every one a small plain tensor: the piece itself, no Python per tensor
            return [self.jobs[i].pieces[0] for i in self.plan.torch]
        return [self._torch_values(i) for i in self.plan.torch]

    def _flat(self, i: int) -> torch.Tensor:
        values = self.values[i] if i in self.values else self._dense(i)
        return values if values.dim() == 1 else values.view(-1)

    def run(self, derived: DerivedScalars | None = None) -> HostStatistics:
        plan, jobs = self.plan, self.jobs
        rows = self._rows()
        if self.reducer is not None:
            rows = self.reducer.merge_rows(rows, plan.partitioned)
        flagged = self._nonfinite(rows)
        hists = [self._histograms(group, rows, flagged) for group in plan.groups]
        host_rows, host_hists, host_derived = self._copy(rows, hists, derived.values if derived is not None else None)
        raw = {
            i: (job.raw if job.raw is not None else self._flat(i) if plan.kinds[i] != REDUCED else self.samples[i])
            .reshape(shape_of(job)).cpu().numpy().copy()
            for i, job in enumerate(jobs) if job.save_raw
        }
        host = HostStatistics(plan.metas, host_rows, host_hists, raw)
        if derived is not None:
            host.derived_names, host.derived_values = derived.names, host_derived
        return host

    # ------------------------------------------------------------------ partial rows

    def _rows(self) -> torch.Tensor:
        plan = self.plan
        if plan.all_torch:
            values = self._torch_inputs()
            self.values = dict(zip(plan.torch, values, strict=True))
            return plan.torch_rows.run(values, self.engine._scratch_for)
        self.values = {}
        if self.cpu:
            host = np.full((plan.n, len(PARTIALS)), math.nan)
            rows = torch.from_numpy(host)
        else:
            rows = torch.full((plan.n, len(PARTIALS)), math.nan, dtype=torch.float64, device=plan.device)
        if plan.native:
            pointers = [
                self.converted[i].data_ptr() if plan.kinds[i] == VALUES else self.jobs[i].pieces[0].data_ptr()
                for i in plan.native
            ]
            found = plan.moments.run(pointers)
            if found is None:
                raise RuntimeError("the compiled statistics kernel could not allocate its work arrays")
            block = native_partial_rows(found)
            block[~plan.native_mask] = math.nan  # as the PyTorch path: NaN where a column was not requested
            host[plan.native_at] = block
        if plan.triton:  # the fused kernels, reading each tensor where it lies
            values = [self._dense(i).contiguous() for i in plan.triton]
            self.values.update(zip(plan.triton, values, strict=True))
            rows.index_copy_(0, plan.triton_at, plan.triton_rows.run(values))
        if plan.reduced:
            rows.index_copy_(0, plan.reduced_at, self._reduced_rows().to(plan.device, non_blocking=True))
        if plan.torch:
            values = self._torch_inputs()
            self.values.update(zip(plan.torch, values, strict=True))
            rows.index_copy_(0, plan.torch_at, plan.torch_rows.run(values, self.engine._scratch_for))
        return rows

    def _reduced_rows(self) -> torch.Tensor:
        """Rows of the reduced jobs (several calls of a module merged), and their samples."""
        plan, jobs = self.plan, self.jobs
        pieces = [jobs[i].pieces for i in plan.reduced]
        flat = [p for ps in pieces for p in ps]
        if all(p.partial_row is None for p in flat):  # the kernel's rows (CPU activations): in numpy at once
            piece_rows = torch.from_numpy(native_partial_rows(np.stack([p.native_row for p in flat])))
        else:  # rows of sparse tensors, on their device (no host copy)
            piece_rows = torch.stack([
                p.partial_row.to(plan.device, torch.float64, non_blocking=True) if p.partial_row is not None
                else torch.from_numpy(native_partial_rows(p.native_row[None, :])[0]).to(plan.device, non_blocking=True)
                for p in flat
            ])
        if len(flat) == len(pieces):
            merged = piece_rows
        else:
            starts = np.cumsum([0] + [len(ps) for ps in pieces]).tolist()
            merged = torch.stack([
                piece_rows[a] if b - a == 1 else merge_partials(piece_rows[a:b])
                for a, b in zip(starts[:-1], starts[1:], strict=True)
            ])
        for i, ps in zip(plan.reduced, pieces, strict=True):
            if plan.metas[i].histogram is not None:  # the samples of several calls: at most `sample` of them
                sample = ps[0].sample if len(ps) == 1 else strided_sample(torch.cat([p.sample for p in ps]), plan.metas[i].histogram.sample)
                self.samples[i] = sample.contiguous()
        return merged

    def _nonfinite(self, rows: torch.Tensor) -> np.ndarray | torch.Tensor:
        """Which jobs hold NaN or Inf (a host array on a CPU, a device tensor elsewhere): every
        row's counts are exact already (the kernel's, or :class:`TorchRows`'s)."""
        plan = self.plan
        if plan.sync_free:
            return (rows[:, _NAN] + rows[:, _INF]) > 0
        host = rows.numpy()
        return (host[:, _NAN] + host[:, _INF]) > 0

    # ------------------------------------------------------------------ histograms

    def _sample(self, i: int) -> torch.Tensor:
        if i in self.samples:
            return self.samples[i]
        plan, meta = self.plan, self.plan.metas[i]
        if i in plan.strides:  # gathered by the kernel in its read
            return plan.moments.sample(plan.native_slot[i], plan.value_dtypes[i])
        return strided_sample(self._flat(i), meta.histogram.sample, meta.period)

    def _stacked(self, group: HistogramGroup, samples: _Samples) -> list[torch.Tensor]:
        """:meth:`HistogramLayout.stack` of the group's samples; tensors sampled whole are
        flattened together in one C++ call (no Python per tensor)."""
        assert group.layout is not None
        out = []
        small_flat = self.plan.torch_rows.small_flat if self.plan.torch_rows is not None else None
        for (length, at, _, _), jobs, gather in zip(group.layout.by_length, group.whole, group.gather, strict=True):
            if gather is not None and small_flat is not None:  # float64 from the group's dtype: back exactly
                out.append(small_flat.index_select(0, gather).view(-1, length).to(group.dtype))
            elif jobs is not None and len(jobs) > 1:
                tensors = [self.jobs[i].pieces[0] for i in jobs]
                out.append(torch._C._nn.flatten_dense_tensors(tensors).view(len(tensors), length))
            else:
                out.append(stack_samples(samples, at))
        return out

    def _histograms(self, group: HistogramGroup, rows: torch.Tensor, flagged: np.ndarray | torch.Tensor) -> _DeviceHistograms:
        plan, reducer = self.plan, self.reducer
        members = group.members
        if group.triton is not None:  # the Triton kernels: every sample read in place, ranges chosen on the device
            counts, extra = triton_histograms(group.triton, [self._flat(i) for i in members], rows, group.at, flagged, group.fixed,
                                              group.bins, group.dtype, reducer.min_max if reducer is not None else None)
            hists = _DeviceHistograms(members, counts, extra, group.sampled, group.dtype)
            return _merge_workers(hists, plan.partitioned_list, reducer, group.partitioned)
        if group.batch is not None and not plan.sync_free and not flagged[members].any():
            # the usual step: the kernel bins the samples it gathered, at pointers it knows
            host = rows.numpy()
            return _merge_workers(
                self._native_histograms(group, [], host[members, COL["min"]], host[members, COL["max"]]),
                plan.partitioned_list, reducer, group.partitioned,
            )
        samples = _Samples(self, members)  # read only where needed: the usual step stacks them in bulk
        stacked = self._stacked(group, samples) if group.layout is not None else None
        finite_only = False
        if plan.sync_free:
            # ranges chosen on the device: the tensor's, or its sample's finite one where it holds NaN/Inf
            low, high = rows[group.at, COL["min"]], rows[group.at, COL["max"]]
            finite_low, finite_high = finite_range_rows(samples, group.layout, low.dtype, stacked)
            if reducer is not None:
                finite_low, finite_high = reducer.min_max(finite_low, finite_high)
            holds = flagged[group.at]
            low, high = torch.where(holds, finite_low, low), torch.where(holds, finite_high, high)
            finite_only = True
        else:
            host = rows.numpy()
            low, high = host[members, COL["min"]], host[members, COL["max"]]
            holds = flagged[members]
            if holds.any():
                low, high = low.copy(), high.copy()
                redo = np.flatnonzero(holds).tolist()
                found = native.finite_ranges([samples[g] for g in redo], [1] * len(redo)) if all(
                    native.supports(samples[g]) for g in redo) else None
                if found is None:
                    finite_low, finite_high = finite_range_rows([samples[g] for g in redo], None, torch.float64)
                    found = finite_low.numpy(), finite_high.numpy()
                shared = [j for j, g in enumerate(redo) if plan.partitioned_list[members[g]]] if reducer is not None else []
                if shared:  # a sample's finite range is local: agree on it
                    agreed = reducer.min_max(torch.from_numpy(found[0][shared]), torch.from_numpy(found[1][shared]))
                    found[0][shared], found[1][shared] = agreed[0].numpy(), agreed[1].numpy()
                low[redo], high[redo] = found
                finite_only = True
            if not group.native:
                low, high = torch.from_numpy(low), torch.from_numpy(high)
        if group.native:  # the kernel never bins NaN or Inf
            out = self._native_histograms(group, samples, low, high)
        else:
            out = self._torch_histograms(group, samples, stacked, finite_only, low, high)
        return _merge_workers(out, plan.partitioned_list, reducer, group.partitioned)

    def _native_histograms(
        self, group: HistogramGroup, samples: Sequence[torch.Tensor], data_low: np.ndarray, data_high: np.ndarray
    ) -> _DeviceHistograms:
        """The group binned by the compiled kernel: the same ranges, scales and bins as the
        PyTorch path (ranges in numpy: the same IEEE operations, without a dozen ops on 16 values)."""
        fixed, bins = group.fixed, group.bins
        low, high = (data_low, data_high) if fixed is None else (np.full_like(data_low, fixed[0]), np.full_like(data_high, fixed[1]))
        low, high = histogram_range(low, high, group.dtype)
        scale = histogram_scale(low, high, bins)
        if group.batch is not None:
            found = group.batch.run(low, high, scale)
        else:
            found = native.histograms(list(samples), [1] * len(samples), low, high, scale, bins, clip=fixed is not None)
        if found is None:
            raise RuntimeError("the compiled statistics kernel is not available")
        counts, below, above = found
        extra = np.stack([low, high, scale, data_low, data_high, counts.sum(1), np.zeros(len(group.members)), below, above])
        return _DeviceHistograms(
            group.members, torch.from_numpy(counts), torch.from_numpy(np.ascontiguousarray(extra.astype(np.float64).T)),
            group.sampled, group.dtype,
        )

    def _torch_histograms(
        self, group: HistogramGroup, samples: Sequence[torch.Tensor], stacked: list[torch.Tensor] | None,
        finite_only: bool, low: torch.Tensor, high: torch.Tensor,
    ) -> _DeviceHistograms:
        plan, reducer, metas = self.plan, self.reducer, self.plan.metas
        device = plan.device
        low, high = low.to(torch.float64), high.to(torch.float64)  # on the device already (two-phase: the CPU)
        rejected = torch.zeros(len(samples), dtype=torch.float64, device=device)
        masks: list[torch.Tensor | None] = [None] * len(samples)
        if group.reject:
            low, high = low.clone(), high.clone()
            for g, i in enumerate(group.members):  # rare: a per-tensor median and quantile
                fraction = metas[i].histogram.reject_outliers
                if fraction <= 0.0:
                    continue
                kept, n_rejected = reject_outliers(samples[g], fraction)
                masks[g] = kept if masks[g] is None else masks[g] & kept
                rejected[g] = n_rejected.to(torch.float64)
                if samples[g].numel():
                    low[g] = torch.where(kept, samples[g], math.inf).amin().to(torch.float64)
                    high[g] = torch.where(kept, samples[g], -math.inf).amax().to(torch.float64)
            if reducer is not None:
                low, high = reducer.min_max(low, high)
        data_low, data_high = low, high  # reported as the histogram's min/max, also with a fixed range
        if group.fixed is not None:
            low, high = torch.full_like(low, group.fixed[0]), torch.full_like(high, group.fixed[1])
        low, high = histogram_range(low, high, group.dtype)  # also: no range (all NaN, empty) -> [-0.5, 0.5]
        if stacked is not None:
            stacked = [m if m.device == device else m.to(device, non_blocking=True) for m in stacked]
        counts, scale, below, above = histogram_counts(
            samples, low, high, group.bins, masks, clip=group.fixed is not None, layout=group.layout,
            finite_only=finite_only, stacked=stacked,
        )
        extra = torch.stack(
            [low, high, scale, data_low, data_high, counts.sum(1), rejected, below, above]
        ).to(torch.float64).T.contiguous()
        return _DeviceHistograms(group.members, counts, extra, group.sampled, group.dtype)

    # ------------------------------------------------------------------ the one host copy

    def _copy(
        self, rows: torch.Tensor, hists: list[_DeviceHistograms], derived: torch.Tensor | None = None
    ) -> tuple[np.ndarray, list[HistogramBlock], np.ndarray]:
        """One device-to-host copy of ``rows``, every histogram and the ``derived`` values (on a
        CPU, the arrays as they are)."""
        engine = self.engine
        if (
            self.cpu and not self.plan.sync_free and all(h.counts.device.type == "cpu" for h in hists)
            and (derived is None or derived.device.type == "cpu")
        ):
            # .cpu() of a CPU tensor is the tensor itself: counted as the step's one copy all the same
            host_derived = derived.to(torch.float64).numpy().copy() if derived is not None else np.zeros(0)
            return engine._to_host(rows), [h.on_host(h.counts.numpy(), h.extra.numpy()) for h in hists], host_derived
        parts = [rows.reshape(-1).to(torch.float64)]
        for h in hists:
            parts += [h.counts.reshape(-1).to(torch.float64), h.extra.reshape(-1).to(torch.float64)]
        if derived is not None:
            parts.append(derived.to(device=rows.device, dtype=torch.float64).reshape(-1))
        flat = engine._to_host(torch.cat(parts))
        host_derived = flat[len(flat) - derived.numel():].copy() if derived is not None else np.zeros(0)
        n_rows = rows.numel()
        host_rows = flat[:n_rows].reshape(rows.shape)
        offset, found = n_rows, []
        for h in hists:
            groups, bins = h.counts.shape
            counts = flat[offset : offset + groups * bins].reshape(groups, bins).astype(np.int64)
            offset += groups * bins
            found.append(h.on_host(counts, flat[offset : offset + groups * 9].reshape(groups, 9)))
            offset += groups * 9
        return host_rows, found, host_derived


class _Samples:
    """The histogram samples of a group's members, each taken on first use."""

    def __init__(self, step: _Step, members: list[int]) -> None:
        self._step, self._members = step, members
        self._found: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._members)

    def __getitem__(self, g: int) -> torch.Tensor:
        found = self._found.get(g)
        if found is None:
            found = self._found[g] = self._step._sample(self._members[g])
        return found

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[g] for g in range(len(self._members)))


def _merge_workers(
    hists: _DeviceHistograms, partitioned: list[bool], reducer: WorkerReducer | None, shared: torch.Tensor | None = None
) -> _DeviceHistograms:
    """Sum the counts of partitioned tensors over the workers (their ranges are agreed already).
    Replicated tensors are identical on every rank: summing them would count world_size times."""
    if reducer is None or not any(partitioned[i] for i in hists.index):
        return hists
    if shared is None or shared.device != hists.counts.device:
        shared = torch.tensor([partitioned[i] for i in hists.index], device=hists.counts.device)
    counts = torch.where(shared[:, None], reducer.sum(hists.counts), hists.counts)
    extra = hists.extra.clone()
    extra[:, 5:] = torch.where(shared[:, None], reducer.sum(extra[:, 5:]), extra[:, 5:])
    return dataclasses.replace(hists, counts=counts, extra=extra)


def _warn(warn: Callable[[str], None] | None, name: str, err: Exception) -> None:
    message = f"could not summarise {name}: {type(err).__name__}: {err} (left out of the record; the other tensors are recorded)"
    if warn is not None:
        warn(message)
    else:
        warnings.warn(f"tensorlens: {message}", stacklevel=3)
