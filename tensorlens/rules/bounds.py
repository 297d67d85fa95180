"""What recorded statistics prove about a tensor's values: exact values or sound bounds.

SageMaker Debugger's rules read raw tensors; tensorlens records reductions. Where a rule's
quantity is a reduction (a mean of absolute values, a variance, a count of NaN), it is read
exactly. Where it is not (the share of units of a layer that are dead or saturated, a spread
between percentiles), these functions give a *bound* that holds for every tensor with the
recorded statistics, so a rule built on them fires only when its condition is certain, never on
a guess. Each is a pure function, tested against numpy on the raw values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from tensorlens.records import HistogramEntry


def abs_mean(stats: Mapping[str, float]) -> tuple[float, bool] | None:
    """``(mean of |x|, exact)`` from the statistics of one tensor: exact from ``abs_mean``,
    ``l1`` or ``abs_sum`` with ``numel``; else the upper bound ``l2 / sqrt(numel)`` (the root mean
    square is never below the mean of absolute values), flagged ``exact=False``.

    >>> abs_mean({"l2": 2.0, "numel": 4.0})
    (1.0, False)
    """
    if "abs_mean" in stats:
        return stats["abs_mean"], True
    numel = stats.get("numel")
    if not numel:
        return None
    for name in ("l1", "abs_l1", "abs_sum"):
        if name in stats:
            return stats[name] / numel, True
    for name in ("l2", "abs_l2"):
        if name in stats:
            return stats[name] / math.sqrt(numel), False
    return None


#: What :func:`abs_mean` reads, in its order: the statistic, how it becomes the mean of ``|x|``
#: (as it is, over ``numel``, over ``sqrt(numel)``), and whether that is exact.
_ABS_MEAN_SOURCES = (("abs_mean", None, True), ("l1", "numel", True), ("abs_l1", "numel", True),
                     ("abs_sum", "numel", True), ("l2", "sqrt", False), ("abs_l2", "sqrt", False))


def abs_means(stat: Callable[[str], tuple[np.ndarray, np.ndarray]], numel: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`abs_mean` of many tensors at once: ``stat(name)`` gives ``(values, present)`` of a
    statistic over the tensors, ``numel`` their sizes (0 where not recorded). Returns ``(mean of
    |x|, exact, known)``; where ``known`` is False :func:`abs_mean` answers ``None``.

    >>> get = {"l2": (np.array([2.0, 1.0]), np.array([True, False]))}.get
    >>> abs_means(lambda n: get(n, (np.zeros(2), np.zeros(2, bool))), np.array([4.0, 4.0]))
    (array([ 1., nan]), array([False, False]), array([ True, False]))
    """
    value = np.full(len(numel), np.nan)
    exact = np.zeros(len(numel), dtype=bool)
    known = np.zeros(len(numel), dtype=bool)
    sized = numel != 0  # as abs_mean's `not numel`: a NaN size goes on, to a NaN mean
    with np.errstate(invalid="ignore", divide="ignore"):
        for name, scale, is_exact in _ABS_MEAN_SOURCES:
            values, present = stat(name)
            new = present & ~known & (sized if scale else True)
            value[new] = (values if scale is None else values / numel if scale == "numel" else values / np.sqrt(numel))[new]
            exact[new] = is_exact
            known |= new
    return value, exact, known


