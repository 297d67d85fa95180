"""Display views (quantiles, thinning, heatmap grids) against numpy references."""

from __future__ import annotations

import numpy as np
import pytest

from tensorlens.stats.views import (
    StrideThinner,
    decimate_minmax,
    heatmap_grid,
    histogram_quantile_rows,
    histogram_quantiles,
    rebin,
    symlog,
    symlog_inverse,
    thin_indices,
)


def test_quantiles_close_to_numpy_on_raw_values() -> None:
    rng = np.random.default_rng(0)
    values = rng.standard_t(3, size=50_000)
    counts, edges = np.histogram(values, bins=128)
    levels = [0.01, 0.1, 0.5, 0.9, 0.99]
    got = histogram_quantiles(counts, edges, levels)
    assert got is not None
    assert np.max(np.abs(got - np.quantile(values, levels))) <= edges[1] - edges[0]


def test_stride_thinner_keeps_evenly_spread_items_and_the_latest() -> None:
    kept = StrideThinner(8)
    for i in range(100):
        kept.add(i, i)
    values = kept.values()
    assert values[0] == 0 and values[-1] == 99
    assert len(values) <= 9
    gaps = {b - a for a, b in zip(values[:-2], values[1:-1], strict=True)}
    assert len(gaps) == 1
    assert kept.values(latest=False)[-1] != 99


@pytest.mark.parametrize("length", [0, 1, 2, 7, 100, 10_001])
@pytest.mark.parametrize("cap", [1, 2, 5, 64])
def test_thin_indices(length: int, cap: int) -> None:
    got = thin_indices(length, cap)
    if length == 0:
        assert got.size == 0
        return
    assert len(got) <= max(cap, 1) and len(got) == min(length, cap) or (cap == 1 and got.tolist() == [length - 1])
    assert got[-1] == length - 1
    assert np.all(np.diff(got) > 0)
    if cap >= 2:
        assert got[0] == 0
        if length > cap:  # evenly spread: gaps differ by at most one
            gaps = np.diff(got)
            assert gaps.max() - gaps.min() <= 1


def test_decimate_minmax_keeps_every_extreme_of_each_bucket() -> None:
    rng = np.random.default_rng(1)
    y = rng.normal(size=10_000)
    y[1234] = 50.0
    y[8765] = -40.0
    y[4000] = np.nan
    y[4001] = np.inf
    x = np.arange(10_000) * 10
    xs, ys = decimate_minmax(x, y, 200)
    assert len(xs) <= 200 + 2 + 2
    assert np.all(np.diff(xs) > 0)
    assert xs[0] == 0 and xs[-1] == x[-1]
    assert 12340 in xs.tolist() and 87650 in xs.tolist()
    assert 40000 in xs.tolist() and 40010 in xs.tolist()
    # reference: the min and max of every bucket, computed with a loop
    bounds = np.linspace(0, len(y), 101).astype(int)
    finite = np.where(np.isfinite(y), y, np.nan)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        chunk = finite[a:b]
        assert x[a + np.nanargmin(chunk)] in xs and x[a + np.nanargmax(chunk)] in xs
    short_x, short_y = decimate_minmax(x[:50], y[:50], 200)
    assert np.array_equal(short_x, x[:50]) and np.array_equal(short_y, y[:50])


def test_rebin_matches_numpy_for_aligned_grids() -> None:
    rng = np.random.default_rng(2)
    values = rng.normal(size=5000)
    counts, edges = np.histogram(values, bins=64)
    grid = edges[::4]  # every 4th edge: the fractions are exact sums of 4 bins
    want = np.histogram(values, bins=grid)[0] / len(values)
    np.testing.assert_allclose(rebin(counts, edges, grid), want, rtol=1e-12, atol=1e-15)
    assert rebin(np.zeros(3), np.arange(4.0), grid).sum() == 0


def test_symlog_roundtrip() -> None:
    x = np.array([-1e6, -3.0, -1e-9, 0.0, 1e-9, 0.5, 1e12])
    np.testing.assert_allclose(symlog_inverse(symlog(x, 1e-3), 1e-3), x, rtol=1e-9, atol=1e-20)
    assert np.all(np.diff(symlog(x, 1e-3)) > 0)


@pytest.mark.parametrize("axis", ["range", "quantile", "symlog"])
def test_heatmap_grid_columns_are_fractions(axis: str) -> None:
    rng = np.random.default_rng(3)
    counts, edges = [], []
    for step in range(20):
        values = rng.normal(scale=1 + step, size=2000)
        if step == 7:
            values[0] = 1e4  # one outlier step
        c, e = np.histogram(values, bins=32)
        counts.append(c)
        edges.append(e)
    grid, image = heatmap_grid(counts, edges, rows=40, axis=axis)
    assert image.shape == (40, 20) and len(grid) == 41
    assert np.all(np.diff(grid) > 0)
    sums = image.sum(axis=0)
    assert np.all(sums <= 1 + 1e-12)
    if axis == "quantile":
        assert grid[-1] < 1e3  # the outlier does not set the axis
        assert np.all(sums > 0.95)
    else:
        np.testing.assert_allclose(sums, 1.0)
        assert grid[-1] == pytest.approx(max(e[-1] for e in edges))
    if axis == "symlog":
        # finer cells near zero than far out
        widths = np.diff(grid)
        at_zero = np.searchsorted(grid, 0.0) - 1
        assert widths[at_zero] < widths.max() / 10
    with pytest.raises(ValueError, match="axis"):
        heatmap_grid(counts, edges, rows=4, axis="log")


def test_heatmap_grid_reference_loop() -> None:
    """Each cell equals the fraction of the column's values in it, with values spread evenly within a bin."""
    counts = [np.array([1, 3]), np.array([2, 0, 2])]
    edges = [np.array([0.0, 1.0, 2.0]), np.array([1.0, 2.0, 3.0, 4.0])]
    grid, image = heatmap_grid(counts, edges, rows=4)
    np.testing.assert_allclose(grid, [0, 1, 2, 3, 4])
    np.testing.assert_allclose(image[:, 0], [0.25, 0.75, 0, 0])
    np.testing.assert_allclose(image[:, 1], [0, 0.5, 0, 0.5])
    # NaN edges (an all-NaN tensor) give an empty column, never NaN cells
    grid, image = heatmap_grid([np.array([0, 0])], [np.array([np.nan, np.nan, np.nan])], rows=3)
    assert np.all(image == 0)


def test_quantile_rows_equal_one_histogram_at_a_time() -> None:
    """The batched rows (one search over every row's cumulative counts) give the bits of
    :func:`histogram_quantiles` row by row: sparse and empty rows, levels at 0 and 1, one bin."""
    rng = np.random.default_rng(1)
    for trial in range(300):
        groups, bins = int(rng.integers(1, 40)), int(rng.integers(1, 70))
        counts = rng.integers(0, 5, (groups, bins)) * (rng.random((groups, bins)) < rng.random())
        if trial % 3 == 0:
            counts[rng.integers(0, groups)] = 0
        edges = np.sort(rng.standard_normal((groups, bins + 1)), axis=1)
        levels = tuple(sorted(rng.random(int(rng.integers(1, 8))))) + ((0.0, 1.0) if trial % 5 == 0 else ())
        rows = histogram_quantile_rows(counts, edges, levels)
        for g in range(groups):
            expected = histogram_quantiles(counts[g], edges[g], levels)
            if expected is None:
                assert np.isnan(rows[g]).all()
            else:
                np.testing.assert_array_equal(rows[g], expected)
