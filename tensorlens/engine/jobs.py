"""What the engine is asked to summarise: one :class:`TensorJob` per named tensor of a step, and
the pieces that stand in for a tensor already reduced where it was captured."""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import numpy as np
import torch

from tensorlens.config import HistogramConfig
from tensorlens.stats import native
from tensorlens.stats.histogram import sample_stride
from tensorlens.stats.moments import NATIVE_COLUMNS, as_values, needed_columns


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
    # the raw values to save where the pieces cannot give them (a sparse tensor: its dense form)
    raw: torch.Tensor | None = None


@dataclasses.dataclass
class ReducedPiece:
    """A tensor already reduced: its partial row and its histogram sample stand in for its values.

    Made by the compiled CPU kernel where an activation is captured (no clone held until the
    optimizer step, one read of the values while they are in cache: ``native_row``), or from a
    sparse tensor's stored values and implicit zeros (``partial_row``, see
    :mod:`tensorlens.stats.sparse`).
    """

    native_row: np.ndarray | None  # [len(native.COLUMNS)] float64, as the kernel wrote it
    sample: torch.Tensor  # the histogram's strided sample, in the compute dtype (empty without one)
    shape: torch.Size
    dtype: torch.dtype  # of the captured tensor
    device: torch.device
    partial_row: torch.Tensor | None = None  # [len(PARTIALS)] float64, when not the kernel's

    def numel(self) -> int:
        return math.prod(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def detach(self) -> ReducedPiece:
        return self


@dataclasses.dataclass
class DerivedScalars:
    """Named numbers computed on the device from several tensors (training dynamics: ratios,
    cosines, global norms, dead-unit fractions), copied to the host with the step's statistics.

    ``values`` is float64 ``[len(names)]`` on the device; ``names`` are ``(tensor, stat)`` pairs.
    """

    names: tuple[tuple[str, str], ...]
    values: torch.Tensor

    @staticmethod
    def concat(parts: list[DerivedScalars | None]) -> DerivedScalars | None:
        found = [p for p in parts if p is not None and p.names]
        if not found:
            return None
        if len(found) == 1:
            return found[0]
        device = found[0].values.device
        return DerivedScalars(tuple(n for p in found for n in p.names), torch.cat([p.values.to(device) for p in found]))


@dataclasses.dataclass(frozen=True)
class ReducePlan:
    """What :func:`reduce_now` computes for the tensors of one module: decided once per module
    (while the configs stay the same), so that each captured tensor costs only the kernel call."""

    wants: int  # the kernel's optional columns (native.wants)
    sample: int | None  # the histogram's sample size; None: every value
    histogram: bool  # whether to gather a histogram sample at all


def reduce_plan(stats: tuple[str, ...], histogram: HistogramConfig | None) -> ReducePlan | None:
    """The plan for tensors recorded with ``stats`` and ``histogram``, or ``None`` where the
    compiled kernel cannot do them (a statistic or histogram option it lacks, no kernel built)."""
    columns = needed_columns(stats)
    hist = histogram is not None and histogram.enabled
    if not columns <= NATIVE_COLUMNS or (hist and histogram.reject_outliers > 0.0) or not native.available():
        return None
    return ReducePlan(native.wants(columns), histogram.sample if hist else None, hist)


def reduce_now(tensor: torch.Tensor, plan: ReducePlan) -> ReducedPiece | None:
    """``tensor`` as a :class:`ReducedPiece`, or ``None`` where the kernel cannot read it (not on
    the CPU, complex); the caller then keeps a copy of the tensor as before."""
    if tensor.device.type != "cpu" or tensor.is_complex():
        return None
    values = tensor if native.supports(tensor) else as_values(tensor.detach()).contiguous()
    stride = sample_stride(values.numel(), plan.sample, int(tensor.shape[-1]) if tensor.dim() else 1) if plan.histogram else 0
    found = native.moments_one(values, stride, plan.wants)
    if found is None:
        return None
    row, sample = found
    return ReducedPiece(row, sample if sample is not None else values.new_empty(0), tensor.shape, tensor.dtype, tensor.device)


class WorkerReducer(Protocol):
    """Cross-worker merging of device results (implemented for ``torch.distributed``).

    Every worker must call these in the same order with tensors of the same shapes.
    """

    def merge_rows(self, rows: torch.Tensor, partitioned: torch.Tensor) -> torch.Tensor:
        """Merge ``rows`` [N, K] across workers where ``partitioned`` [N] (bool) is True."""
        ...

    def min_max(self, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def sum(self, values: torch.Tensor) -> torch.Tensor: ...
