"""The default rule set on real training: it follows what a run recorded, a rule that had nothing
to read says "not evaluated" (once, not as a problem), every default rule stays quiet on three
healthy trainings (an MLP, a small transformer, a CNN; minibatches, so the loss is noisy), and a
dead-ReLU collapse is called DeadRelu, not an exploding tensor."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens import rules as R
from tensorlens.findings import HEALTH, NOT_EVALUATED

pytestmark = pytest.mark.filterwarnings("ignore::tensorlens.rules.RuleWarning")

Task = tuple[nn.Module, nn.Module, Callable[[], tuple[torch.Tensor, torch.Tensor]], torch.optim.Optimizer]


def mlp_task(lr: float = 3e-3, optimizer: type[torch.optim.Optimizer] = torch.optim.Adam) -> Task:
    """Regression of sin(x . w) with noise, minibatches of 16."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    w = torch.randn(8, 1, generator=generator)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 8, generator=generator)
        return x, torch.sin(x @ w) + 0.1 * torch.randn(16, 1, generator=generator)

    return model, nn.MSELoss(), batch, optimizer(model.parameters(), lr=lr)


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 32)
        layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def transformer_task() -> Task:
    """A 2-layer encoder tells sequences with more low tokens than high ones."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = TinyTransformer()

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 16, (16, 10), generator=generator)
        return tokens, ((tokens < 8).sum(1) > 5).long()

    return model, nn.CrossEntropyLoss(), batch, torch.optim.AdamW(model.parameters(), lr=1e-3)


def cnn_task() -> Task:
    """A small CNN finds the quadrant of a bright square in noisy 12x12 images."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, 4, (16,), generator=generator)
        images = 0.3 * torch.randn(16, 1, 12, 12, generator=generator)
        for i, quadrant in enumerate(labels.tolist()):
            row, col = divmod(quadrant, 2)
            images[i, 0, 6 * row + 1:6 * row + 5, 6 * col + 1:6 * col + 5] += 1.0
        return images, labels

    return model, nn.CrossEntropyLoss(), batch, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(task: Task, run_dir: str, steps: int = 100, with_loss: bool = True) -> tl.Hook:
    """``steps`` minibatch steps under tl.watch with activations, dynamics and the default rules
    online, saving every 5th step; returns the closed hook."""
    model, loss_fn, batch, opt = task
    hook = tl.watch(model, loss_fn if with_loss else None, save_interval=5, activations=True, dynamics=True,
                    backends=["local"], out_dir=run_dir, rules="default")
    for _ in range(steps):
        x, y = batch()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    hook.close()
    return hook


def names(rules: list[R.Rule]) -> list[str]:
    return [r.name for r in rules]


# ------------------------------------------------------------------------- the default set


def test_the_default_set_follows_the_recorded_kinds() -> None:
    base = ["ExplodingTensor", "NonFiniteGradient", "VanishingGradient", "GradientNormSpike", "LossNotDecreasing", "LossSpike"]
    assert names(R.default_rules()) == base
    assert names(R.default_rules(["weights", "gradients", "losses"])) == base
    assert names(R.default_rules(["activations"])) == [*base, "DeadRelu"]
    assert names(R.default_rules(["dynamics", "updates"])) == [*base, "UpdateRatioOutOfRange"]
    assert names(R.default_rules(tl.Options(include_collections=["weights", "activations"]))) == [*base, "DeadRelu"]
    with pytest.raises(TypeError, match="Expected a run, a run folder"):
        R.default_rules(3)


HEALTHY = {"mlp": mlp_task, "transformer": transformer_task, "cnn": cnn_task}


@pytest.fixture(scope="module", params=sorted(HEALTHY))
def healthy_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, tl.Hook]:
    run_dir = str(tmp_path_factory.mktemp("healthy") / request.param)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only contend
    try:
        return request.param, train(HEALTHY[request.param](), run_dir)
    finally:
        torch.set_num_threads(threads)


def test_no_default_rule_fires_on_a_healthy_run(healthy_run: tuple[str, tl.Hook]) -> None:
    name, hook = healthy_run
    losses = list(tl.open_run(hook.run_dir).tensor(f"losses/{'mseloss' if name == 'mlp' else 'crossentropyloss'}").values().values())
    assert len(losses) == 20 and losses[-1] < losses[0], losses  # it trained
    health = R.evaluate(hook.run_dir)
    # activations and dynamics were recorded: DeadRelu and the update ratio joined the defaults
    assert names(health.rules) == names(R.default_rules(["activations", "dynamics"]))
    assert health.findings == [] and health.healthy, [str(f) for f in health.findings]
    assert health.not_evaluated == [], [str(f) for f in health.not_evaluated]  # every rule read what it needs
    assert hook.findings() == [] and tl.open_run(hook.run_dir).findings() == []  # online, the same rules, the same verdict


