"""Quantiles read off a histogram lie in [min, max] of the values binned, and equal the value of
a constant tensor (or of the constant finite part of a tensor holding NaN/Inf) exactly, on both
statistics paths. A bin is wider than the values in it, so interpolating inside it used to place
quantiles where no value is: an all-zero gradient had p50 = 0.0078."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens.stats.views import histogram_quantile_rows

LEVELS = ("p01", "p05", "p25", "p50", "p75", "p95", "p99")


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    two = torch.zeros(1000)
    two[::2] = 1.0
    holey = torch.full((1000,), 2.5)
    holey[:7], holey[7:10], holey[10:12] = float("nan"), float("inf"), -float("inf")
    return {
        "zero": torch.zeros(64, 32),
        "constant": torch.full((1000,), 3.7),
        "negative_constant": torch.full((10,), -1e-3),
        "one_value": torch.tensor([0.1]),
        "two_valued": two,
        "tiny": torch.rand(500, generator=g) * 1e-30,
        "huge_range": (torch.rand(500, generator=g) * 2 - 1) * 1e30,
        "constant_with_nan_and_inf": holey,
    }


class Held(nn.Module):
    """Parameters holding each case as it is (the optimizer never changes them)."""

    def __init__(self) -> None:
        super().__init__()
        self.values = nn.ParameterDict({k: nn.Parameter(v) for k, v in _cases().items()})


def test_every_quantile_lies_in_min_max_and_is_exact_on_constants(tmp_path, kernel) -> None:
    model = Held()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # no backward: no gradient, nothing changes
    hook = tl.watch(model, save_interval=1, backends=["local"], out_dir=str(tmp_path))
    opt.step()
    hook.close()
    with tl.open_run(hook.run_dir) as run:
        for name, values in _cases().items():
            tensor = run.tensor(f"weights/values.{name}")
            finite = values[torch.isfinite(values)].double().numpy()
            _, _, info = tensor.histogram_with_info(step=0)
            low, high = info["min"], info["max"]  # of the values binned: the finite ones
            assert (low, high) == (finite.min(), finite.max()), name
            if finite.size == values.numel():  # min and max of a tensor holding NaN are NaN
                assert (tensor.reduction_value(step=0, name="min"), tensor.reduction_value(step=0, name="max")) == (low, high)
            for level in LEVELS:
                q = tensor.reduction_value(step=0, name=level)
                assert low <= q <= high, (name, level, q, low, high)
                if low == high:  # constant (its finite part): the value itself, exactly
                    assert q == low, (name, level, q)


def test_bounds_leave_quantiles_inside_the_values_unchanged() -> None:
    rng = np.random.default_rng(1)
    values = rng.normal(size=(3, 5000))
    edges = np.stack([np.linspace(v.min(), v.max(), 65) for v in values])
    counts = np.stack([np.histogram(v, e)[0] for v, e in zip(values, edges, strict=True)])
    levels = [0.01, 0.5, 0.99]
    free = histogram_quantile_rows(counts, edges, levels)
    bounded = histogram_quantile_rows(counts, edges, levels, values.min(axis=1), values.max(axis=1))
    np.testing.assert_array_equal(free, bounded)  # the data's range is the histogram's: nothing to bound


def test_nan_bounds_bound_nothing_and_empty_rows_stay_nan() -> None:
    counts = np.array([[0, 4, 0], [0, 0, 0]])
    edges = np.array([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]])
    rows = histogram_quantile_rows(counts, edges, [0.5], np.array([math.nan, 0.0]), np.array([math.nan, 0.0]))
    assert rows[0, 0] == 1.5 and math.isnan(rows[1, 0])
    assert histogram_quantile_rows(counts[:1], edges[:1], [0.5], np.array([1.25]), np.array([1.25]))[0, 0] == 1.25


@pytest.mark.parametrize("seed", range(20))
def test_bounded_rows_lie_in_the_bounds_for_random_histograms(seed: int) -> None:
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 5, size=(4, 16)) * (rng.random((4, 16)) < 0.3)
    edges = np.sort(rng.normal(size=(4, 17)), axis=1)
    low, high = edges[:, 0] + rng.random(4) * 0.1, edges[:, -1] - rng.random(4) * 0.1
    rows = histogram_quantile_rows(counts, edges, [0.0, 0.01, 0.5, 0.99, 1.0], low, high)
    filled = counts.sum(axis=1) > 0
    assert np.all((rows[filled] >= low[filled, None]) & (rows[filled] <= high[filled, None]))
    assert np.all(np.isnan(rows[~filled]))
