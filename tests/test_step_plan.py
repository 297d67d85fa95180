"""The plans reused across steps: a step's statistics layout (StepPlan) and the parameters' jobs
(ParameterJobs). Reused while nothing changes; a changed tensor, set of tensors, config or
collection gives a new one, and the results equal those of an engine that never saw a step."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens.backends.memory import MemoryBackend
from tensorlens.collection import Kind
from tensorlens.compute.jobs import TensorJob
from tensorlens.compute.step import StepStatistics
from tensorlens.config import HistogramConfig, ReductionConfig
from tensorlens.dispatch.assemble import host_record
from tensorlens.engine import gather
from tensorlens.engine.parameter_jobs import ParameterJobs
from tensorlens.modes import ModeKeys

pytestmark = pytest.mark.usefixtures("kernel")

STATS = ("min", "max", "mean", "std", "l2", "nan_count", "inf_count")
HIST16 = HistogramConfig(bins=16)


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in ((300, 200), (200,), (64, 64), (64, 64), (5,), (70_000,))]


def _jobs(tensors: list[torch.Tensor], stats=STATS, histogram=HIST16) -> list[TensorJob]:
    return [TensorJob(f"t/{i}", [t], stats, histogram) for i, t in enumerate(tensors)]


def _same(a, b) -> None:
    ra, rb = host_record(a), host_record(b)
    assert ra.scalar_names == rb.scalar_names
    np.testing.assert_array_equal(ra.scalar_values, rb.scalar_values)
    assert [h.tensor for h in ra.histograms] == [h.tensor for h in rb.histograms]
    for ha, hb in zip(ra.histograms, rb.histograms, strict=True):
        np.testing.assert_array_equal(ha.counts, hb.counts)
        np.testing.assert_array_equal(ha.edges, hb.edges)


def test_a_plan_is_reused_while_the_tensors_keep_their_shape() -> None:
    engine = StepStatistics()
    for seed in range(4):  # new tensors (new values, new storage) of the same shapes every step
        tensors = _tensors(seed)
        _same(engine.compute(_jobs(tensors)), StepStatistics().compute(_jobs(tensors)))
    assert engine.plans_built == 1


def test_two_job_lists_taking_turns_keep_their_plans() -> None:
    """A saved step computes twice (parameters before the optimizer step, updates and module
    dynamics after it): each list keeps its plan instead of rebuilding the other's every time."""
    engine = StepStatistics()
    for seed in range(4):
        tensors = _tensors(seed)
        before, after = _jobs(tensors[:3]), _jobs(tensors[3:])
        _same(engine.compute(before), StepStatistics().compute(before))
        _same(engine.compute(after), StepStatistics().compute(after))
    assert engine.plans_built == 2


@pytest.mark.parametrize(
    "change",
    ["shape", "dtype", "added", "removed", "reordered", "stats", "histogram", "name", "device_layout", "nan", "several_pieces"],
)
def test_a_changed_step_gets_a_new_plan_and_the_right_statistics(change: str) -> None:
    """Each change between two steps: the reused engine must agree with a fresh one (a stale plan
    would read the wrong sizes, columns, bins or names)."""
    engine = StepStatistics()
    engine.compute(_jobs(_tensors(0)))
    tensors = _tensors(1)
    jobs = _jobs(tensors)
    if change == "shape":
        jobs[2] = TensorJob("t/2", [torch.randn(64, 65)], STATS, HistogramConfig(bins=16))
    elif change == "dtype":
        jobs[0] = TensorJob("t/0", [tensors[0].double()], STATS, HistogramConfig(bins=16))
    elif change == "added":
        jobs.append(TensorJob("t/new", [torch.randn(64, 64)], STATS, HistogramConfig(bins=16)))
    elif change == "removed":
        del jobs[3]
    elif change == "reordered":
        jobs = jobs[::-1]
    elif change == "stats":
        jobs = _jobs(tensors, stats=("mean", "median", "zero_fraction", "abs_min", "prod"))
    elif change == "histogram":
        jobs = _jobs(tensors, histogram=HistogramConfig(bins=7, range=(-1.0, 1.0)))
    elif change == "name":
        jobs[1] = TensorJob("renamed", [tensors[1]], STATS, HistogramConfig(bins=16))
    elif change == "device_layout":
        jobs[0] = TensorJob("t/0", [tensors[0].t()], STATS, HistogramConfig(bins=16))  # not contiguous
    elif change == "nan":
        tensors[5][7] = math.nan
        tensors[2][0, 0] = math.inf
    elif change == "several_pieces":
        jobs[4] = TensorJob("t/4", [tensors[4], torch.randn(9)], STATS, HistogramConfig(bins=16))
    found = engine.compute(jobs)
    if change != "nan":
        assert engine.plans_built == 2
    _same(found, StepStatistics().compute(jobs))


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _job_view(jobs: list[TensorJob]) -> list[tuple[object, ...]]:
    return [(j.name, j.stats, j.histogram, j.save_raw, j.save_shape, j.plain_scalar, j.partitioned, [id(p) for p in j.pieces])
            for j in jobs]


def test_parameter_jobs_from_templates_equal_jobs_built_per_tensor(tmp_path) -> None:
    model = _model()
    hook = tl.watch(model, collections=["weights", "biases", "gradients"], backends=["local"], out_dir=str(tmp_path))
    try:
        planner, cache = hook.schedule, ParameterJobs()
        saving = planner.saving(ModeKeys.TRAIN, 0)

        def check() -> None:
            params = hook._parameters()
            assert _job_view(cache.jobs(planner, lambda: params, saving)) == _job_view(gather.parameter_jobs(planner, params, saving))

        check()  # no gradients yet
        model(torch.randn(2, 6)).sum().backward()
        check()  # gradients appear: the same templates, new pieces
        assert cache.built == 1
        model[0].weight.grad = None  # one gradient gone
        check()
        model[2].weight.grad = torch.randn(3, 5)  # a new gradient tensor
        check()
        assert cache.built == 1
        hook.get_collection("gradients").reduction_config = ReductionConfig(reductions=["max"])
        check()  # a config changed: rebuilt, with the new statistics
        assert cache.built == 2
        hook.get_collection("weights").histogram_config = HistogramConfig(bins=5)
        check()
        assert cache.built == 3
        hook.register_module(nn.Linear(2, 2), name="extra")  # another parameter
        check()
        assert cache.built == 4
    finally:
        hook.close()


def test_a_config_changed_between_saved_steps_reaches_the_records(tmp_path) -> None:
    """End to end: the recorder's kept jobs and plans follow a collection's new reductions and
    histogram bins at the next saved step."""
    model = _model()
    memory = MemoryBackend()
    hook = tl.watch(model, collections=["weights", "gradients"], save_interval=1, backends=[memory], out_dir=str(tmp_path))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(4, 6)).sum().backward()
        opt.step()

    step()
    hook.get_collection(Kind.GRADIENTS).reduction_config = ReductionConfig(reductions=["max"], norms=["l1"])
    hook.get_collection(Kind.WEIGHTS).histogram_config = HistogramConfig(bins=5)
    step()
    hook.close()
    first, second = memory.records[0], memory.records[1]
    grad_stats = {stat for name, stat in second.scalar_names if name.startswith("gradients/") and "/p" not in stat}
    assert {"max", "l1"} <= grad_stats and "mean" not in grad_stats
    assert "mean" in {stat for name, stat in first.scalar_names if name.startswith("gradients/")}
    assert len(second.histogram("weights/0.weight").counts) == 5
    assert len(first.histogram("weights/0.weight").counts) != 5