def test_a_dead_relu_collapse_is_dead_relu_not_an_exploding_tensor(tmp_path: Any) -> None:
    """Adam at lr 1.5: the loss jumps by thousands and the ReLUs of the second layer die, with no
    NaN or Inf anywhere (the 0/0 ratios of dead units are left out, not recorded as NaN)."""
    hook = train(mlp_task(lr=1.5), str(tmp_path / "collapse"), steps=60)
    health = R.evaluate(hook.run_dir)
    fired = {f.rule for f in health.findings}
    assert "DeadRelu" in fired, [str(f) for f in health.findings]
    assert not fired & {"ExplodingTensor", "NonFiniteGradient"}, [str(f) for f in health.findings]
    dead = [f for f in health.findings if f.rule == "DeadRelu"]
    assert all(f.tensor.startswith("activations/") and f.value > 50.0 for f in dead)
    assert {f.rule for f in hook.findings()} == fired  # online agrees


# --------------------------------------------------------------------------- not evaluated


def test_a_rule_with_nothing_to_read_says_not_evaluated_once(tmp_path: Any) -> None:
    click_testing = pytest.importorskip("click.testing")
    from tensorlens.cli import rules as rules_cli

    hook = train(mlp_task(), str(tmp_path / "no-loss"), steps=20, with_loss=False)
    health = R.evaluate(hook.run_dir)
    assert health.findings == [] and health.healthy
    assert [(n.rule, n.kind, n.tensor, n.step) for n in health.not_evaluated] == [
        ("LossNotDecreasing", NOT_EVALUATED, None, 15), ("LossSpike", NOT_EVALUATED, None, 15)]
    assert all(n.message.startswith("no loss was recorded (pass the loss function: tl.watch(model, loss_fn)")
               and not n.evaluated for n in health.not_evaluated)
    assert str(health.not_evaluated[0]).startswith("[LossNotDecreasing] not evaluated: no loss was recorded")
    # online: the runner's notes, never findings: no action, not in the store, not sent to trackers
    assert hook.findings() == [] and tl.open_run(hook.run_dir).findings() == []
    assert [(n.rule, n.message) for n in hook._rules.not_evaluated()] == [(n.rule, n.message) for n in health.not_evaluated]
    # the CLI shows them, and they are not problems: --check exits with 0
    result = click_testing.CliRunner().invoke(rules_cli.command, [hook.run_dir, "--check"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "LossSpike: not evaluated: " + health.not_evaluated[1].message in lines
    assert "DeadRelu: no finding" in lines and "UpdateRatioOutOfRange: no finding" in lines
    # a rule named on the command line that had nothing to read says so too
    result = click_testing.CliRunner().invoke(rules_cli.command, [hook.run_dir, "--rule", "Overtraining"])
    assert result.output.startswith("Overtraining: not evaluated: no loss was recorded"), result.output


def test_a_finding_kind_is_checked_and_old_findings_are_health() -> None:
    assert R.Finding("R", 1, "train", None, "m").kind == HEALTH
    with pytest.raises(ValueError, match="Expected `kind` to be one of"):
        R.Finding("R", 1, "train", None, "m", kind="note")


def test_one_rule_instance_learns_anew_on_each_run(tmp_path: Any) -> None:
    with_loss = train(mlp_task(), str(tmp_path / "loss"), steps=10).run_dir
    without = train(mlp_task(), str(tmp_path / "none"), steps=10, with_loss=False).run_dir
    rule = R.LossSpike()
    assert R.invoke(with_loss, rule) == [] and rule.evaluated and rule.not_evaluated() is None
    assert R.invoke(without, rule) == [] and not rule.evaluated  # invoke restarts it: nothing read in this run
    assert rule.not_evaluated().kind == NOT_EVALUATED
    # a loss rule reads plain scalars: statistics of a tensor are none
    assert names(R.evaluate(with_loss, R.LossSpike(tensor_regex="dynamics/global", use_losses_collection=False)).rules) == ["LossSpike"]
    assert R.evaluate(with_loss, R.LossSpike(tensor_regex="dynamics/global", use_losses_collection=False)).not_evaluated


def test_online_default_rules_without_metadata_choose_from_the_first_record(tmp_path: Any) -> None:
    runner = R.RuleRunner("default")
    assert runner.rules == []
    model, loss_fn, batch, opt = mlp_task()
    hook = tl.Hook(out_dir=str(tmp_path / "run"), save_config=tl.SaveConfig(save_interval=1), backends=[runner],
                   include_collections=["weights", "gradients", "losses", "activations"])
    hook.register_module(model).register_loss(loss_fn)
    for _ in range(3):
        x, y = batch()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    hook.close()
    assert names(runner.rules) == names(R.default_rules(["activations"]))
    assert runner.not_evaluated() == []
    with pytest.raises(ValueError, match="or 'default'"):
        R.RuleRunner("defaults")


def test_the_store_keeps_working_for_runs_without_the_default_rules(tmp_path: Any) -> None:
    """A run recorded without rules online is still checked by the defaults offline."""
    model, loss_fn, batch, opt = mlp_task()
    hook = tl.watch(model, loss_fn, save_interval=2, backends=["local"], out_dir=str(tmp_path / "plain"))
    for _ in range(8):
        x, y = batch()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    hook.close()
    assert os.path.isdir(hook.run_dir) and hook.findings() == []
    health = R.evaluate(hook.run_dir)
    assert names(health.rules) == names(R.default_rules()) and health.findings == [] and health.not_evaluated == []
