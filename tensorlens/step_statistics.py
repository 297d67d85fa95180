"""Statistics of every tensor of one saved step, computed in a batch with one host copy.

The training thread calls :meth:`StepStatistics.compute` with all the tensors of a step. Every
partial row and histogram is computed on the tensors' device without a host sync; then one
``.cpu()`` of one concatenated buffer brings everything over. Only a step in which some tensor
holds NaN or Inf (or whose float32 histogram edges collapse) needs a second, smaller pass and copy.
The host side is turned into records later, on the dispatcher thread (:meth:`HostStatistics.entries`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from tensorlens.config import HistogramConfig
from tensorlens.records import HistogramEntry, ScalarEntry, TensorEntry
from tensorlens.reductions import (
    COL,
    PARTIALS,
    as_values,
    finalize,
    histogram_counts,
    histogram_edges,
    needed_columns,
    nonfinite_counts,
    partial_row,
    reject_outliers,
    strided_sample,
)


@dataclasses.dataclass
class TensorJob:
    """One named tensor to summarise. ``pieces`` are concatenated (several calls of one module)."""

    name: str
    pieces: list[torch.Tensor]
    stats: tuple[str, ...]
    histogram: HistogramConfig | None = None
    save_raw: bool = False
    save_shape: bool = False
    plain_scalar: bool = False  # record the value itself (a loss, a summary scalar)
    # Under torch.distributed: True when each rank holds a different piece (activations of its
    # batch, an FSDP shard) that must be merged; False when every rank holds the same tensor
    # (DDP parameters and their all-reduced gradients), which is then taken as it is.
    partitioned: bool = True


class WorkerReducer(Protocol):
    """Cross-worker merging of device results (implemented for ``torch.distributed``).

    Every worker must call these in the same order with tensors of the same shapes.
    """

    def merge_rows(self, rows: torch.Tensor, partitioned: torch.Tensor) -> torch.Tensor:
        """Merge ``rows`` [N, K] across workers where ``partitioned`` [N] (bool) is True."""
        ...

    def min_max(self, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def sum(self, values: torch.Tensor) -> torch.Tensor: ...


@dataclasses.dataclass
class _JobMeta:
    """What the host needs of a job once the device tensors are gone."""

    name: str
    stats: tuple[str, ...]
    histogram: HistogramConfig | None
    plain_scalar: bool
    shape: tuple[int, ...] | None


@dataclasses.dataclass
class _HostHistogram:
    counts: np.ndarray
    edges: np.ndarray
    low: float
    high: float
    binned: int
    rejected: int
    underflow: int
    overflow: int
    sampled: bool


@dataclasses.dataclass
class HostStatistics:
    """The host copy of one step's statistics; :meth:`entries` turns it into record entries."""

    jobs: list[_JobMeta]
    rows: np.ndarray  # [N, len(PARTIALS)] float64
    histograms: dict[int, _HostHistogram]
    raw: dict[int, np.ndarray]

    def entries(self) -> tuple[list[ScalarEntry], list[HistogramEntry], list[TensorEntry], dict[str, tuple[int, ...]]]:
        scalars: list[ScalarEntry] = []
        histograms: list[HistogramEntry] = []
        tensors = [TensorEntry(self.jobs[i].name, value) for i, value in self.raw.items()]
        shapes = {job.name: job.shape for job in self.jobs if job.shape is not None}
        for i, job in enumerate(self.jobs):
            row = self.rows[i]
            if job.plain_scalar:  # a scalar called several times in a step is recorded as the mean
                count = row[COL["count"]]
                scalars.append(ScalarEntry(job.name, None, float(row[COL["sum"]] / count) if count else float("nan")))
                continue
            for stat, value in finalize(row, job.stats).items():
                scalars.append(ScalarEntry(job.name, stat, value))
            hist = self.histograms.get(i)
            if hist is not None:
                histograms.append(
                    HistogramEntry(
                        tensor=job.name,
                        counts=hist.counts,
                        edges=hist.edges,
                        min=hist.low,
                        max=hist.high,
                        count=hist.binned,
                        sum=float(row[COL["sum"]]),
                        sum_squares=float(row[COL["sumsq"]]) if not math.isnan(row[COL["sumsq"]]) else float("nan"),
                        nan_count=int(row[COL["nan_count"]]),
                        inf_count=int(row[COL["inf_count"]]),
                        rejected=hist.rejected,
                        underflow=hist.underflow,
                        overflow=hist.overflow,
                        sampled=hist.sampled,
                    )
                )
        return scalars, histograms, tensors, shapes


