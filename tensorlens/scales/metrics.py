"""The scale metrics of one tensor: ``Metrics`` / ``Metrics.Data`` as unit_scaling names them, and
the mergeable float64 partials they are computed from on the tensor's device.

The statistics (``mean_abs``, ``abs_mean``, ``std`` with Bessel's correction as ``Tensor.std``
computes it by default, ``abs_max``, ``abs_min``, ``numel``) are those of unit_scaling's
``Metrics.from_tensor``, computed here in float64. They are kept as *partials* (count, sum, sum of
squared deviations, sum of absolute values, max and min of absolute values in one float64 tensor
on the device, the count also as a host int) so a node seen several times in a step (micro-batches, a gradient
reaching it in two backward passes) merges exactly, and so reading them costs one host copy for a
whole graph instead of one sync per number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

# column order of a partials tensor
COUNT, SUM, M2, SUM_ABS, MAX_ABS, MIN_ABS = range(6)

METRIC_NAMES = ("mean_abs", "abs_mean", "std", "abs_max", "abs_min", "numel")
_FULL_NAMES = {
    "mean_abs": "mean absolute value",
    "abs_mean": "absolute mean value",
    "std": "standard deviation",
    "abs_max": "absolute maximum",
    "abs_min": "absolute minimum",
    "numel": "number of elements",
}


class Metrics:
    """Forward and backward scale metrics of one graph node, as ``unit_scaling.transforms.Metrics``.

    ``fwd`` describes the node's output, ``bwd`` the gradient reaching it (``None`` when no
    gradient flowed).

    >>> m = Metrics(Metrics.from_tensor(torch.tensor([1.0, -3.0])))
    >>> m.fwd.mean_abs, m.fwd.abs_mean, m.fwd.abs_max, m.bwd
    (2.0, 1.0, 3.0, None)
    """

    @dataclass
    class Data:
        """The metrics of one tensor (field names and meanings exactly unit_scaling's)."""

        mean_abs: float
        abs_mean: float
        std: float
        abs_max: float
        abs_min: float
        numel: int

    def __init__(self, fwd: Metrics.Data, bwd: Metrics.Data | None = None) -> None:
        self.fwd = fwd
        self.bwd = bwd

    def __repr__(self) -> str:
        return f"Metrics(fwd={self.fwd}, bwd={self.bwd})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Metrics) and self.fwd == other.fwd and self.bwd == other.bwd

    @staticmethod
    def from_tensor(t: torch.Tensor) -> Metrics.Data:
        """The metrics of ``t`` computed in float64 (one host copy)."""
        return data_from_partials(tensor_partials(t)[1])

    @staticmethod
    def get_full_name(short_name: str) -> str:
        return _FULL_NAMES[short_name]

    @staticmethod
    def names() -> list[str]:
        return [f.name for f in fields(Metrics.Data)]

    @staticmethod
    def full_names() -> list[str]:
        return [_FULL_NAMES[m] for m in Metrics.names()]


def tensor_partials(t: torch.Tensor) -> tuple[int, torch.Tensor]:
    """``(numel, float64 [numel, sum, M2, sum|x|, max|x|, min|x|])`` of ``t`` on its device, no host sync.

    M2 is the sum of squared deviations from the mean (Welford, through ``torch.var``), so
    merging and the final ``std`` stay exact where ``sum(x**2) - n*mean**2`` would cancel. The
    count is also a device value (a fill, not a host-to-device copy, which would wait for the GPU).
    """
    with torch.no_grad():
        x = t.detach()
        to_local = getattr(x, "to_local", None)
        if callable(to_local):  # a DTensor: this rank's shard (a global reduction per op would be a collective)
            x = to_local()
        n = x.numel()
        if n == 0:
            values = (0.0, 0.0, 0.0, 0.0, -math.inf, math.inf)
            return 0, torch.stack([torch.full((), v, dtype=torch.float64, device=x.device) for v in values])
        wide = x.to(torch.float64)
        # the sum on its own: Welford's running mean turns one inf into NaN, where Tensor.mean gives inf
        total = wide.sum()
        var = torch.var(wide, correction=0)
        absolute = wide.abs_() if wide is not x else wide.abs()  # in place on our own copy: one allocation less
        low, high = torch.aminmax(absolute)
        return n, torch.stack([torch.full_like(total, n), total, var * n, absolute.sum(), high, low])


def merge_partials(a: tuple[int, torch.Tensor], b: tuple[int, torch.Tensor]) -> tuple[int, torch.Tensor]:
    """The partials of the concatenation of two tensors (Chan et al.'s pairwise update for M2)."""
    na, pa = a
    nb, pb = b
    if na == 0:
        return b
    if nb == 0:
        return a
    n = na + nb
    delta = pb[SUM] / nb - pa[SUM] / na
    merged = torch.stack(
        [
            pa[COUNT] + pb[COUNT],
            pa[SUM] + pb[SUM],
            pa[M2] + pb[M2] + delta * delta * (na * nb / n),
            pa[SUM_ABS] + pb[SUM_ABS],
            torch.maximum(pa[MAX_ABS], pb[MAX_ABS]),
            torch.minimum(pa[MIN_ABS], pb[MIN_ABS]),
        ]
    )
    return n, merged


def merge_partial_tables(tables: torch.Tensor) -> torch.Tensor:
    """Merge ``[k, N, 6]`` partials (the same N keys from k ranks or micro-batches) into ``[N, 6]``.

    For ``include_workers="reduce"``: all-gather each rank's ``ScaleStep.partials`` (after the
    ranks agreed on one key order), merge here, then :func:`finalize`. On the device, no host sync.
    """
    n_k = tables[..., COUNT]
    n = n_k.sum(0)
    total = tables[..., SUM].sum(0)
    present = n_k > 0
    mean_k = tables[..., SUM] / torch.where(present, n_k, torch.ones_like(n_k))
    spread = torch.where(present, n_k * (mean_k - total / n) ** 2, torch.zeros_like(n_k))
    return torch.stack(
        [
            n,
            total,
            (tables[..., M2] + spread).sum(0),
            tables[..., SUM_ABS].sum(0),
            tables[..., MAX_ABS].amax(0),
            tables[..., MIN_ABS].amin(0),
        ],
        dim=1,
    )


def finalize(partials: torch.Tensor) -> torch.Tensor:
    """``[N, 6]`` float64 metrics in ``METRIC_NAMES`` order from ``[N, 6]`` partials, on their device.

    An empty tensor gives NaN for every metric but ``numel``; a single element a NaN ``std``
    (Bessel's correction divides by zero, as ``Tensor.std`` does).
    """
    n = partials[:, COUNT]
    empty = n == 0
    nan = torch.full_like(n, math.nan)
    std = torch.where(n <= 1, nan, torch.sqrt(partials[:, M2] / (n - 1)))
    return torch.stack(
        [
            partials[:, SUM_ABS] / n,
            (partials[:, SUM] / n).abs(),
            std,
            torch.where(empty, nan, partials[:, MAX_ABS]),
            torch.where(empty, nan, partials[:, MIN_ABS]),
            n,
        ],
        dim=1,
    )


def data_from_partials(partials: torch.Tensor) -> Metrics.Data:
    """One ``Metrics.Data`` from one partials tensor (one host copy)."""
    return data_from_row(finalize(partials.reshape(1, -1)).cpu()[0].tolist())


def data_from_row(row: list[float]) -> Metrics.Data:
    return Metrics.Data(
        mean_abs=row[0], abs_mean=row[1], std=row[2], abs_max=row[3], abs_min=row[4], numel=int(row[5])
    )
