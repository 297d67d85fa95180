"""What the engine is asked to summarise: one :class:`TensorJob` per named tensor of a step, and
the pieces that stand in for a tensor already reduced where it was captured."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Protocol

import numpy as np
import torch

from tensorlens.config import HistogramConfig
from tensorlens.names import record_safe
from tensorlens.stats import native
from tensorlens.stats.histogram import sample_stride, strided_sample
from tensorlens.stats.moments import NATIVE_COLUMNS, as_values, needed_columns
from tensorlens.stats.path import TRITON, path_for
from tensorlens.stats.torch_rows import TorchRows
from tensorlens.stats.triton.rows import TRITON_COLUMNS, one_row, triton_reads


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

    Made where an activation is captured (no clone held until the optimizer step, the values read
    while they are in cache): by the compiled CPU kernel (``native_row``), or with PyTorch ops on
    any device (``partial_row``, on the tensor's device, no host sync); or from a sparse tensor's
    stored values and implicit zeros (``partial_row``, see :mod:`tensorlens.stats.sparse`).
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

    def __post_init__(self) -> None:
        # named after modules and parameters, as jobs are: escaped as every job's name is (tensorlens.names)
        self.names = tuple((record_safe(tensor), stat) for tensor, stat in self.names)

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
    columns: frozenset[str] = frozenset()  # the partial columns needed (the PyTorch path's)
    native: bool = True  # the kernel computes every column (else PyTorch ops do)


def reduce_plan(stats: tuple[str, ...], histogram: HistogramConfig | None) -> ReducePlan | None:
    """The plan for tensors recorded with ``stats`` and ``histogram``, or ``None`` where the
    tensor must be kept whole (a histogram that rejects outliers needs all its sample's values
    at the step's end; so does a median)."""
    columns = needed_columns(stats)
    hist = histogram is not None and histogram.enabled
    if (hist and histogram.reject_outliers > 0.0) or columns & {"median", "abs_median"}:
        return None
    return ReducePlan(
        native.wants(columns), histogram.sample if hist else None, hist, columns,
        native=columns <= NATIVE_COLUMNS and native.available(),
    )


def reduce_now(tensor: torch.Tensor, plan: ReducePlan) -> ReducedPiece | None:
    """``tensor`` as a :class:`ReducedPiece`, or ``None`` where it cannot be reduced now (complex);
    the caller then keeps a copy of the tensor as before. CPU tensors go to the compiled kernel
    where it is built; the others (any device) to PyTorch ops, whose row stays on the device."""
    if tensor.is_complex():
        return None
    if plan.native and tensor.device.type == "cpu" and native.available():
        values = tensor if native.supports(tensor) else as_values(tensor.detach()).contiguous()
        stride = sample_stride(values.numel(), plan.sample, int(tensor.shape[-1]) if tensor.dim() else 1) if plan.histogram else 0
        found = native.moments_one(values, stride, plan.wants)
        if found is None:
            return None
        row, sample = found
        return ReducedPiece(row, sample if sample is not None else values.new_empty(0), tensor.shape, tensor.dtype, tensor.device)
    if path_for(tensor.device) == TRITON and plan.columns <= TRITON_COLUMNS and triton_reads([tensor], "an activation"):
        with torch.no_grad():  # the fused kernels read it as it is (a bfloat16 activation: no float32 copy)
            values = tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
            period = int(tensor.shape[-1]) if tensor.dim() else 1
            sample = strided_sample(values.reshape(-1), plan.sample, period) if plan.histogram else values.new_empty(0)
            sample = as_values(sample).clone()  # a copy in the compute dtype: an in-place op after the module must not change it
            return ReducedPiece(None, sample, tensor.shape, tensor.dtype, tensor.device, partial_row=one_row(values, plan.columns))
    return _reduce_with_torch(tensor, plan)


def _reduce_with_torch(tensor: torch.Tensor, plan: ReducePlan) -> ReducedPiece:
    """The partial row (on the tensor's device) and a copy of the strided sample, with PyTorch ops."""
    with torch.no_grad():
        values = as_values(tensor.detach())
        if not values.is_contiguous():
            values = values.contiguous()
        rows = _torch_rows(values.numel(), values.dtype, values.device, plan.columns)
        row = rows.run([values], _scratch)[0]
        if plan.histogram:  # a copy: an in-place op after the module must not change it
            sample = strided_sample(values, plan.sample, int(tensor.shape[-1]) if tensor.dim() else 1).clone()
        else:
            sample = values.new_empty(0)
    return ReducedPiece(None, sample, tensor.shape, tensor.dtype, tensor.device, partial_row=row)


@functools.lru_cache(maxsize=512)  # one per captured module size and dtype
def _torch_rows(numel: int, dtype: torch.dtype, device: torch.device, columns: frozenset[str]) -> TorchRows:
    return TorchRows([numel], [dtype], [columns], device, counts="flagged" if device.type == "cpu" else "always")


_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _scratch(values: torch.Tensor) -> torch.Tensor:
    """A buffer for the deviations of the largest tensor reduced in a hook so far, per device and
    dtype (no fresh allocation, and page faults, per captured tensor)."""
    key = (values.device, values.dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < values.numel():
        buf = _SCRATCH[key] = torch.empty(values.numel(), dtype=values.dtype, device=values.device)
    return buf


class WorkerReducer(Protocol):
    """Cross-worker merging of device results (implemented for ``torch.distributed``).

    Every worker must call these in the same order with tensors of the same shapes.
    """

    def merge_rows(self, rows: torch.Tensor, partitioned: torch.Tensor) -> torch.Tensor:
        """Merge ``rows`` [N, K] across workers where ``partitioned`` [N] (bool) is True."""
        ...

    def min_max(self, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def sum(self, values: torch.Tensor) -> torch.Tensor: ...
