"""Display views derived from recorded statistics: histogram quantiles, thinned series and
heatmap grids. Pure numpy, shared by every consumer that draws (the W&B and MLflow adapters, the
HTML report, the module explorer), so that a chart looks the same wherever it is drawn.

These are views of what was recorded, not statistics of a tensor: a quantile read off 64 bins is
exact only to within a bin, a thinned series leaves points out, a grid re-bins counts.

>>> histogram_quantiles(np.array([1, 0, 3]), np.array([0.0, 1.0, 2.0, 3.0]), [0.5])
array([2.33333333])
>>> thin_indices(10, 4).tolist()
[0, 3, 6, 9]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "StrideThinner",
    "decimate_minmax",
    "heatmap_grid",
    "histogram_quantiles",
    "rebin",
    "symlog",
    "symlog_inverse",
    "thin_indices",
]


# ---------------------------------------------------------------------------- quantiles


def histogram_quantiles(counts: np.ndarray, edges: np.ndarray, levels: Sequence[float]) -> np.ndarray | None:
    """Quantiles of the binned values, interpolating linearly within a bin.

    The ``q``-quantile is the value at which the cumulative count reaches ``q * counts.sum()``,
    taking the values of each bin as spread evenly between its edges. ``None`` when nothing was
    binned. Display values derived from the stored counts, not a statistic of the tensor.

    >>> histogram_quantiles(np.array([1, 0, 3]), np.array([0.0, 1.0, 2.0, 3.0]), [0.25, 0.5])
    array([1.        , 2.33333333])
    """
    counts = np.asarray(counts, dtype=np.float64)
    edges = np.asarray(edges, dtype=np.float64)
    total = counts.sum()
    if counts.size == 0 or not total > 0:
        return None
    cumulative = np.cumsum(counts)
    targets = np.asarray(levels, dtype=np.float64) * total
    # the first bin whose cumulative count reaches the target; it is never empty when target > 0
    index = np.minimum(np.searchsorted(cumulative, targets, side="left"), counts.size - 1)
    before = cumulative[index] - counts[index]
    with np.errstate(divide="ignore", invalid="ignore"):
        fraction = np.where(counts[index] > 0, (targets - before) / counts[index], 0.0)
    fraction = np.clip(fraction, 0.0, 1.0)
    return edges[index] + fraction * (edges[index + 1] - edges[index])


def histogram_quantile_rows(counts: np.ndarray, edges: np.ndarray, levels: Sequence[float],
                            low: np.ndarray | None = None, high: np.ndarray | None = None) -> np.ndarray:
    """:func:`histogram_quantiles` of ``G`` histograms of one bin count at once: ``counts``
    ``[G, bins]``, ``edges`` ``[G, bins + 1]`` -> ``[G, len(levels)]`` (NaN for an empty one).
    The same values as :func:`histogram_quantiles` row by row (tested), in a dozen numpy calls
    whatever ``G`` (the dispatcher thread runs it for every saved step).

    ``low`` / ``high`` (``[G]``, the binned values' own min and max) bound each row: a bin is
    wider than the values in it (a constant tensor fills one bin of non-zero width), and
    interpolating inside it would place a quantile where no value is (an all-zero gradient got a
    median of 0.0078). Bounded, every quantile lies in [min, max], and equals the value of a
    constant tensor exactly. NaN bounds (nothing finite) bound nothing.

    >>> histogram_quantile_rows(np.array([[1, 0, 3]]), np.array([[0.0, 1.0, 2.0, 3.0]]), [0.25, 0.5])
    array([[1.        , 2.33333333]])
    """
    counts = np.asarray(counts)
    edges = np.asarray(edges, dtype=np.float64)
    groups, bins = counts.shape
    out = np.full((groups, len(levels)), np.nan)
    if groups == 0 or bins == 0 or not levels:
        return out
    flat_counts = counts.reshape(-1).astype(np.int64, copy=False)
    # counts are >= 0, so the cumulative counts of all rows in a row are non-decreasing: one
    # search finds every row's bins, exactly, in integers
    whole = np.cumsum(flat_counts)
    ends = whole[bins - 1 :: bins]
    total = np.diff(ends, prepend=0)
    base = ends - total  # the count before each row
    targets = np.asarray(levels, dtype=np.float64)[None, :] * total[:, None].astype(np.float64)  # [G, L]
    # the first bin whose cumulative count reaches the target (never empty when target > 0): an
    # integer count reaches a target exactly when it reaches the target's ceiling
    start = (np.arange(groups) * bins)[:, None]
    at = np.searchsorted(whole, np.ceil(targets).astype(np.int64) + base[:, None], side="left")
    at = np.minimum(np.maximum(at, start), start + bins - 1)  # flat index of the bin, [G, L]
    in_bin = flat_counts[at].astype(np.float64)
    before = (whole[at] - base[:, None]).astype(np.float64) - in_bin
    with np.errstate(divide="ignore", invalid="ignore"):
        fraction = np.clip(np.where(in_bin > 0, (targets - before) / in_bin, 0.0), 0.0, 1.0)
    flat_edges = edges.reshape(-1)
    left = at + np.arange(groups)[:, None]  # a row of edges is one longer than its row of counts
    values = flat_edges[left] + fraction * (flat_edges[left + 1] - flat_edges[left])
    if low is not None:
        values = np.fmax(values, np.asarray(low, dtype=np.float64)[:, None])  # fmax: a NaN bound is no bound
    if high is not None:
        values = np.fmin(values, np.asarray(high, dtype=np.float64)[:, None])
    return np.where((total > 0)[:, None], values, np.nan)


def quantile_name(level: float) -> str:
    """The statistic name of a quantile level: ``p01`` for 0.01, ``p50`` for 0.5, ``p99.9`` for 0.999.

    >>> quantile_name(0.05), quantile_name(0.999)
    ('p05', 'p99.9')
    """
    percent = round(level * 100, 6)
    return f"p{int(percent):02d}" if percent == int(percent) else f"p{percent:g}"


# ---------------------------------------------------------------------------- thinning


class StrideThinner:
    """At most ``cap`` items, evenly spread over everything added, for a series whose length is
    not known in advance (a live backend). When full, every other item is dropped and only every
    ``2 * stride``-th index is taken from then on. :meth:`values` can add the latest item, so a
    chart ends at the newest step.

    >>> kept = StrideThinner(4)
    >>> for i in range(10):
    ...     _ = kept.add(i, i)
    >>> kept.values()
    [0, 4, 8, 9]
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.stride = 1
        self.items: list[tuple[int, Any]] = []
        self.latest: tuple[int, Any] | None = None

    def add(self, index: int, item: Any) -> bool:
        """Offer the ``index``-th item; ``True`` if it was kept."""
        self.latest = (index, item)
        if index % self.stride:
            return False
        self.items.append((index, item))
        while len(self.items) > self.cap:
            self.stride *= 2
            self.items = [(i, x) for i, x in self.items if i % self.stride == 0]
        return True

    def values(self, latest: bool = True) -> list[Any]:
        """The kept items in order, plus the latest one added when ``latest`` and not kept."""
        items = list(self.items)
        if latest and self.latest is not None and (not items or items[-1][0] != self.latest[0]):
            items.append(self.latest)
        return [x for _, x in items]

    def __len__(self) -> int:
        return len(self.items)


def thin_indices(length: int, max_points: int) -> np.ndarray:
    """At most ``max_points`` indices of a series of ``length`` items, evenly spread, always with
    the first and the last (for a series whose length is known: a stored run).

    >>> thin_indices(5, 10).tolist(), thin_indices(101, 3).tolist()
    ([0, 1, 2, 3, 4], [0, 50, 100])
    """
    if length <= 0:
        return np.zeros(0, dtype=np.int64)
    if length <= max_points:
        return np.arange(length, dtype=np.int64)
    if max_points < 2:
        return np.array([length - 1], dtype=np.int64)
    return np.unique(np.round(np.linspace(0, length - 1, max_points)).astype(np.int64))


def decimate_minmax(x: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """A line of at most ``max_points + 2`` points that keeps every spike: the series is cut
    into ``max_points // 2`` runs of consecutive points and each run keeps its smallest and its
    largest value (in their order), plus the first and last point of the series. A point that is
    not finite (NaN, ±Inf) is kept too (up to ``max_points`` of them), so a chart shows where a
    run broke. Series no longer than ``max_points`` come back unchanged.

    >>> x = np.arange(10); y = np.array([0, 1, 0, 9, 0, 0, 0, -5, 0, 0.0])
    >>> decimate_minmax(x, y, 4)[0].tolist()
    [0, 3, 5, 7, 9]
    """
    x = np.asarray(x)
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    if n <= max_points:
        return x, y
    buckets = max(max_points // 2, 1)
    bounds = np.linspace(0, n, buckets + 1).astype(np.int64)
    finite = np.isfinite(y)
    keep = np.zeros(n, dtype=bool)
    keep[0] = keep[-1] = True
    # min and max of each run of consecutive points, ignoring non-finite values
    low = np.where(finite, y, np.inf)
    high = np.where(finite, y, -np.inf)
    starts = bounds[:-1]
    nonempty = bounds[1:] > starts
    starts = starts[nonempty]
    min_at = _segment_argext(low, starts, n, np.minimum)
    max_at = _segment_argext(high, starts, n, np.maximum)
    keep[min_at[finite[min_at]]] = True
    keep[max_at[finite[max_at]]] = True
    broken = np.flatnonzero(~finite)
    keep[broken[thin_indices(len(broken), max_points)]] = True
    return x[keep], y[keep]


def _segment_argext(values: np.ndarray, starts: np.ndarray, n: int, ufunc: Any) -> np.ndarray:
    """The index of the extreme (``np.minimum``/``np.maximum``) of each run ``[starts[i], starts[i+1])``."""
    extreme = ufunc.reduceat(values, starts)
    segment = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, n)))
    hits = np.flatnonzero(values == extreme[segment])
    # the first hit of each segment
    first = np.unique(segment[hits], return_index=True)[1]
    return hits[first]


