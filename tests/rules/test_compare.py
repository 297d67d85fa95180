"""compare_runs: where two stored runs first differ, per tensor and statistic."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from scenarios import PARAMETER_COLLECTIONS, Training, mlp, regression_data

import tensorlens as tl
from tensorlens import rules as R


def train(tmp_path: Any, name: str, lr: float = 0.05, steps: int = 5, collections: list[str] | None = None,
          reduction_config: tl.ReductionConfig | None = None, evaluate: bool = False) -> str:
    t = Training(tmp_path, name, [], collections=collections or PARAMETER_COLLECTIONS + ["updates", "optimizer"],
                 reduction_config=reduction_config)
    x, y = regression_data()
    model = mlp(seed=0)
    t.fit(model, x, y, steps=steps, lr=lr)
    if evaluate:
        t.evaluate(model, x, y)
    t.close()
    return t.run_dir


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> str:
    return train(tmp_path_factory.mktemp("compare"), "base", evaluate=True)


def test_same_seed_same_run(tmp_path: Any, base: str) -> None:
    result = R.compare_runs(base, train(tmp_path, "again", evaluate=True), rtol=0.0)
    assert result.equal and result.first_divergence is None
    assert result.steps_compared == 6  # five train steps and one eval step
    assert result.summary().endswith("no difference")
    assert R.compare.compare_command(base, base, echo=lambda line: None) == 0


def test_a_changed_learning_rate_diverges_at_the_first_step_it_can(tmp_path: Any, base: str) -> None:
    other = train(tmp_path, "lr", lr=0.08, evaluate=True)
    result = R.compare_runs(base, other, rtol=1e-6)
    assert not result.equal
    # step 0 reads the same initial weights and data; the learning rate and the update differ at once
    assert result.divergence("optimizer/group0.lr").step == 0
    assert result.divergence("updates/0.weight", "l2").step == 0
    assert result.first_divergence.step == 0
    for tensor, stat in [("weights/0.weight", "l2"), ("gradients/2.bias", "mean"), ("losses/mseloss", "")]:
        found = result.divergence(tensor, stat)
        assert found is not None and found.step == 1, (tensor, stat)
        with tl.open_run(base) as a, tl.open_run(other) as b:
            assert found.a == a.tensor(tensor).reduction_value(1, stat) and found.b == b.tensor(tensor).reduction_value(1, stat)
    assert result.divergence("losses/mseloss", "", mode="eval").mode_step == 0
    assert result.divergence("weights/0.weight", "histogram_edges") is not None
    assert not result.steps_only_in_a and not result.tensors_only_in_a
    assert "statistics differ" in result.summary()
    assert R.compare.compare_command(base, other, echo=lambda line: None) == 1


def test_tolerance(tmp_path: Any, base: str) -> None:
    other = train(tmp_path, "lr", lr=0.0500001, evaluate=True)
    assert not R.compare_runs(base, other, rtol=0.0).equal
    loose = R.compare_runs(base, other, rtol=1e-3, histograms=False)
    assert loose.equal, loose.summary()


def test_runs_of_different_lengths(tmp_path: Any, base: str) -> None:
    short = train(tmp_path, "short", steps=3)
    result = R.compare_runs(base, short)
    assert result.divergences == []  # what both hold is the same
    assert [(k.mode.value, k.mode_step) for k in result.steps_only_in_a] == [("train", 3), ("train", 4), ("eval", 0)]
    assert result.steps_only_in_b == [] and result.steps_compared == 3
    flipped = R.compare_runs(short, base)
    assert [k.mode_step for k in flipped.steps_only_in_b] == [3, 4, 0]


def test_tensors_and_statistics_in_one_run_only(tmp_path: Any, base: str) -> None:
    other = train(tmp_path, "more", evaluate=True, collections=PARAMETER_COLLECTIONS + ["updates", "optimizer", "activations"],
                  reduction_config=tl.ReductionConfig(reductions=["min", "max", "mean", "std"], norms=[], abs_reductions=["mean"]))
    result = R.compare_runs(base, other)
    assert result.divergences == []
    assert "activations/1" in result.tensors_only_in_b and not result.tensors_only_in_a
    assert "gradients/0.weight/abs_mean" in result.stats_only_in_b
    assert "gradients/0.weight/l2" in result.stats_only_in_a


def test_compare_records_checks_raw_values() -> None:
    entry = tl.ScalarEntry("losses/x", None, 1.0)
    a = tl.StepRecord(0, "train", 0, "worker_0", 0.0, scalars=[entry], tensors=[tl.TensorEntry("labels/y", np.array([1, 2, 3]))])
    b = tl.StepRecord(0, "train", 0, "worker_0", 0.0, scalars=[entry], tensors=[tl.TensorEntry("labels/y", np.array([1, 2, 4]))])
    differences, only_a, only_b = R.compare_records(a, b)
    assert differences == [R.compare.Difference("labels/y", "value", 3.0, 4.0, 2)] and not only_a and not only_b


def test_arguments_are_checked(base: str) -> None:
    with pytest.raises(ValueError, match="Expected `rtol`"):
        R.compare_runs(base, base, rtol=-1)
