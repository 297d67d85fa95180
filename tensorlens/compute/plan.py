"""The layout of a step's statistics, built once and reused while the jobs keep their shape.

A model's saved steps nearly always summarise the same tensors with the same configs: the same
names, sizes, dtypes and devices. Everything that depends only on those is derived once into a
:class:`StepPlan`: what the host keeps of each job, which jobs the compiled kernel reduces (with
its argument arrays), how the others are grouped for PyTorch ops (with their index tensors on the
device), the histogram groups, their sample buffers and layouts, and where each result lands. A
step then costs a pointer or a view per tensor and a fixed number of calls per group.

The plan is keyed by a signature of the jobs (names, configs, and each piece's kind, shape, dtype
and device), compared at every step: a changed tensor, a new one, another config or another
device gives a new plan (``tests/test_step_plan.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from tensorlens.compute.host_statistics import JobMeta
from tensorlens.compute.jobs import ReducedPiece, TensorJob
from tensorlens.names import record_safe
from tensorlens.stats import native
from tensorlens.stats.histogram import HistogramLayout, sample_stride
from tensorlens.stats.moments import NATIVE_COLUMNS, PARTIALS, needed_columns
from tensorlens.stats.path import NATIVE, TRITON, path_for
from tensorlens.stats.torch_rows import SMALL_TENSOR, TorchRows, to_device
from tensorlens.stats.triton.rows import TRITON_COLUMNS, SampleTable, TritonRows, triton_reads

_FLOATS = (torch.float32, torch.float64)

#: How a job's values are had at each step.
VIEW = "view"  # one plain contiguous float32/float64 strided tensor: used as it is
VALUES = "values"  # anything else dense: converted (dtype, several pieces, complex, quantized, ...)
REDUCED = "reduced"  # already reduced where it was captured, or sparse: a partial row and a sample


def plain_signature(job: TensorJob) -> tuple[Any, ...] | None:
    """:func:`signature`'s entry for ``job`` when it is one plain contiguous float32/float64 strided
    tensor, else ``None``: the check and the entry in one pass over its attributes (this runs for
    every tensor of every saved step). What the plan reads of such a tensor: its size and last
    dimension (the sample's period), and the whole shape only where it is recorded (``p.shape``
    builds a torch.Size, 4x the cost of both; ``p.device.type`` a device, 5x ``is_meta``)."""
    pieces = job.pieces
    if len(pieces) != 1 or job.raw is not None:
        return None
    p = pieces[0]
    if not (
        type(p) is not ReducedPiece and p.layout == torch.strided and p.dtype in _FLOATS and not p.is_nested
        and not p.is_meta and p.is_contiguous() and not p.is_conj() and not p.is_neg()
    ):
        return None
    return (*_head(job), VIEW, p.numel(), p.size(-1) if p.ndim else 0, p.shape if job.save_shape else None, p.dtype, p.device)


def _head(job: TensorJob) -> tuple[Any, ...]:
    """What a plan depends on of any job, besides its pieces."""
    return (job.name, job.stats, job.histogram, job.plain_scalar, job.save_raw, job.save_shape, job.partitioned)


def signature(jobs: list[TensorJob], plain: list[tuple[Any, ...] | None] | None = None) -> list[tuple[Any, ...]]:
    """What a plan depends on, per job. Cheap: a few attribute reads per tensor (no tensor op).
    ``plain[i]``: :func:`plain_signature` of job ``i``, where the caller has it already."""
    out = []
    for k, job in enumerate(jobs):
        entry = plain[k] if plain is not None else plain_signature(job)
        if entry is not None:
            out.append(entry)
            continue
        described = []
        for piece in job.pieces:
            if isinstance(piece, ReducedPiece):
                described.append((
                    REDUCED, piece.shape, piece.dtype, piece.device, piece.native_row is None,
                    piece.sample.numel(), piece.sample.dtype, piece.sample.device,
                ))
            else:
                described.append((type(piece), piece.layout, piece.shape if not piece.is_nested else None, piece.dtype,
                                  piece.device, piece.is_contiguous() if piece.layout == torch.strided else None))
        out.append((*_head(job), job.raw is not None, *described))
    return out


@dataclasses.dataclass
class HistogramGroup:
    """Histograms binned together: one bin count, one binned dtype, one fixed range (or none)."""

    bins: int
    dtype: torch.dtype
    fixed: tuple[float, float] | None
    members: list[int]  # job indices
    sample_lengths: list[int]
    sampled: list[bool]  # the sample is not the whole tensor
    native: bool  # binned by the compiled kernel from host samples
    reject: bool  # some member rejects outliers (PyTorch ops, one tensor at a time)
    at: torch.Tensor | None = None  # members, on the plan's device
    layout: HistogramLayout | None = None  # for PyTorch binning
    batch: native.HistogramBatch | None = None  # for native binning, when every sample's pointer is static
    triton: SampleTable | None = None  # for Triton binning: every member on the Triton path
    partitioned: torch.Tensor | None = None  # [G] bool, for merging counts across ranks
    # per ``layout.by_length`` entry: the job of each member, when every one is a plain tensor on
    # the plan's device sampled whole (stacked in one C++ call, no Python per tensor); else None
    whole: list[list[int] | None] = dataclasses.field(default_factory=list)
    # per ``layout.by_length`` entry: where those values lie in the PyTorch path's flat buffer of
    # small tensors (one gather instead of flattening them again), when all of them are there
    gather: list[torch.Tensor | None] = dataclasses.field(default_factory=list)


class StepPlan:
    """The static part of one step's statistics (see the module docstring)."""

    def __init__(
        self, jobs: list[TensorJob], sig: list[tuple[Any, ...]], sync_free: bool, converted: dict[int, torch.Tensor]
    ) -> None:
        """``converted``: this step's values of the jobs that are neither a plain tensor nor reduced
        (their size and dtype are known only once converted; the same signature gives the same)."""
        self.signature = sig
        self.n = len(jobs)
        self.kinds = [
            VIEW if s[7] == VIEW else REDUCED if any(isinstance(p, ReducedPiece) for p in j.pieces) else VALUES
            for s, j in zip(sig, jobs, strict=True)
        ]
        self.metas = [_meta(job) for job in jobs]
        devices = [_device_of(job) for job in jobs]
        accelerators = [d for d in devices if d.type != "cpu"]
        self.device = accelerators[0] if accelerators else torch.device("cpu")
        # on a CPU the host reads results for free; elsewhere the plan must never wait for the device
        self.sync_free = sync_free or self.device.type != "cpu"
        # native, triton or torch (tensorlens.stats.path); sync_free: the GPU's code, also on a CPU
        self.path = path_for(self.device, sync_free)
        self.native_on = self.path == NATIVE
        self.partitioned_list = [job.partitioned for job in jobs]
        self.partitioned = to_device(self.partitioned_list, torch.bool, self.device) if jobs else None
        self.columns = [needed_columns(job.stats) for job in jobs]
        self.dense = [i for i, kind in enumerate(self.kinds) if kind != REDUCED]
        self.reduced = [i for i, kind in enumerate(self.kinds) if kind == REDUCED]
        dense_dtypes = {i: converted[i].dtype if i in converted else jobs[i].pieces[0].dtype for i in self.dense}
        dense_numel = {i: converted[i].numel() if i in converted else self.metas[i].numel for i in self.dense}
        self.value_dtypes = dense_dtypes

        # the compiled kernel: dense CPU float tensors whose columns it computes
        self.native = [
            i for i in self.dense
            if self.native_on and self.device.type == "cpu" and dense_dtypes[i] in _FLOATS and self.columns[i] <= NATIVE_COLUMNS
        ]
        native_set = set(self.native)
        self.strides = {
            i: sample_stride(dense_numel[i], self.metas[i].histogram.sample, self.metas[i].period)
            for i in self.native
            if self.metas[i].histogram is not None and self.metas[i].histogram.reject_outliers <= 0.0
        }
        self.moments: native.MomentsBatch | None = None
        if self.native:
            self.moments = native.MomentsBatch(
                [dense_numel[i] for i in self.native], [dense_dtypes[i] == torch.float64 for i in self.native],
                [native.wants(self.columns[i]) for i in self.native], [self.strides.get(i, 0) for i in self.native],
            )
            self.native_at = np.array(self.native, dtype=np.intp)
            self.native_mask = np.stack([_column_mask(self.columns[i]) for i in self.native])
        self.native_slot = {i: k for k, i in enumerate(self.native)}

        # the Triton kernels: dense jobs whose columns they compute and whose dtype they read
        self.triton = [
            i for i in self.dense
            if self.path == TRITON and self.columns[i] <= TRITON_COLUMNS and triton_reads(jobs[i].pieces, jobs[i].name)
        ]
        self.triton_rows = TritonRows(
            [dense_numel[i] for i in self.triton], [dense_dtypes[i] for i in self.triton],
            [self.columns[i] for i in self.triton], self.device,
        ) if self.triton else None
        self.triton_at = to_device(self.triton, torch.int64, self.device) if self.triton else None
        triton_set = set(self.triton)

        # PyTorch ops: the other dense jobs
        self.torch = [i for i in self.dense if i not in native_set and i not in triton_set]
        self.torch_rows: TorchRows | None = None
        self.small_torch: set[int] = set()
        if self.torch:
            self.torch_rows = TorchRows(
                [dense_numel[i] for i in self.torch], [dense_dtypes[i] for i in self.torch],
                [self.columns[i] for i in self.torch], self.device, counts="always" if self.sync_free else "flagged",
            )
            self.torch_at = to_device(self.torch, torch.int64, self.device)
        # plain small tensors go to the PyTorch path as they are, flattened together there
        self.small_torch = {i for i in self.torch if self.kinds[i] == VIEW and dense_numel[i] <= SMALL_TENSOR}
        # every PyTorch-path job a small plain tensor on the plan's device: its values are the piece itself
        self.torch_direct = all(i in self.small_torch and jobs[i].pieces[0].device == self.device for i in self.torch)
        if self.reduced:
            self.reduced_at = to_device(self.reduced, torch.int64, self.device)
        self.all_torch = len(self.torch) == self.n

        self.groups = self._histogram_groups(jobs, dense_dtypes, dense_numel, native_set)

    def matches(self, sig: list[tuple[Any, ...]], sync_free: bool) -> bool:
        return (sync_free or self.device.type != "cpu") == self.sync_free \
            and self.path == path_for(self.device, sync_free) and sig == self.signature

    def _small_gather(self, jobs: list[int] | None, length: int) -> torch.Tensor | None:
        """Positions of ``jobs``' values (sampled whole) in :attr:`TorchRows.small_flat`, or ``None``."""
        if jobs is None or len(jobs) < 2 or self.torch_rows is None or not all(i in self.small_torch for i in jobs):
            return None
        slot = {i: k for k, i in enumerate(self.torch)}
        offsets = [self.torch_rows.small_offsets[slot[i]] for i in jobs]
        return to_device([o + j for o in offsets for j in range(length)], torch.int64, self.device)

    def _histogram_groups(
        self, jobs: list[TensorJob], dtypes: dict[int, torch.dtype], numel: dict[int, int], native_set: set[int]
    ) -> list[HistogramGroup]:
        keyed: dict[tuple[Any, ...], list[int]] = {}
        for i, meta in enumerate(self.metas):
            if meta.histogram is None:
                continue
            dtype = dtypes[i] if i in dtypes else _reduced_sample_dtype(jobs[i])
            keyed.setdefault((meta.histogram.bins, dtype, meta.histogram.range), []).append(i)
        groups = []
        for (bins, dtype, fixed), members in keyed.items():
            lengths = []
            for i in members:
                if i in numel:
                    stride = sample_stride(numel[i], self.metas[i].histogram.sample, self.metas[i].period)
                    lengths.append(-(-numel[i] // stride) if numel[i] else 0)
                else:
                    lengths.append(_reduced_sample_length(jobs[i], self.metas[i].histogram.sample))
            reject = any(self.metas[i].histogram.reject_outliers > 0.0 for i in members)
            # the kernel bins host samples: the gathered ones of kernel-reduced jobs, and reduced
            # jobs' own CPU samples
            host = all((i in native_set and i in self.strides) or (i not in numel and self.device.type == "cpu")
                       for i in members)
            group = HistogramGroup(
                bins, dtype, fixed, members, lengths, [n < self.metas[i].numel for n, i in zip(lengths, members, strict=True)],
                native=self.native_on and host and not reject and dtype in _FLOATS, reject=reject,
            )
            group.at = to_device(members, torch.int64, self.device)
            group.partitioned = to_device([self.partitioned_list[i] for i in members], torch.bool, self.device)
            if not group.native and not reject and dtype in _FLOATS and set(members) <= set(self.triton):
                group.triton = SampleTable(  # binned by the Triton kernels, read in place
                    [numel[i] for i in members],
                    [sample_stride(numel[i], self.metas[i].histogram.sample, self.metas[i].period) for i in members],
                    [dtypes[i] for i in members], self.device,
                )
            elif group.native:
                if all(i in native_set for i in members) and self.moments is not None:
                    slots = [self.native_slot[i] for i in members]
                    group.batch = native.HistogramBatch(
                        [self.moments.sample_pointers[k] for k in slots], lengths, [1] * len(members),
                        [dtype == torch.float64] * len(members), bins, fixed is not None,
                    )
            else:
                group.layout = HistogramLayout(lengths, bins, self.device)
                whole = {
                    i for i, n in zip(members, lengths, strict=True)
                    if self.kinds[i] == VIEW and n == self.metas[i].numel and jobs[i].pieces[0].device == self.device
                }
                group.whole = [
                    [members[g] for g in at] if all(members[g] in whole for g in at) else None
                    for _, at, _, _ in group.layout.by_length
                ]
                group.gather = [self._small_gather(entry, length) for entry, (length, _, _, _) in zip(group.whole, group.layout.by_length, strict=True)]
            groups.append(group)
        return groups


def _column_mask(columns: frozenset[str]) -> np.ndarray:
    return np.array([name in columns for name in PARTIALS])


def _meta(job: TensorJob) -> JobMeta:
    pieces = job.pieces
    return JobMeta(
        record_safe(job.name),  # the one point every tensor's record name passes: escaped once per plan
        job.stats,
        job.histogram if job.histogram is not None and job.histogram.enabled and not job.plain_scalar else None,
        job.plain_scalar,
        shape_of(job) if job.save_shape else None,
        int(pieces[0].shape[-1]) if pieces and pieces[0].dim() > 0 else 1,
        sum(p.numel() for p in pieces),
    )


def shape_of(job: TensorJob) -> tuple[int, ...]:
    """The shape recorded of a job: its tensor's, or the number of values of several pieces."""
    if len(job.pieces) == 1:
        return tuple(job.pieces[0].shape)
    return (sum(p.numel() for p in job.pieces),)


def _device_of(job: TensorJob) -> torch.device:
    return job.pieces[0].device if job.pieces else torch.device("cpu")


def _reduced_sample_dtype(job: TensorJob) -> torch.dtype:
    return job.pieces[0].sample.dtype  # every piece of a reduced job is a ReducedPiece


def _reduced_sample_length(job: TensorJob, sample: int | None) -> int:
    """The histogram sample of a reduced job: its pieces' samples, strided down to ``sample``."""
    total = sum(p.sample.numel() for p in job.pieces)
    if len(job.pieces) == 1:
        return total
    stride = sample_stride(total, sample)
    return -(-total // stride) if total else 0
