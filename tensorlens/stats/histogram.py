"""Histograms: the strided sample, outlier rejection, per-tensor ranges and the binning itself.

A value ``x`` goes to bin ``floor((x - low) * scale)`` with ``scale`` rounded to the values' dtype,
a deterministic monotone function of ``x``: :mod:`tensorlens.stats.edges` finds the exact edges
where it changes bin, so ``np.histogram(values, bins=edges)`` reproduces the counts bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch


def sample_stride(numel: int, sample: int | None, period: int = 1) -> int:
    """The stride of :func:`strided_sample`: the smallest ``s >= ceil(numel / sample)`` that shares
    no factor with ``period`` (a tensor's last dimension), so that a strided sample of a matrix
    visits every column instead of collapsing onto a few (a stride of 512 on a 512-wide weight
    would take column 0 of every row)."""
    if sample is None or numel <= sample:
        return 1
    stride = -(-numel // sample)
    while period > 1 and math.gcd(stride, period) != 1:
        stride += 1
    return stride


def strided_sample(values: torch.Tensor, sample: int | None, period: int = 1) -> torch.Tensor:
    """At most ``sample`` values of a flat tensor, every :func:`sample_stride`-th one."""
    stride = sample_stride(values.numel(), sample, period)
    return values if stride == 1 else values[::stride]


def reject_outliers(values: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the ``fraction`` of finite values farthest from their median.

    Returns ``(kept_mask, rejected_count)``; non-finite values are not kept and not counted as
    rejected (they have their own counts). No host sync: the median and the threshold are read
    from sorted copies at positions computed on the device (``values[finite]`` and ``kthvalue``
    with a data-dependent ``k`` would make the host wait for a GPU).
    """
    finite = torch.isfinite(values)
    zero = torch.zeros((), dtype=torch.int64, device=values.device)
    if fraction <= 0.0 or values.numel() == 0:
        return finite, zero
    m = finite.sum()  # finite values; non-finite ones sort last below (+inf)
    ordered = torch.where(finite, values, math.inf).sort().values
    median = ordered.gather(0, ((m + 1) // 2 - 1).clamp(min=0).reshape(1))  # kthvalue((m + 1) // 2)
    distance = torch.where(finite, (values - median).abs(), math.inf)
    keep = torch.ceil((1.0 - fraction) * m.to(torch.float64)).to(torch.int64).clamp(min=1)  # max(1, ceil(...))
    threshold = distance.sort().values.gather(0, (keep - 1).reshape(1))
    kept = finite & (distance <= threshold)
    return kept, m - kept.sum()


Ranges = TypeVar("Ranges", torch.Tensor, np.ndarray)


def histogram_range(low: Ranges, high: Ranges, dtype: torch.dtype) -> tuple[Ranges, Ranges]:
    """Per-tensor ranges ``[G]`` in ``dtype``; a point range is widened by 0.5 each side (as numpy
    does) and a missing one (all-NaN or empty tensor) becomes ``[-0.5, 0.5]``.

    Takes PyTorch tensors (on any device) or numpy arrays (the compiled kernel's path, where a
    dozen PyTorch ops on 16 values cost more than the step's binning): the same IEEE operations,
    so the same bits."""
    xp, cast = _array_ops(low)
    low, high = cast(low, torch.float64), cast(high, torch.float64)
    missing = ~(xp.isfinite(low) & xp.isfinite(high))
    low = xp.where(missing, xp.zeros_like(low), low)
    high = xp.where(missing, xp.zeros_like(high), high)
    same = low >= high
    return cast(xp.where(same, low - 0.5, low), dtype), cast(xp.where(same, high + 0.5, high), dtype)


def histogram_scale(low: Ranges, high: Ranges, bins: int) -> Ranges:
    """``bins / (high - low)`` rounded to the ranges' dtype: the factor :func:`histogram_counts`
    (and the compiled kernel) multiply by, and :func:`exact_edges` bisects with."""
    if isinstance(low, torch.Tensor):
        return (bins / (high.to(torch.float64) - low.to(torch.float64))).to(low.dtype)
    with np.errstate(divide="ignore", over="ignore"):  # a range that rounds to a point: inf, as in PyTorch
        return (bins / (high.astype(np.float64) - low.astype(np.float64))).astype(low.dtype)


def _array_ops(values: torch.Tensor | np.ndarray) -> tuple[Any, Callable[[Any, torch.dtype], Any]]:
    """The array module of ``values`` and a cast to a PyTorch dtype in it."""
    if isinstance(values, np.ndarray):
        return np, lambda a, dtype: a.astype(str(dtype).removeprefix("torch."), copy=False)
    return torch, lambda t, dtype: t.to(dtype)


def histogram_counts(
    samples: list[torch.Tensor],
    low: torch.Tensor,
    high: torch.Tensor,
    bins: int,
    masks: list[torch.Tensor | None] | None = None,
    clip: bool = False,
    layout: HistogramLayout | None = None,
    finite_only: bool = False,
    stacked: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Counts of every sample over its ``[low[g], high[g]]`` in ``bins`` bins, in one ``index_add_``.

    A value ``x`` goes to bin ``min(floor((x - low) * scale), bins - 1)`` with
    ``scale = bins / (high - low)`` rounded to the values' dtype. A subtraction and a
    multiplication are each correctly rounded on every IEEE kernel, so this is a deterministic,
    monotone function of ``x``: :func:`exact_edges` finds, on the host, the exact values where it
    changes bin, and ``np.histogram(values, bins=edges)`` reproduces the counts. (Binning against
    rounded edges would need a correction pass with two gathers per value.)

    ``masks[g]`` (over sample ``g``) leaves values out. With ``clip`` (a fixed range), values
    outside ``[low, high]`` are not binned and are counted in ``below``/``above``; otherwise the
    range is the data's and every finite value lies inside it. NaN and ±Inf are never binned by
    the caller's contract: a tensor holding them is binned again with a finite mask.
    ``finite_only`` leaves NaN and Inf out (one test over all the samples, for a group where some
    tensor holds them). ``layout`` (of these samples' lengths) is built here when not given, and
    ``stacked`` (:meth:`HistogramLayout.stack` of the samples) where the caller has it already.
    Returns ``(counts [G, bins] int64, scale [G], below [G], above [G])``.
    """
    groups = len(samples)
    device, dtype = low.device, low.dtype
    scale = histogram_scale(low, high, bins)
    trash = groups * bins  # the bin every value left out goes to (exact in float32 up to 2**24)
    below = torch.zeros(groups, dtype=torch.int64, device=device)
    above = torch.zeros(groups, dtype=torch.int64, device=device)
    if layout is None:
        layout = HistogramLayout([s.numel() for s in samples], bins, device)
    positions = []
    if stacked is None:
        stacked = layout.stack(samples)
    for (length, members, at, offsets), matrix in zip(layout.by_length, stacked, strict=True):
        values = matrix.to(dtype)  # [k, length]
        lo, hi, sc = low[at, None], high[at, None], scale[at, None]
        position = torch.sub(values, lo).mul_(sc)
        # floor before adding the group's offset: 2.9999999 + 3200 would round up a bin in float32
        position.nan_to_num_(0.0, float(bins - 1), 0.0).clamp_(0, bins - 1).floor_()
        position.add_(offsets.to(dtype))
        keep = None
        if masks is not None and any(masks[g] is not None for g in members):
            keep = torch.stack([
                masks[g].reshape(-1) if masks[g] is not None else torch.ones(length, dtype=torch.bool, device=device)
                for g in members
            ])
        if finite_only:
            finite = torch.isfinite(values)
            keep = finite if keep is None else keep & finite
        if clip:
            is_below, is_above = values < lo, values > hi
            if keep is not None:
                is_below &= keep
                is_above &= keep
            below[at] = is_below.sum(1)
            above[at] = is_above.sum(1)
            outside = is_below | is_above
            keep = ~outside if keep is None else keep & ~outside
        if keep is not None:
            position.masked_fill_(~keep, trash)
        positions.append(position.reshape(-1))
    # a fixed-size buffer and index_add_: bincount sizes its output from the data (a host sync on a GPU)
    counts = torch.zeros(trash + 1, dtype=torch.int64, device=device)
    if positions:
        index = torch.cat(positions).to(torch.int64) if len(positions) > 1 else positions[0].to(torch.int64)
        counts.index_add_(0, index, layout.ones(index.numel(), device))
    return counts[:trash].reshape(groups, bins), scale, below, above


def stack_samples(samples: Sequence[torch.Tensor], members: list[int]) -> torch.Tensor:
    """The ``members`` of ``samples`` (all of one length) as one ``[k, length]`` matrix."""
    flat = [samples[g] if samples[g].dim() == 1 else samples[g].reshape(-1) for g in members]
    return torch.stack(flat) if len(flat) > 1 else flat[0].unsqueeze(0)


class HistogramLayout:
    """How :func:`histogram_counts` batches samples of these lengths: samples of one length are
    stacked and binned together, with their group indices and bin offsets on the device. Built
    once per plan (:mod:`tensorlens.compute.plan`), so a step creates no index tensors."""

    def __init__(self, lengths: list[int], bins: int, device: torch.device) -> None:
        from tensorlens.stats.torch_rows import to_device

        by_length: dict[int, list[int]] = {}
        for g, length in enumerate(lengths):
            by_length.setdefault(length, []).append(g)
        self.by_length = [
            (length, members, to_device(members, torch.int64, device), to_device([g * bins for g in members], torch.int64, device)[:, None])
            for length, members in by_length.items() if length > 0
        ]
        self._ones: torch.Tensor | None = None

    def stack(self, samples: list[torch.Tensor]) -> list[torch.Tensor]:
        """The samples of each length as one ``[k, length]`` matrix, in :attr:`by_length` order."""
        return [stack_samples(samples, members) for _, members, _, _ in self.by_length]

    def ones(self, n: int, device: torch.device) -> torch.Tensor:
        """``n`` ones (int64) for ``index_add_``, a view of a buffer kept across steps."""
        if self._ones is None or self._ones.numel() < n:
            self._ones = torch.ones(n, dtype=torch.int64, device=device)
        return self._ones[:n]