def fraction_outside(stats: Mapping[str, float], low: float, high: float,
                     histogram: HistogramEntry | None = None) -> float:
    """A lower bound on the fraction of a tensor's values outside the open interval
    ``(low, high)``, i.e. with ``x <= low`` or ``x >= high`` (0.0 when nothing is known).

    Combines what is recorded: ``min``/``max`` (every value beyond a bound), the histogram when it
    binned every value (bins entirely outside, Inf counted), the mean (a share must lie beyond a
    bound for the mean to get there) and ``l2`` (a mean square above ``max(low², high²)`` forces
    values outside). ``numel`` is needed for all but ``min``/``max``.
    """
    if not low < high:
        raise ValueError(f"Expected `low` < `high`, but got {low!r} and {high!r}")
    bounds = [0.0]
    lo, hi = stats.get("min"), stats.get("max")
    if lo is not None and hi is not None and lo == lo and hi == hi and (lo >= high or hi <= low):
        return 1.0
    numel = stats.get("numel")
    finite = not stats.get("nan_count") and not stats.get("inf_count")
    if histogram is not None and numel and not histogram.sampled and not histogram.rejected:
        edges, counts = histogram.edges, histogram.counts
        outside = int(counts[edges[1:] <= low].sum() + counts[edges[:-1] >= high].sum())
        outside += histogram.inf_count
        if histogram.underflow and len(edges) and edges[0] <= low:
            outside += histogram.underflow
        if histogram.overflow and len(edges) and edges[-1] >= high:
            outside += histogram.overflow
        bounds.append(outside / numel)
    if numel and finite and lo is not None and hi is not None:
        mean = stats.get("mean")
        if mean is not None and mean == mean:
            share = 0.0  # disjoint events: P(x >= high) + P(x <= low)
            if hi > high and mean > high:
                share += (mean - high) / (hi - high)
            if lo < low and mean < low:
                share += (low - mean) / (low - lo)
            bounds.append(share)
        l2 = stats.get("l2", stats.get("abs_l2"))
        if l2 is not None and l2 == l2:
            square_limit = max(low * low, high * high)
            largest = max(lo * lo, hi * hi)
            if largest > square_limit:
                bounds.append((l2 * l2 / numel - square_limit) / (largest - square_limit))
    return float(min(1.0, max(bounds)))


def units_below_activity(value_fraction: float, threshold_inactivity: float) -> float:
    """A lower bound on the fraction of units whose activity is below ``threshold_inactivity``
    percent, knowing only that a fraction ``value_fraction`` of all values (every unit seen the
    same number of times) is inactive.

    A unit above the threshold is inactive at most ``1 - a`` of the time (``a`` the threshold as a
    fraction), a unit below it at most always, so ``value_fraction <= d + (1 - d)(1 - a)``.

    >>> units_below_activity(1.0, 1.0), units_below_activity(0.5, 1.0)
    (1.0, 0.0)
    """
    a = threshold_inactivity / 100.0
    if a <= 0.0:
        return 0.0
    return float(min(1.0, max(0.0, 1.0 - (1.0 - value_fraction) / a)))  # = (f - (1 - a)) / a, exact at f = 1


def percentile_spread_upper(stats: Mapping[str, float], histogram: HistogramEntry | None = None,
                            low_q: float = 5.0, high_q: float = 95.0) -> float | None:
    """An upper bound on ``percentile(x, high_q) - percentile(x, low_q)`` (numpy's linear
    percentiles): ``max - min``, tightened by the histogram's bins when it binned every value."""
    lo, hi = stats.get("min"), stats.get("max")
    best = hi - lo if lo is not None and hi is not None and lo == lo and hi == hi else None
    if histogram is not None and not histogram.sampled and not histogram.rejected and histogram.count > 0 \
            and not histogram.underflow and not histogram.overflow and not histogram.nan_count and not histogram.inf_count:
        counts = np.asarray(histogram.counts)
        cumulative = np.cumsum(counts)
        n = int(cumulative[-1])
        # the order statistics the percentiles interpolate between, and the bins holding them
        low_rank = math.floor(low_q / 100.0 * (n - 1))
        high_rank = math.ceil(high_q / 100.0 * (n - 1))
        low_bin = int(np.searchsorted(cumulative, low_rank, side="right"))
        high_bin = int(np.searchsorted(cumulative, high_rank, side="right"))
        spread = float(histogram.edges[high_bin + 1] - histogram.edges[low_bin])
        best = spread if best is None else min(best, spread)
    return best
