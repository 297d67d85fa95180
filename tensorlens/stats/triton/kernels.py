"""The Triton kernels of the fused statistics path (imported only where the path is used: it needs
``triton``, and ``TRITON_INTERPRET=1`` must be set before this module is imported to run them on a CPU).

Four kernels, each reading its tensors through a table of addresses (``int64`` data pointers), so
tensors of any number and size share a launch without being copied into one buffer:

- :func:`item_partials` reads every value once. A program takes ``ROWS`` *items* (a small tensor,
  or one chunk of a large one) as a ``[ROWS, COLS]`` tile and walks it ``COLS`` values at a time.
  Each block is reduced in the values' compute precision (float32, float64 for float64 tensors),
  its centred moments taken around the block's own mean (the corrected two-pass algorithm, in
  registers), and merged into float64 accumulators with Chan's update: count, sum, centred sum of
  squares, min, max, and on request sum and centred squares of ``|x|``, smallest ``|x|`` and
  zeros; NaN and Inf are always counted. A block of finite values whose float32 sums overflow is
  done again in float64.
- :func:`merge_items` merges the items of each tensor in a fixed order (Chan's update again, in
  float64) into the registry's partial row: deterministic, whatever the GPU schedules.
- :func:`sample_ranges` and :func:`bin_samples` read the histogram's strided sample straight from
  the tensor (``stride`` apart: no copy): its finite range, then the bins, with the same IEEE
  operations as :func:`tensorlens.stats.histogram.histogram_counts` (so the host's exact edges
  reproduce the counts), counted with atomic adds.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Columns of :func:`item_partials`' output per item, in order.
ITEM_COLUMNS = ("count", "sum", "m2", "min", "max", "l1", "abs_min", "abs_m2", "zero_count", "nan_count", "inf_count")
N_ITEM = len(ITEM_COLUMNS)


@triton.jit
def item_partials(
    addresses,
    lengths,
    out,
    n_items,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    DTYPE: tl.constexpr,
    ACC: tl.constexpr,
    WANT_ABS: tl.constexpr,
    WANT_ZEROS: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    live = rows < n_items
    base = tl.load(addresses + rows, mask=live, other=0).to(tl.pointer_type(DTYPE))
    n = tl.load(lengths + rows, mask=live, other=0)
    cols = tl.arange(0, COLS)
    zero = tl.zeros((ROWS,), tl.float64)
    count, mean, m2, abs_mean, abs_m2 = zero, zero, zero, zero, zero
    total, l1, zeros, nans, infs = zero, zero, zero, zero, zero
    low = tl.full((ROWS,), float("inf"), ACC)
    high = tl.full((ROWS,), float("-inf"), ACC)
    abs_low = tl.full((ROWS,), float("inf"), ACC)
    for start in range(0, tl.max(n, 0), COLS):
        at = start + cols[None, :]
        valid = at < n[:, None]
        x = tl.load(base[:, None] + at, mask=valid, other=0.0).to(ACC)
        is_nan = x != x
        block_nans = tl.sum((valid & is_nan).to(tl.float64), 1)
        block_infs = tl.sum((valid & (tl.abs(x) == float("inf"))).to(tl.float64), 1)
        # the block's own moments in the values' precision: deviations from its mean, less
        # (sum of deviations)^2 / c (the corrected two-pass algorithm, in registers)
        c = tl.sum(valid.to(ACC), 1)
        safe = tl.where(c > 0, c, 1.0)
        block_sum = tl.sum(x, 1)
        dev = tl.where(valid, x - (block_sum / safe)[:, None], 0.0)
        d1 = tl.sum(dev, 1)
        block_m2 = (tl.sum(dev * dev, 1) - d1 * d1 / safe).to(tl.float64)
        block_total = block_sum.to(tl.float64)
        abs_total = tl.zeros((ROWS,), tl.float64)
        abs_block_m2 = tl.zeros((ROWS,), tl.float64)
        if WANT_ABS:
            a = tl.abs(x)
            abs_sum = tl.sum(a, 1)
            dev = tl.where(valid, a - (abs_sum / safe)[:, None], 0.0)
            d1 = tl.sum(dev, 1)
            abs_block_m2 = (tl.sum(dev * dev, 1) - d1 * d1 / safe).to(tl.float64)
            abs_total = abs_sum.to(tl.float64)
        # finite values whose float32 sums overflow (3e38 * 4096): the block again in float64, as
        # the compiled CPU kernel does (rare; a block holding NaN or Inf is NaN/Inf in numpy too)
        finite = (tl.abs(block_total) < float("inf")) & (tl.abs(block_m2) < float("inf"))
        finite = finite & (abs_total < float("inf")) & (abs_block_m2 < float("inf"))
        redo = (block_nans + block_infs == 0) & ~finite
        if tl.max(redo.to(tl.int32), 0) > 0:
            wide = x.to(tl.float64)
            wide_n = safe.to(tl.float64)
            wide_sum = tl.sum(wide, 1)
            wide_dev = tl.where(valid, wide - (wide_sum / wide_n)[:, None], 0.0)
            wide_d1 = tl.sum(wide_dev, 1)
            block_total = tl.where(redo, wide_sum, block_total)
            block_m2 = tl.where(redo, tl.sum(wide_dev * wide_dev, 1) - wide_d1 * wide_d1 / wide_n, block_m2)
            wide_abs = tl.abs(wide)
            wide_abs_sum = tl.sum(wide_abs, 1)
            wide_dev = tl.where(valid, wide_abs - (wide_abs_sum / wide_n)[:, None], 0.0)
            wide_d1 = tl.sum(wide_dev, 1)
            abs_total = tl.where(redo, wide_abs_sum, abs_total)
            abs_block_m2 = tl.where(redo, tl.sum(wide_dev * wide_dev, 1) - wide_d1 * wide_d1 / wide_n, abs_block_m2)
        # merged into float64 with Chan's update (an empty block changes nothing; NaN/Inf propagate)
        c64 = c.to(tl.float64)
        safe64 = tl.where(c64 > 0, c64, 1.0)
        grown = count + c64
        weight = c64 / tl.where(grown > 0, grown, 1.0)
        delta = block_total / safe64 - mean
        m2 = tl.where(c64 > 0, m2 + block_m2 + delta * delta * count * weight, m2)
        mean = tl.where(c64 > 0, mean + delta * weight, mean)
        total += block_total
        nans += block_nans
        infs += block_infs
        # NaN left out of min and max here; a row holding NaN gets NaN bounds in merge_items
        known = valid & ~is_nan
        low = tl.minimum(low, tl.min(tl.where(known, x, float("inf")), 1))
        high = tl.maximum(high, tl.max(tl.where(known, x, float("-inf")), 1))
        if WANT_ABS:
            abs_delta = abs_total / safe64 - abs_mean
            abs_m2 = tl.where(c64 > 0, abs_m2 + abs_block_m2 + abs_delta * abs_delta * count * weight, abs_m2)
            abs_mean = tl.where(c64 > 0, abs_mean + abs_delta * weight, abs_mean)
            l1 += abs_total
            abs_low = tl.minimum(abs_low, tl.min(tl.where(known, tl.abs(x), float("inf")), 1))
        count = grown
        if WANT_ZEROS:
            zeros += tl.sum((valid & (x == 0.0)).to(tl.float64), 1)
    row = out + rows * 11  # len(ITEM_COLUMNS)
    tl.store(row + 0, count, mask=live)
    tl.store(row + 1, total, mask=live)
    tl.store(row + 2, m2, mask=live)
    tl.store(row + 3, low.to(tl.float64), mask=live)
    tl.store(row + 4, high.to(tl.float64), mask=live)
    tl.store(row + 5, l1, mask=live)
    tl.store(row + 6, abs_low.to(tl.float64), mask=live)
    tl.store(row + 7, abs_m2, mask=live)
    tl.store(row + 8, zeros, mask=live)
    tl.store(row + 9, nans, mask=live)
    tl.store(row + 10, infs, mask=live)


@triton.jit
def merge_items(
    items,
    first,
    counts,
    out,
    n_tensors,
    P: tl.constexpr,
    C_COUNT: tl.constexpr,
    C_SUM: tl.constexpr,
    C_SUMSQ: tl.constexpr,
    C_M2: tl.constexpr,
    C_L1: tl.constexpr,
    C_MIN: tl.constexpr,
    C_MAX: tl.constexpr,
    C_ABS_MIN: tl.constexpr,
    C_ABS_M2: tl.constexpr,
    C_NAN: tl.constexpr,
    C_INF: tl.constexpr,
    C_ZERO: tl.constexpr,
    ROWS: tl.constexpr,
):
    """The partial row of each tensor (``P`` columns, at the registry's indices ``C_*``) from its
    ``counts[t]`` items starting at ``first[t]``, merged one after the other."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    live = rows < n_tensors
    start = tl.load(first + rows, mask=live, other=0)
    k = tl.load(counts + rows, mask=live, other=0)
    zero = tl.zeros((ROWS,), tl.float64)
    n, mean, m2, abs_mean, abs_m2 = zero, zero, zero, zero, zero
    total, l1, zeros, nans, infs = zero, zero, zero, zero, zero
    low = zero + float("inf")
    high = zero + float("-inf")
    abs_low = zero + float("inf")
    for j in range(0, tl.max(k, 0)):
        has = live & (j < k)
        item = items + (start + j) * 11  # len(ITEM_COLUMNS)
        c = tl.load(item + 0, mask=has, other=0.0)
        s = tl.load(item + 1, mask=has, other=0.0)
        a = tl.load(item + 5, mask=has, other=0.0)
        safe = tl.where(c > 0, c, 1.0)
        grown = n + c
        weight = c / tl.where(grown > 0, grown, 1.0)
        # Chan's update of both centred moments (an empty item changes nothing)
        delta = s / safe - mean
        m2 = tl.where(c > 0, m2 + tl.load(item + 2, mask=has, other=0.0) + delta * delta * n * weight, m2)
        mean = tl.where(c > 0, mean + delta * weight, mean)
        abs_delta = a / safe - abs_mean
        abs_m2 = tl.where(
            c > 0, abs_m2 + tl.load(item + 7, mask=has, other=0.0) + abs_delta * abs_delta * n * weight, abs_m2
        )
        abs_mean = tl.where(c > 0, abs_mean + abs_delta * weight, abs_mean)
        n = grown
        total += s
        l1 += a
        low = tl.minimum(low, tl.load(item + 3, mask=has, other=float("inf")))
        high = tl.maximum(high, tl.load(item + 4, mask=has, other=float("-inf")))
        abs_low = tl.minimum(abs_low, tl.load(item + 6, mask=has, other=float("inf")))
        zeros += tl.load(item + 8, mask=has, other=0.0)
        nans += tl.load(item + 9, mask=has, other=0.0)
        infs += tl.load(item + 10, mask=has, other=0.0)
    # numpy's semantics: a NaN anywhere makes the bounds NaN; an empty tensor has none
    no_bounds = (nans > 0) | (n == 0)
    nan = float("nan")
    low = tl.where(no_bounds, nan, low)
    high = tl.where(no_bounds, nan, high)
    abs_low = tl.where(no_bounds, nan, abs_low)
    safe_n = tl.where(n > 0, n, 1.0)
    row = out + rows * P
    tl.store(row + C_COUNT, n, mask=live)
    tl.store(row + C_SUM, total, mask=live)
    tl.store(row + C_M2, m2, mask=live)
    tl.store(row + C_SUMSQ, m2 + total * total / safe_n, mask=live)
    tl.store(row + C_L1, l1, mask=live)
    tl.store(row + C_MIN, low, mask=live)
    tl.store(row + C_MAX, high, mask=live)
    tl.store(row + C_ABS_MIN, abs_low, mask=live)
    tl.store(row + C_ABS_M2, abs_m2, mask=live)
    tl.store(row + C_NAN, nans, mask=live)
    tl.store(row + C_INF, infs, mask=live)
    tl.store(row + C_ZERO, zeros, mask=live)


@triton.jit
def sample_ranges(
    addresses,
    strides,
    lengths,
    low_out,
    high_out,
    n_samples,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    DTYPE: tl.constexpr,
    ACC: tl.constexpr,
):
    """The smallest and largest finite value of each strided sample (``+inf``/``-inf`` where none is)."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    live = rows < n_samples
    base = tl.load(addresses + rows, mask=live, other=0).to(tl.pointer_type(DTYPE))
    stride = tl.load(strides + rows, mask=live, other=1)
    n = tl.load(lengths + rows, mask=live, other=0)
    cols = tl.arange(0, COLS)
    low = tl.full((ROWS,), float("inf"), ACC)
    high = tl.full((ROWS,), float("-inf"), ACC)
    for start in range(0, tl.max(n, 0), COLS):
        at = start + cols[None, :]
        valid = at < n[:, None]
        x = tl.load(base[:, None] + at * stride[:, None], mask=valid, other=0.0).to(ACC)
        finite = valid & (tl.abs(x) < float("inf"))  # False for NaN too
        low = tl.minimum(low, tl.min(tl.where(finite, x, float("inf")), 1))
        high = tl.maximum(high, tl.max(tl.where(finite, x, float("-inf")), 1))
    tl.store(low_out + rows, low, mask=live)
    tl.store(high_out + rows, high, mask=live)


@triton.jit
def bin_samples(
    addresses,
    strides,
    lengths,
    low,
    high,
    scale,
    counts,
    below,
    above,
    n_samples,
    BINS: tl.constexpr,
    CLIP: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    DTYPE: tl.constexpr,
    ACC: tl.constexpr,
):
    """Bin each strided sample: ``floor((x - low) * scale)`` in the binned dtype, clamped to the bins
    (as :func:`~tensorlens.stats.histogram.histogram_counts`); NaN and Inf are never binned; with
    ``CLIP`` (a fixed range) values outside it are counted in ``below``/``above`` instead."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    live = rows < n_samples
    base = tl.load(addresses + rows, mask=live, other=0).to(tl.pointer_type(DTYPE))
    stride = tl.load(strides + rows, mask=live, other=1)
    n = tl.load(lengths + rows, mask=live, other=0)
    lo = tl.load(low + rows, mask=live, other=0.0)
    hi = tl.load(high + rows, mask=live, other=0.0)
    sc = tl.load(scale + rows, mask=live, other=0.0)
    cols = tl.arange(0, COLS)
    n_below = tl.zeros((ROWS,), tl.int64)
    n_above = tl.zeros((ROWS,), tl.int64)
    for start in range(0, tl.max(n, 0), COLS):
        at = start + cols[None, :]
        valid = at < n[:, None]
        x = tl.load(base[:, None] + at * stride[:, None], mask=valid, other=0.0).to(ACC)
        keep = valid & (tl.abs(x) < float("inf"))
        position = (x - lo[:, None]) * sc[:, None]
        # a range that rounds to a point has an infinite scale: NaN at x == low goes to bin 0
        position = tl.where(position != position, 0.0, position)
        position = tl.minimum(tl.maximum(position, 0.0), BINS - 1.0)
        index = tl.floor(position).to(tl.int64)
        if CLIP:
            is_below = keep & (x < lo[:, None])
            is_above = keep & (x > hi[:, None])
            n_below += tl.sum(is_below.to(tl.int64), 1)
            n_above += tl.sum(is_above.to(tl.int64), 1)
            keep = keep & ~is_below & ~is_above
        ones = tl.full((ROWS, COLS), 1, tl.int64)
        tl.atomic_add(counts + rows[:, None].to(tl.int64) * BINS + index, ones, mask=keep)
    tl.store(below + rows, n_below, mask=live)
    tl.store(above + rows, n_above, mask=live)
