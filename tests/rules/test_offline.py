"""Rules over a stored run: SageMaker's invoke_rule semantics, following a live run, the CLI."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from scenarios import Training, mlp, regression_data

import tensorlens as tl
from tensorlens import rules as R


@pytest.fixture(scope="module")
def frozen_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Six saved steps of a model whose first layer is frozen."""
    t = Training(tmp_path_factory.mktemp("offline"), "frozen", [])
    model = mlp()
    model[0].requires_grad_(False)
    x, y = regression_data()
    t.fit(model, x, y, steps=6)
    t.close()
    return t.run_dir


def unchanged() -> R.Rule:
    return R.UnchangedTensor(collection_names="weights", num_steps=3)


def test_steps_are_start_inclusive_end_exclusive(frozen_run: str) -> None:
    everything = R.invoke(frozen_run, unchanged())
    assert sorted({f.step for f in everything}) == [2, 3, 4, 5]  # three saved steps are needed first
    assert {f.tensor for f in everything} == {"weights/0.weight"}
    # the window of three saved steps fills from start_step on: steps 1, 2, 3 -> a finding at 3
    assert [f.step for f in R.invoke(frozen_run, unchanged(), start_step=1, end_step=5)] == [3, 4]
    assert R.invoke(frozen_run, unchanged(), start_step=0, end_step=2) == []


class Seen(R.Rule):
    """Records the global steps it is invoked at, and fires at each."""

    def reset(self) -> None:
        self.steps: list[int] = []

    def invoke_at_step(self, record: tl.StepRecord) -> bool:
        self.steps.append(record.step)
        return True


def test_the_rule_is_invoked_only_at_steps_in_range(frozen_run: str) -> None:
    # SageMaker's invoke_rule: rule.invoke(step) for step in range(start_step, end_step)
    rule = Seen()
    found = R.invoke(frozen_run, rule, start_step=2, end_step=5)
    assert rule.steps == [2, 3, 4] and [f.step for f in found] == [2, 3, 4]
    R.invoke_rule(rule, 4, None, run=frozen_run)
    assert rule.steps == [4, 5]
    R.invoke(frozen_run, rule, start_step=6)  # past the last saved step: nothing to check
    assert rule.steps == []


def test_raise_eval_cond(frozen_run: str) -> None:
    with pytest.raises(R.RuleEvaluationConditionMet) as raised:
        R.invoke(frozen_run, unchanged(), start_step=1, raise_eval_cond=True)
    assert raised.value.step == 3 and raised.value.rule_name == "UnchangedTensor"
    assert raised.value.finding.tensor == "weights/0.weight"
    R.invoke(frozen_run, unchanged(), end_step=2, raise_eval_cond=True)  # nothing to raise


def test_a_rule_instance_can_be_invoked_again(frozen_run: str) -> None:
    rule = unchanged()
    with tl.open_run(frozen_run) as run:
        first = R.invoke(run, rule)
        assert R.invoke(run, rule) == first != []  # reset() between invocations
    assert R.invoke_rule(rule, 0, None, run=frozen_run) == first  # SageMaker's signature


def test_several_rules_and_bad_arguments(frozen_run: str) -> None:
    found = R.invoke(frozen_run, [unchanged(), R.ExplodingTensor()])
    assert {f.rule for f in found} == {"UnchangedTensor"}
    with pytest.raises(ValueError, match="Expected `rule`"):
        R.invoke(frozen_run, "UnchangedTensor")
    with pytest.raises(ValueError, match="Expected `end_step`"):
        R.invoke(frozen_run, unchanged(), start_step=4, end_step=2)


def test_wait_follows_a_run_until_it_ends(tmp_path: Any) -> None:
    t = Training(tmp_path, "live", [])
    model = mlp()
    model[0].requires_grad_(False)
    x, y = regression_data()
    t.hook.register_module(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    first = threading.Event()

    def train() -> None:
        for _ in range(6):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            t.hook.flush()
            first.set()
            time.sleep(0.05)
        t.close()

    writer = threading.Thread(target=train)
    writer.start()
    first.wait(30)
    found = R.invoke(t.run_dir, unchanged(), wait=True, poll=0.02, timeout=60)
    writer.join()
    assert sorted({f.step for f in found}) == [2, 3, 4, 5]  # every step, though most came after invoke began


def test_wait_gives_up_on_a_run_that_never_ends(tmp_path: Any) -> None:
    t = Training(tmp_path, "crashed", [])
    x, y = regression_data()
    t.fit(mlp(), x, y, steps=2)
    t.hook.flush()  # not closed: as after a crash, the run never ends
    assert not tl.open_run(t.run_dir).ended
    assert R.invoke(t.run_dir, R.ExplodingTensor(), wait=True, timeout=0.2, poll=0.05) == []
    t.close()
    assert tl.open_run(t.run_dir).ended


def test_rules_command(frozen_run: str) -> None:
    lines: list[str] = []
    assert R.rules_command(frozen_run, echo=lines.append) == 0  # the default rules find nothing
    assert [line.split(":")[0] for line in lines] == list(R.DEFAULT_RULES)
    lines.clear()
    code = R.rules_command(frozen_run, ["UnchangedTensor:collection_names=weights;num_steps=3", "ExplodingTensor"],
                           echo=lines.append)
    assert code == 1
    assert lines[0] == "UnchangedTensor: 4 finding(s) from step 2 on 1 tensor(s)"
    assert lines[1].startswith("  [UnchangedTensor] step 2 (train) weights/0.weight: unchanged")
    assert lines[2] == "ExplodingTensor: no finding"


def test_rule_specs_take_sagemaker_string_parameters() -> None:
    rule = R.offline.parse_rule_spec("LossNotDecreasing:num_steps=20;diff_percent=0.5;use_losses_collection=False;"
                                     "tensor_regex=scalars/loss")
    assert (rule.num_steps, rule.diff_percent, rule.use_losses_collection) == (20, 0.5, False)
    assert R.offline.parse_rule_spec("StalledTrainingRule:threshold=60").threshold == 60.0
    with pytest.raises(ValueError, match="built-in rule name"):
        R.offline.parse_rule_spec("NoSuchRule")
    with pytest.raises(ValueError, match="Expected `num_steps`"):
        R.offline.parse_rule_spec("UnchangedTensor:collection_names=weights;num_steps=many")
    with pytest.raises(ValueError, match="key=value"):
        R.offline.parse_rule_spec("UnchangedTensor:weights")


def test_an_unknown_rule_parameter_names_the_rule_and_its_parameters() -> None:
    with pytest.raises(ValueError) as raised:
        R.offline.parse_rule_spec("DeadRelu:threshold_layr=50")
    message = str(raised.value)
    assert "DeadRelu" in message and "'threshold_layr'" in message and "did you mean 'threshold_layer'" in message
    assert "threshold_inactivity, threshold_layer, action, name" in message
    with pytest.raises(ValueError, match="Rule VanishingGradient has no parameter 'a', 'b'; its parameters are: threshold, "):
        R.create_rule("VanishingGradient", a=1, b=2)
    # parameters of the base class, reached through **kwargs, are accepted
    assert R.create_rule("DeadRelu", threshold_layer="50", action="raise", name="dead").name == "dead"
    assert R.offline.parse_rule_spec("DeadRelu:name=dead").name == "dead"
    with pytest.raises(ValueError, match="did you mean 'DeadRelu'"):
        R.create_rule("DeadRelus")
