"""Tensors holding NaN and Inf: counted exactly (the compiled kernel in its one vectorised read;
PyTorch ops in a batched pass, or in the first pass where the host must not wait), statistics
propagating like numpy's, histograms over the finite values of the sample, and one host copy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tensorlens.compute.jobs import TensorJob
from tensorlens.compute.step import StepStatistics
from tensorlens.config import HistogramConfig
from tensorlens.dispatch.assemble import host_record
from tensorlens.stats.histogram import sample_stride
from tensorlens.stats.moments import COL
from tensorlens.stats.torch_rows import TorchRows, nonfinite_count_rows

pytestmark = pytest.mark.usefixtures("kernel")

STATS = ("min", "max", "sum", "mean", "std", "l1", "l2", "zero_fraction", "nan_count", "inf_count", "numel")
SIZES = (1, 7, 300, 2048, 2049, 4096, 4097, 65_536, 70_001, 300_000)


def _poisoned(seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Tensors of every size class (shared buffer, stacked, alone; one or several kernel blocks),
    with NaN, +Inf, -Inf or both infinities at random places, or none, or only NaN."""
    rng = np.random.default_rng(seed)
    out = []
    for n in SIZES:
        a = rng.normal(size=n)
        a[rng.random(n) < 0.1] = 0.0
        kind = rng.integers(0, 5)
        spots = rng.choice(n, size=min(n, int(rng.integers(1, 40))), replace=False)
        if kind == 1:
            a[spots] = np.nan
        elif kind == 2:
            a[spots] = np.where(rng.random(spots.size) < 0.5, np.inf, -np.inf)
        elif kind == 3:
            a[spots] = rng.choice([np.nan, np.inf, -np.inf], size=spots.size)
        elif kind == 4 and n > 1:
            a[:] = np.nan
        out.append(torch.from_numpy(a).to(dtype))
    return out


def _reference(a: np.ndarray) -> dict[str, float]:
    a = a.astype(np.float64)
    with np.errstate(all="ignore"):
        return {
            "nan_count": float(np.isnan(a).sum()), "inf_count": float(np.isinf(a).sum()), "numel": float(a.size),
            "min": float(a.min()), "max": float(a.max()), "sum": float(a.sum()), "mean": float(a.mean()),
            "std": float(a.std()), "l1": float(np.abs(a).sum()), "l2": float(np.sqrt((a * a).sum())),
            "zero_fraction": float((a == 0).mean()),
        }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_counts_and_statistics_of_poisoned_tensors_equal_numpy(dtype, sync_free: bool, seed: int) -> None:
    tensors = _poisoned(seed, dtype)
    engine = StepStatistics(sync_free=sync_free)
    record = host_record(engine.compute([TensorJob(f"t/{i}", [t], STATS, HistogramConfig(bins=16)) for i, t in enumerate(tensors)]))
    assert engine.host_copies == 1  # no second pass, no second copy
    for i, t in enumerate(tensors):
        a = t.double().numpy()
        for stat, want in _reference(a).items():
            got = record.scalar(f"t/{i}", stat)
            if stat in ("nan_count", "inf_count", "numel", "min", "max") or not np.isfinite(want):
                assert got == want or (math.isnan(got) and math.isnan(want)), (i, stat, got, want)
            else:
                scale = float(np.abs(a[np.isfinite(a)]).sum()) + 1.0
                assert abs(got - want) <= 1e-5 * max(scale, abs(want)) + 1e-9, (i, stat, got, want)


@pytest.mark.parametrize("sync_free", [False, True])
def test_histograms_of_poisoned_tensors_span_the_finite_values_of_their_sample(sync_free: bool) -> None:
    tensors = _poisoned(7, torch.float32)
    config = HistogramConfig(bins=16, sample=1000)
    record = host_record(StepStatistics(sync_free=sync_free).compute(
        [TensorJob(f"t/{i}", [t], ("mean",), config) for i, t in enumerate(tensors)]
    ))
    for i, t in enumerate(tensors):
        a = t.numpy()
        stride = sample_stride(a.size, config.sample, a.size)
        sample = a[::stride]
        finite = sample[np.isfinite(sample)]
        h = record.histogram(f"t/{i}")
        assert h.nan_count == np.isnan(a).sum() and h.inf_count == np.isinf(a).sum()
        assert h.counts.sum() == finite.size
        np.testing.assert_array_equal(h.counts, np.histogram(finite.astype(np.float64), bins=h.edges)[0])
        # the range: the tensor's own where it is finite, else its sample's finite values
        span = (a.min(), a.max()) if np.isfinite(a).all() else (finite.min(), finite.max()) if finite.size else None
        if span is not None and span[0] < span[1]:
            assert (h.edges[0], h.edges[-1]) == span


@pytest.mark.parametrize("counts", ["always", "flagged"])
def test_first_pass_counts_equal_numpy(counts: str) -> None:
    """The PyTorch path's counts, of every size class, NaN throughout or here and there."""
    tensors = [t.float().reshape(-1) for t in _poisoned(3, torch.float32)] + [torch.zeros(0), torch.full((70_000,), math.nan)]
    columns = [frozenset({"count", "sum", "min", "max", "nan_count", "inf_count", "m2", "sumsq", "zero_count"})] * len(tensors)
    rows = TorchRows([t.numel() for t in tensors], [t.dtype for t in tensors], columns, torch.device("cpu"), counts).run(tensors)
    for t, row in zip(tensors, rows.numpy(), strict=True):
        assert (row[COL["nan_count"]], row[COL["inf_count"]]) == (float(torch.isnan(t).sum()), float(torch.isinf(t).sum()))
        assert row[COL["zero_count"]] == float((t == 0).sum())
    matrix = torch.stack([torch.tensor([1.0, math.nan, math.inf, -math.inf, 0.0]), torch.tensor([math.nan] * 5)])
    assert nonfinite_count_rows(matrix).tolist() == [[1.0, 2.0], [5.0, 0.0]]
