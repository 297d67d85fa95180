"""DeadRelu does not call a layer whose outputs turned NaN dead (NaN compares inactive, so its
dead_fraction reads 1.0): the NaN run's story is told by the non-finite rules, not a made-up
collapse; the real dead-ReLU collapse of the same model is still found."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reports"))

from health_runs import DEAD_RELU, train  # noqa: E402

from tensorlens import rules as R  # noqa: E402


def test_nan_outputs_are_not_dead_units(tmp_path) -> None:
    nan = R.evaluate(train(tmp_path, "nan", "nan"), [R.DeadRelu(), R.NonFiniteGradient()])
    assert not [f for f in nan.findings if f.rule == "DeadRelu"], nan.findings
    assert [f for f in nan.findings if f.rule == "NonFiniteGradient"]
    dead = R.evaluate(train(tmp_path, "dead", "dead"), [R.DeadRelu()])
    assert {f.tensor for f in dead.findings} == {f"activations/{DEAD_RELU}"}