@dataclasses.dataclass
class _DeviceHistogram:
    counts: torch.Tensor  # int64 [bins]
    edges: torch.Tensor  # float64 [bins + 1]
    extra: torch.Tensor  # float64 [low, high, binned, rejected, underflow, overflow]
    sampled: bool


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
        pieces = []
        for piece in job.pieces:
            piece = piece.detach()
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

    def compute(self, jobs: Sequence[TensorJob], reducer: WorkerReducer | None = None) -> HostStatistics:
        metas = [
            _JobMeta(
                job.name,
                job.stats,
                job.histogram if job.histogram is not None and job.histogram.enabled and not job.plain_scalar else None,
                job.plain_scalar,
                _shape_of(job) if job.save_shape else None,
            )
            for job in jobs
        ]
        if not jobs:
            return HostStatistics(metas, np.zeros((0, len(PARTIALS))), {}, {})
        values = [self._values(job) for job in jobs]
        device = values[0].device
        rows = torch.stack(
            [
                partial_row(v, needed_columns(job.stats), self._scratch_for(v)).to(device)
                for v, job in zip(values, jobs, strict=True)
            ]
        )
        if reducer is not None:
            partitioned = torch.tensor([job.partitioned for job in jobs], device=device)
            rows = reducer.merge_rows(rows, partitioned)
        hist_index = [i for i, meta in enumerate(metas) if meta.histogram is not None]
        device_hists = {
            i: self._histogram(values[i], metas[i].histogram, rows[i, COL["min"]], rows[i, COL["max"]], None, reducer)
            for i in hist_index
        }
        host_rows, host_hists = self._copy(rows, device_hists)

        # Second pass, only for tensors holding NaN/Inf (min/max propagate them) or whose edges collapsed
        minimum, maximum = host_rows[:, COL["min"]], host_rows[:, COL["max"]]
        nonempty = host_rows[:, COL["count"]] > 0
        nonfinite = nonempty & ~(np.isfinite(minimum) & np.isfinite(maximum))
        host_rows[~nonfinite, COL["nan_count"]] = 0.0
        host_rows[~nonfinite, COL["inf_count"]] = 0.0
        collapsed = {i for i, h in host_hists.items() if not np.all(np.diff(h.edges) > 0)}
        redo = sorted(set(np.flatnonzero(nonfinite).tolist()) | collapsed)
        if redo:
            counts = torch.stack([nonfinite_counts(values[i]) for i in redo])
            if reducer is not None:
                counts = reducer.sum(counts)
            redo_hists = {}
            for i in redo:
                if i not in device_hists:
                    continue
                v = values[i] if i not in collapsed else values[i].to(torch.float64)
                sample = strided_sample(v, metas[i].histogram.sample)
                finite = torch.isfinite(sample)
                low = torch.where(finite, sample, math.inf).amin() if sample.numel() else torch.zeros((), device=device)
                high = torch.where(finite, sample, -math.inf).amax() if sample.numel() else torch.zeros((), device=device)
                redo_hists[i] = self._histogram(v, metas[i].histogram, low, high, finite, reducer)
            extra_rows, extra_hists = self._copy(counts, redo_hists)
            for j, i in enumerate(redo):
                host_rows[i, COL["nan_count"]] = extra_rows[j, 0]
                host_rows[i, COL["inf_count"]] = extra_rows[j, 1]
            host_hists.update(extra_hists)

        raw = {i: values[i].reshape(_shape_of(job)).cpu().numpy().copy() for i, job in enumerate(jobs) if job.save_raw}
        return HostStatistics(metas, host_rows, host_hists, raw)

    def _histogram(
        self,
        values: torch.Tensor,
        config: HistogramConfig,
        low: torch.Tensor,
        high: torch.Tensor,
        finite: torch.Tensor | None,
        reducer: WorkerReducer | None,
    ) -> _DeviceHistogram:
        sample = strided_sample(values, config.sample)
        sampled = sample.numel() < values.numel()
        mask = finite
        rejected = torch.zeros((), dtype=torch.float64, device=values.device)
        if config.reject_outliers > 0.0:
            kept, n_rejected = reject_outliers(sample, config.reject_outliers)
            mask = kept if mask is None else (mask & kept)
            rejected = n_rejected.to(torch.float64)
            if sample.numel():
                low = torch.where(kept, sample, math.inf).amin()
                high = torch.where(kept, sample, -math.inf).amax()
            if reducer is not None:
                low, high = reducer.min_max(low, high)
        low = low.to(torch.float64)
        high = high.to(torch.float64)
        # An all-NaN or empty tensor has no range: bin nothing over [-0.5, 0.5].
        no_range = ~(torch.isfinite(low) & torch.isfinite(high))
        low = torch.where(no_range, torch.zeros_like(low), low)
        high = torch.where(no_range, torch.zeros_like(high), high)
        underflow = overflow = torch.zeros((), dtype=torch.float64, device=values.device)
        if config.range is not None:
            fixed_low, fixed_high = config.range
            edges = histogram_edges(
                torch.tensor(fixed_low, dtype=torch.float64, device=values.device),
                torch.tensor(fixed_high, dtype=torch.float64, device=values.device),
                config.bins,
                sample.dtype,
            )
            underflow = (sample < edges[0]).sum().to(torch.float64)
            overflow = (sample > edges[-1]).sum().to(torch.float64)
        else:
            edges = histogram_edges(low, high, config.bins, sample.dtype)
        counts = histogram_counts(sample, edges, mask)
        extra = torch.stack([low, high, counts.sum().to(torch.float64), rejected, underflow, overflow])
        if reducer is not None:
            counts = reducer.sum(counts)
            summed = reducer.sum(extra[2:])
            extra = torch.cat([extra[:2], summed])
        return _DeviceHistogram(counts, edges.to(torch.float64), extra, sampled)

    def _copy(
        self, rows: torch.Tensor, hists: dict[int, _DeviceHistogram]
    ) -> tuple[np.ndarray, dict[int, _HostHistogram]]:
        """One device-to-host copy of ``rows`` and every histogram."""
        parts = [rows.reshape(-1).to(torch.float64)]
        for h in hists.values():
            parts += [h.counts.to(torch.float64), h.edges, h.extra]
        flat = self._to_host(torch.cat(parts))
        n_rows = rows.numel()
        host_rows = flat[:n_rows].reshape(rows.shape).copy()
        out: dict[int, _HostHistogram] = {}
        offset = n_rows
        for i, h in hists.items():
            bins = h.counts.numel()
            counts = flat[offset : offset + bins].astype(np.int64)
            offset += bins
            edges = flat[offset : offset + bins + 1].copy()
            offset += bins + 1
            low, high, binned, rejected, underflow, overflow = flat[offset : offset + 6]
            offset += 6
            out[i] = _HostHistogram(
                counts, edges, float(low), float(high), int(binned), int(rejected), int(underflow), int(overflow), h.sampled
            )
        return host_rows, out


def _shape_of(job: TensorJob) -> tuple[int, ...]:
    if len(job.pieces) == 1:
        return tuple(job.pieces[0].shape)
    return (sum(p.numel() for p in job.pieces),)
