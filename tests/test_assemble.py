"""A step's record, assembled from histogram blocks (one per bin count and dtype): every
histogram lands under its own tensor, in job order, with its own quantile levels, whatever the
mix of bin counts, dtypes and levels in the step, and after tensors are left out or parts joined."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorlens.compute.host_statistics import HostStatistics
from tensorlens.compute.jobs import TensorJob
from tensorlens.compute.step import StepStatistics
from tensorlens.config import HistogramConfig
from tensorlens.dispatch.assemble import host_record
from tensorlens.records import StepRecord
from tensorlens.stats.views import histogram_quantile_rows, histogram_quantiles, quantile_name

pytestmark = pytest.mark.usefixtures("kernel")

STATS = ("min", "max", "mean", "l2")
CONFIGS = (
    HistogramConfig(bins=16),
    HistogramConfig(bins=8, quantiles=(0.1, 0.9)),
    None,
    HistogramConfig(bins=16, quantiles=()),
    HistogramConfig(bins=16, quantiles=(0.5,)),
)


def _jobs(seed: int = 0) -> list[TensorJob]:
    g = torch.Generator().manual_seed(seed)
    jobs = []
    for i in range(10):  # every config twice, float32 and float64 (one block per bins and dtype)
        dtype = torch.float64 if i % 2 else torch.float32
        values = torch.randn(50 + 7 * i, generator=g, dtype=dtype) * (i + 1)
        jobs.append(TensorJob(f"t/{i}", [values], STATS, CONFIGS[i % len(CONFIGS)]))
    return jobs


def _alone(jobs: list[TensorJob]) -> list[StepRecord]:
    return [host_record(StepStatistics().compute([job])) for job in jobs]


def _assert_matches(record: StepRecord, alone: list[StepRecord]) -> None:
    """``record`` holds exactly what each tensor's own record holds, in the same order."""
    expected_names = [name for r in alone for name in r.scalar_names]
    assert sorted(record.scalar_names) == sorted(expected_names)
    # statistics in job order, then the quantiles in job order
    assert [n for n in record.scalar_names if n[1] in STATS] == [n for n in expected_names if n[1] in STATS]
    assert [n for n in record.scalar_names if n[1] not in STATS] == [n for n in expected_names if n[1] not in STATS]
    found = dict(zip(record.scalar_names, record.scalar_values.tolist(), strict=True))
    for r in alone:
        for name, value in zip(r.scalar_names, r.scalar_values.tolist(), strict=True):
            np.testing.assert_equal(found[name], value)
    assert [h.tensor for h in record.histograms] == [h.tensor for r in alone for h in r.histograms]
    theirs = {h.tensor: h for r in alone for h in r.histograms}
    for mine in record.histograms:
        other = theirs[mine.tensor]
        np.testing.assert_array_equal(mine.counts, other.counts)
        np.testing.assert_array_equal(mine.edges, other.edges)
        assert (mine.min, mine.max, mine.count, mine.sum, mine.sum_squares, mine.sampled) == (
            other.min, other.max, other.count, other.sum, other.sum_squares, other.sampled
        )


def test_mixed_bins_dtypes_and_levels_match_each_tensor_alone() -> None:
    jobs = _jobs()
    record = host_record(StepStatistics().compute(jobs))
    alone = _alone(jobs)
    _assert_matches(record, alone)
    # the quantile scalars are those of each histogram's own levels
    scalars = dict(zip(record.scalar_names, record.scalar_values.tolist(), strict=True))
    for job, hist in zip((j for j in jobs if j.histogram is not None), record.histograms, strict=True):
        levels = job.histogram.quantiles
        expected = histogram_quantiles(hist.counts, hist.edges, levels) if levels else []
        got = [scalars[(job.name, quantile_name(level))] for level in levels]
        np.testing.assert_array_equal(got, expected)


def test_left_out_tensors_and_joined_parts_keep_each_histogram_with_its_tensor() -> None:
    jobs = _jobs(1)
    whole = StepStatistics().compute(jobs)
    kept = [job for i, job in enumerate(jobs) if i not in (0, 3, 4)]
    _assert_matches(host_record(whole.without({0, 3, 4})), _alone(kept))
    parts = [StepStatistics().compute(jobs[:4]), StepStatistics().compute(jobs[4:])]
    _assert_matches(host_record(HostStatistics.concat(parts)), _alone(jobs))


def test_quantile_rows_are_exact_at_ties_and_empty_rows() -> None:
    """Levels that land exactly on a bin's cumulative count, empty bins around them, and an empty
    histogram (no quantiles: NaN), against the one-histogram reference."""
    counts = np.array([[0, 2, 0, 2, 0], [0, 0, 0, 0, 0], [5, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    edges = np.cumsum(np.ones((4, 6)), axis=1) - 1.0
    levels = (0.0, 0.2, 0.25, 0.5, 0.75, 1.0)
    rows = histogram_quantile_rows(counts, edges, levels)
    for g in range(4):
        expected = histogram_quantiles(counts[g], edges[g], levels)
        if expected is None:
            assert np.isnan(rows[g]).all()
        else:
            np.testing.assert_array_equal(rows[g], expected)
