"""The bounds rules rely on hold for every tensor: checked against numpy on the raw values."""

from __future__ import annotations

import numpy as np
import pytest

from tensorlens.records import HistogramEntry
from tensorlens.rules import bounds

RNG = np.random.default_rng(0)

SAMPLES = {
    "normal": RNG.normal(size=(64, 32)),
    "shifted": RNG.normal(loc=12.0, size=(64, 32)),
    "two_sided": np.where(RNG.random((64, 32)) < 0.5, -1.0, 1.0) * RNG.normal(20.0, 2.0, size=(64, 32)),
    "mostly_saturated": np.concatenate([RNG.normal(15.0, 1.0, size=(60, 32)), RNG.normal(size=(4, 32))]),
    "uniform": RNG.uniform(-30, 30, size=(64, 32)),
    "relu": np.maximum(RNG.normal(size=(64, 32)) - 1.5, 0.0),
    "constant": np.full((64, 32), 3.0),
}


def stats_of(x: np.ndarray) -> dict[str, float]:
    x = x.astype(np.float64)
    return {"min": x.min(), "max": x.max(), "mean": x.mean(), "l2": float(np.sqrt((x * x).sum())), "l1": float(np.abs(x).sum()),
            "numel": float(x.size), "nan_count": 0.0, "inf_count": 0.0, "std": x.std()}


def histogram_of(x: np.ndarray, bins: int = 16, sampled: bool = False) -> HistogramEntry:
    counts, edges = np.histogram(x, bins=bins)
    return HistogramEntry("t", counts.astype(np.int64), edges, float(x.min()), float(x.max()), int(x.size), float(x.sum()),
                          float((x * x).sum()), sampled=sampled)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_abs_mean_exact_from_l1_and_bounded_from_l2(name: str) -> None:
    x = SAMPLES[name]
    s = stats_of(x)
    exact, is_exact = bounds.abs_mean(s)
    assert is_exact and exact == pytest.approx(np.abs(x).mean(), rel=1e-12)
    s.pop("l1")
    bound, is_exact = bounds.abs_mean(s)
    assert not is_exact and bound >= np.abs(x).mean() * (1 - 1e-12)


@pytest.mark.parametrize("name", sorted(SAMPLES))
@pytest.mark.parametrize("low, high", [(-9.4999, 9.4999), (-23.0, 16.99999), (-1.0, 2.0), (0.0, 1e-9)])
@pytest.mark.parametrize("with_histogram", [False, True])
def test_fraction_outside_never_exceeds_the_truth(name: str, low: float, high: float, with_histogram: bool) -> None:
    x = SAMPLES[name]
    truth = float(np.mean((x <= low) | (x >= high)))
    found = bounds.fraction_outside(stats_of(x), low, high, histogram_of(x) if with_histogram else None)
    assert 0.0 <= found <= truth + 1e-12


def test_fraction_outside_is_tight_where_the_statistics_prove_it() -> None:
    assert bounds.fraction_outside(stats_of(SAMPLES["shifted"] + 20), -9.4999, 9.4999) == 1.0  # min above high
    # half near +20, half near -20: min/max prove nothing, the mean square proves half
    assert bounds.fraction_outside(stats_of(SAMPLES["two_sided"]), -9.4999, 9.4999) > 0.5
    # a histogram that binned every value counts whole bins outside
    x = SAMPLES["mostly_saturated"]
    truth = float(np.mean((x <= -9.4999) | (x >= 9.4999)))
    assert bounds.fraction_outside(stats_of(x), -9.4999, 9.4999, histogram_of(x, bins=64)) > truth - 0.05
    # a sampled histogram is not evidence about every value
    assert bounds.fraction_outside({"numel": 4.0}, -1, 1, histogram_of(np.array([5.0, 5, 5, 5]), sampled=True)) == 0.0


@pytest.mark.parametrize("threshold", [0.5, 1.0, 10.0, 50.0])
def test_units_below_activity_never_exceeds_the_truth(threshold: float) -> None:
    for trial in range(20):
        generator = np.random.default_rng(trial)
        rates = generator.choice([0.0, 0.001, 0.3, 0.9, 1.0], size=64)  # per-unit probability of being active
        active = generator.random((200, 64)) < rates
        truth = float(np.mean(active.mean(axis=0) * 100 < threshold))
        assert bounds.units_below_activity(1.0 - active.mean(), threshold) <= truth + 1e-12
    assert bounds.units_below_activity(1.0, threshold) == 1.0  # all values inactive: all units dead


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_percentile_spread_upper_bounds_numpy(name: str) -> None:
    x = SAMPLES[name]
    truth = np.percentile(x, 95) - np.percentile(x, 5)
    for histogram in (None, histogram_of(x), histogram_of(x, bins=128)):
        assert bounds.percentile_spread_upper(stats_of(x), histogram) >= truth - 1e-12
    assert bounds.percentile_spread_upper(stats_of(x), histogram_of(x, bins=128)) <= x.max() - x.min() + 1e-12