# ---------------------------------------------------------------------------- heatmap grids


def rebin(counts: np.ndarray, edges: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Fractions of ``counts`` falling in each cell of ``grid`` (any increasing edges), the values
    of a bin spread evenly between its edges. Values outside the grid are left out.

    >>> rebin(np.array([2, 2]), np.array([0.0, 1.0, 2.0]), np.array([0.0, 0.5, 2.0])).tolist()
    [0.25, 0.75]
    """
    counts = np.asarray(counts, dtype=np.float64)
    edges = np.asarray(edges, dtype=np.float64)
    grid = np.asarray(grid, dtype=np.float64)
    total = counts.sum()
    if not total > 0 or not np.all(np.isfinite(edges)):
        return np.zeros(len(grid) - 1)
    if np.all(np.diff(edges) > 0):
        cumulative = np.interp(grid, edges, np.concatenate([[0.0], np.cumsum(counts)]))
        return np.diff(cumulative) / total
    # collapsed edges (a huge constant): put each bin's mass at its centre
    centres = (edges[:-1] + edges[1:]) / 2
    return np.histogram(np.clip(centres, grid[0], grid[-1]), bins=grid, weights=counts)[0] / total


def symlog(x: np.ndarray, linthresh: float) -> np.ndarray:
    """The symmetric log transform ``sign(x) * log10(1 + |x| / linthresh)``: linear near zero,
    logarithmic beyond ``linthresh``, defined for both signs (matplotlib's ``symlog`` with base 10)."""
    x = np.asarray(x, dtype=np.float64)
    return np.sign(x) * np.log10(1.0 + np.abs(x) / linthresh)


def symlog_inverse(t: np.ndarray, linthresh: float) -> np.ndarray:
    """The inverse of :func:`symlog`."""
    t = np.asarray(t, dtype=np.float64)
    return np.sign(t) * linthresh * (10.0 ** np.abs(t) - 1.0)


def heatmap_grid(
    counts: Sequence[np.ndarray],
    edges: Sequence[np.ndarray],
    rows: int,
    axis: str = "range",
    clip: float = 0.005,
) -> tuple[np.ndarray, np.ndarray]:
    """One grid for histograms over time: ``(grid, image)`` where ``grid`` holds ``rows + 1``
    increasing value edges shared by every column and ``image[row, column]`` is the fraction of
    column's values in that cell (:func:`rebin`).

    ``axis`` picks the value axis, stable over the whole run:

    - ``"range"``: linear from the smallest to the largest finite edge of any column (the axis
      W&B draws; one outlier step can squash every other column into a few rows);
    - ``"quantile"``: linear from the lowest ``clip`` quantile to the highest ``1 - clip``
      quantile over the columns (:func:`histogram_quantiles`), so that rare outliers do not set
      the scale; values outside are left out of the image (the columns' fractions then sum to
      less than one);
    - ``"symlog"``: :func:`symlog` spacing over the whole range, for values spanning orders of
      magnitude around zero; linear within the median bin width of the columns (the resolution
      the histograms have near zero), logarithmic beyond.

    >>> grid, image = heatmap_grid([np.array([1, 3])], [np.array([0.0, 1.0, 2.0])], rows=2)
    >>> grid.tolist(), image[:, 0].tolist()
    ([0.0, 1.0, 2.0], [0.25, 0.75])
    """
    if axis not in ("range", "quantile", "symlog"):
        raise ValueError(f"Expected `axis` to be 'range', 'quantile' or 'symlog', but got {axis!r}")
    finite = [(np.asarray(c), np.asarray(e, dtype=np.float64)) for c, e in zip(counts, edges, strict=True)]
    finite = [(c, e) for c, e in finite if len(e) and np.all(np.isfinite(e))]
    low = min((float(e[0]) for _, e in finite), default=0.0)
    high = max((float(e[-1]) for _, e in finite), default=1.0)
    if axis == "quantile" and finite:
        found = [histogram_quantiles(c, e, [clip, 1.0 - clip]) for c, e in finite]
        found = [q for q in found if q is not None]
        if found:
            low = min(float(q[0]) for q in found)
            high = max(float(q[1]) for q in found)
    if not high > low:
        low, high = low - 0.5, high + 0.5
    if axis == "symlog":
        magnitude = max(abs(low), abs(high))
        widths = [float(e[-1] - e[0]) / max(len(c), 1) for c, e in finite]
        widths = [w for w in widths if w > 0]
        linthresh = max(float(np.median(widths)) if widths else magnitude * 1e-3, magnitude * 1e-12, 1e-300)
        grid = symlog_inverse(np.linspace(symlog(low, linthresh), symlog(high, linthresh), rows + 1), linthresh)
        grid[0], grid[-1] = low, high
    else:
        grid = np.linspace(low, high, rows + 1)
    columns = [rebin(c, e, grid) for c, e in zip(counts, edges, strict=True)]
    image = np.stack(columns, axis=1) if columns else np.zeros((rows, 0))
    return grid, image
