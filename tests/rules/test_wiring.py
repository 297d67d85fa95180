"""rules= on tl.watch and tl.Hook: actions at the optimizer step, should_stop, findings()."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from scenarios import mlp, regression_data
from torch import nn

import tensorlens as tl
from tensorlens import rules as R


def diverge(hook: tl.Hook, model: nn.Module, steps: int = 60) -> int:
    """Train with a learning rate that makes everything explode; the steps taken before stopping.

    ``flush`` after each step (tests only) lets the background rules check that step before the
    next boundary, so the boundary at which an action is taken is certain."""
    x, y = regression_data(scale=10.0)
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    for step in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        hook.flush()
        if hook.should_stop:
            return step + 1
    return steps


def test_watch_stops_training_and_keeps_the_findings(tmp_path: Any) -> None:
    model = mlp()
    hook = tl.watch(model, save_interval=1, backends=["local"], out_dir=tmp_path / "run",
                    rules=[R.ExplodingTensor(collection_names="losses,gradients", action="stop")])
    with pytest.warns(R.RuleWarning, match="asks to stop"):
        taken = diverge(hook, model)
    hook.close()
    found = hook.findings()
    # the step that fired was checked after it (flush); its action was taken at the next optimizer step
    assert hook.should_stop and found and taken == found[0].step + 2
    assert tl.open_run(str(tmp_path / "run")).findings() == found


def test_raise_leaves_through_optimizer_step(tmp_path: Any) -> None:
    model = mlp()
    hook = tl.Hook(out_dir=tmp_path / "run", save_config=tl.SaveConfig(save_interval=1), backends=["local"],
                   rules=[R.NonFiniteGradient(action="raise")])
    hook.register_module(model)
    with pytest.raises(R.RuleEvaluationConditionMet) as raised:
        diverge(hook, model)
    hook.close()
    assert raised.value.rule_name == "NonFiniteGradient" and raised.value.finding in hook.findings()


def test_without_rules_and_with_a_wrong_one(tmp_path: Any) -> None:
    hook = tl.Hook(out_dir=tmp_path / "none", backends=["local"])
    assert not hook.should_stop and hook.findings() == [] and not hook.take_rule_actions()
    hook.close()
    with pytest.raises(ValueError, match="Expected `rules`"):
        tl.Hook(out_dir=tmp_path / "bad", backends=["local"], rules=["VanishingGradient"])
