"""Rules beside training: actions taken on the training thread, failing rules isolated, findings
stored in the run and sent to every backend."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest
import torch
from scenarios import Training, mlp, regression_data
from torch import nn

import tensorlens as tl
from tensorlens import rules as R


def dead_relu_model() -> nn.Module:
    model = mlp()
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    return model


def train_with_actions(t: Training, model: nn.Module, steps: int, lr: float = 0.05, scale: float = 1.0) -> int:
    """Train, taking the rules' actions at each step boundary; the number of steps taken."""
    x, y = regression_data(scale=scale)
    loss_fn = nn.MSELoss()
    t.hook.register_module(model)
    t.hook.register_loss(loss_fn)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        t.hook.flush()  # tests only: let the runner see this step before the boundary
        if t.runner.take_action():
            return step + 1
    return steps


def test_warn_once_per_rule_and_tensor(tmp_path: Any) -> None:
    t = Training(tmp_path, "warn", [R.VanishingGradient(action="warn")])
    with pytest.warns(R.RuleWarning) as caught:
        train_with_actions(t, dead_relu_model(), steps=5)
    t.close()
    fired = [str(w.message) for w in caught if "rule fired" in str(w.message)]
    tensors = {f.tensor for f in t.runner.findings()}
    assert len(t.runner.findings()) == 5 * len(tensors)  # every step is a finding...
    assert len(fired) == len(tensors) == 3  # ...but one warning per tensor
    assert all("VanishingGradient" in m for m in fired)


def test_raise_at_the_next_step_boundary(tmp_path: Any) -> None:
    t = Training(tmp_path, "raise", [R.ExplodingTensor(collection_names="losses", action="raise")])
    with pytest.raises(R.RuleEvaluationConditionMet) as raised:
        train_with_actions(t, mlp(), steps=40, lr=5.0, scale=10.0)
    t.close()
    finding = raised.value.finding
    assert raised.value.rule_name == "ExplodingTensor" and raised.value.step == finding.step
    assert finding.tensor == "losses/mseloss"
    assert finding == t.runner.findings()[0]  # the first one raised
    stored = tl.open_run(t.run_dir).tensor("losses/mseloss").values()
    assert not torch.isfinite(torch.tensor(stored[finding.step])) and all(
        torch.isfinite(torch.tensor(v)) for s, v in stored.items() if s < finding.step)


def test_stop_ends_training_early(tmp_path: Any) -> None:
    t = Training(tmp_path, "stop", [R.ExplodingTensor(action="stop")])
    with pytest.warns(R.RuleWarning, match="asks to stop"):
        taken = train_with_actions(t, mlp(), steps=60, lr=5.0, scale=10.0)
    t.close()
    assert t.runner.should_stop
    first = t.runner.findings()[0].step
    assert taken == first + 1  # stopped at the boundary right after the step that fired
    assert tl.open_run(t.run_dir).steps()[-1] == first


def test_callable_runs_on_the_training_thread(tmp_path: Any) -> None:
    calls: list[tuple[R.Finding, threading.Thread]] = []
    t = Training(tmp_path, "callable", [R.DeadRelu(action=lambda f: calls.append((f, threading.current_thread())))],
                 collections=["weights", "gradients", "activations"])
    train_with_actions(t, dead_relu_model(), steps=3)
    t.close()
    assert [f for f, _ in calls] == t.runner.findings() and calls
    assert {thread for _, thread in calls} == {threading.main_thread()}


class Broken(R.Rule):
    def invoke_at_step(self, record: tl.StepRecord) -> bool:
        raise RuntimeError("a bug in a rule")


def test_a_failing_rule_is_isolated(tmp_path: Any) -> None:
    t = Training(tmp_path, "broken", [Broken(), R.VanishingGradient()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_with_actions(t, dead_relu_model(), steps=4)
        t.close()
    failures = [str(w.message) for w in caught if "failed in invoke_at_step" in str(w.message)]
    assert len(failures) == 1 and "Broken" in failures[0] and "a bug in a rule" in failures[0]
    assert t.runner.failures() == {"Broken": 4}
    assert {f.rule for f in t.runner.findings()} == {"VanishingGradient"}  # the other rule went on
    assert tl.open_run(t.run_dir).steps() == [0, 1, 2, 3]  # and so did training and the store


class Recording(tl.Backend):
    name = "recording"

    def __init__(self) -> None:
        self.findings: list[R.Finding] = []
        self.records = 0

    def write(self, record: tl.StepRecord) -> None:
        self.records += 1

    def write_finding(self, finding: R.Finding) -> None:
        self.findings.append(finding)


def test_findings_reach_the_store_and_every_backend_even_at_close(tmp_path: Any) -> None:
    recording = Recording()
    runner = R.RuleRunner([R.Overfit(), R.LossNotDecreasing(num_steps=2)])
    hook = tl.Hook(out_dir=tmp_path / "run", save_config=tl.SaveConfig(save_interval=1), backends=[recording, runner])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
    loss_fn = nn.MSELoss()
    hook.register_module(model).register_loss(loss_fn)
    x, y = regression_data(n=8)
    vx, vy = regression_data(n=32, seed=5)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(20):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        loss_fn(model(vx), vy)  # the last evaluation: Overfit reports it only when the run ends
    hook.close()
    found = runner.findings()
    assert any(f.rule == "Overfit" for f in found) and found[-1].rule == "Overfit"
    assert recording.findings == found
    assert tl.open_run(str(tmp_path / "run")).findings() == found
    assert tl.open_run(str(tmp_path / "run")).findings("Overfit") == [f for f in found if f.rule == "Overfit"]


def test_a_rule_says_what_to_enable(tmp_path: Any) -> None:
    t = Training(tmp_path, "note", [R.DeadRelu(), R.WeightUpdateRatio()])
    with pytest.warns(UserWarning) as caught:
        train_with_actions(t, mlp(), steps=3)
        t.close()
    notes = [str(w.message) for w in caught if str(w.message).startswith("tensorlens rule ")]
    assert len(notes) == 2  # once each, not once per step
    assert "DeadRelu" in notes[0] and "activations=True" in notes[0]
    assert "WeightUpdateRatio" in notes[1] and "'updates' collection" in notes[1]


@pytest.mark.filterwarnings("ignore::tensorlens.rules.RuleWarning")
def test_custom_rules(tmp_path: Any) -> None:
    class LossAbove(R.Rule):
        def __init__(self, limit: float, **kwargs: Any) -> None:
            self.limit = limit
            super().__init__(**kwargs)

        def invoke_at_step(self, record: tl.StepRecord) -> bool:
            loss = record.scalar("losses/mseloss")
            return loss is not None and loss > self.limit

    t = Training(tmp_path, "custom", [LossAbove(16.5, name="high-loss")])
    train_with_actions(t, mlp(), steps=6)
    t.close()
    losses = tl.open_run(t.run_dir).tensor("losses/mseloss").values()
    assert [f.step for f in t.runner.findings()] == [s for s, v in losses.items() if v > 16.5] != []
    assert {(f.rule, f.tensor, f.message) for f in t.runner.findings()} == {("high-loss", None, "condition met")}
    assert [f.step for f in R.invoke(t.run_dir, LossAbove(16.5, name="high-loss"))] == [f.step for f in t.runner.findings()]
