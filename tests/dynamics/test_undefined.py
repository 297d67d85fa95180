"""Undefined derived statistics (0/0) on real training: a dead layer (zero weight, zero gradient,
zero update) records no NaN, leaves the undefined statistics out of the step's record and counts
them in ``dynamics/global`` / ``undefined_count`` (checked against a numpy reference of the same
training); a real NaN gradient still gives NaN; the default rules, online and offline
(``tensorlens rules RUN``), find nothing tensorlens made up."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens import rules as R
from tensorlens.rules.builtin import BUILTIN_RULES, DEFAULT_RULES

pytestmark = pytest.mark.filterwarnings("ignore::tensorlens.rules.RuleWarning")

STEPS, LR = 4, 0.05
RATIOS = {"update_ratio": ("update", "weight"), "grad_to_weight": ("grad", "weight")}
COSINES = {"grad_cosine": "grad", "update_cosine": "update"}


def dead_layer_model() -> nn.Sequential:
    """fc1's ReLUs never fire (bias -100): fc1's gradient is zero; fc2's weight is zero and its
    input is zero, so its gradient and update are zero too (0/0 for both ratios and cosines)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
        model[2].weight.zero_()
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(10, 6, generator=g, dtype=torch.float64), torch.randn(10, 3, generator=g, dtype=torch.float64)


def train(model: nn.Module, steps: int = STEPS, poison: int | None = None) -> list[dict[str, dict[str, np.ndarray]]]:
    """Train with SGD; per step, numpy copies of each parameter's weight, gradient and update
    (the reference). ``poison``: at that step one gradient value of ``2.weight`` becomes NaN."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    seen = []
    for step in range(steps):
        x, y = _batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        if poison == step:
            model[4].weight.grad[0, 0] = math.nan
        before = {n: (p.detach().numpy().copy(), p.grad.numpy().copy()) for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        seen.append({n: {"weight": w, "grad": g, "update": p.detach().numpy() - w}
                     for (n, (w, g)), p in zip(before.items(), model.parameters(), strict=True)})
    return seen


def undefined_reference(seen: list[dict[str, dict[str, np.ndarray]]], step: int) -> int:
    """How many of the step's derived statistics are 0/0, from numpy (per parameter and global)."""
    now, prev = seen[step], seen[step - 1] if step else None
    norm = {n: {k: float(np.linalg.norm(v)) for k, v in d.items()} for n, d in now.items()}
    count = sum(norm[n][a] == 0 and norm[n][b] == 0 for n in now for a, b in RATIOS.values())
    if prev is not None:
        count += sum(norm[n][k] == 0 or np.linalg.norm(prev[n][k]) == 0 for n in now for k in COSINES.values())
        for k in COSINES.values():  # the global cosines: all parameters as one vector
            count += np.linalg.norm(np.concatenate([d[k].ravel() for d in now.values()])) == 0 or \
                np.linalg.norm(np.concatenate([d[k].ravel() for d in prev.values()])) == 0
    return int(count)


def watch(model: nn.Module, tmp_path: Any) -> tuple[tl.Hook, tl.MemoryBackend, R.RuleRunner]:
    mem, runner = tl.MemoryBackend(), R.RuleRunner([BUILTIN_RULES[n]() for n in DEFAULT_RULES])
    hook = tl.watch(model, backends=[mem, runner], out_dir=str(tmp_path / "run"), save_interval=1, dynamics=True)
    return hook, mem, runner


def test_a_dead_layer_records_no_nan_and_counts_what_is_undefined(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    model = dead_layer_model()
    hook, mem, runner = watch(model, tmp_path)
    seen = train(model)
    hook.end_epoch()
    hook.close()
    train_records = [r for r in mem.records if r.mode == tl.ModeKeys.TRAIN]
    assert len(train_records) == STEPS
    for step, record in enumerate(train_records):
        s = record.scalar_dict()
        dynamics = {k: v for k, v in s.items() if k.startswith(("dynamics/", "activations/"))}
        assert not [k for k, v in dynamics.items() if math.isnan(v) or math.isinf(v)], step
        assert s["dynamics/global/undefined_count"] == undefined_reference(seen, step)
        assert s["dynamics/global/nan_count"] == 0.0
        # the dead, zero layer: its defined statistics are there, its undefined ones are not
        assert s["dynamics/2.weight/update_l2"] == 0.0 and s["dynamics/2.weight/nan_count"] == 0.0
        assert "dynamics/2.weight/update_ratio" not in s and "dynamics/2.weight/grad_to_weight" not in s
        # fc1: a zero gradient and update of a nonzero weight are ratios of 0, exactly
        assert s["dynamics/0.weight/update_ratio"] == 0.0 and s["dynamics/0.weight/grad_to_weight"] == 0.0
        if step:
            assert "dynamics/0.weight/grad_cosine" not in s and "dynamics/2.weight/update_cosine" not in s
            w = seen[step]["4.weight"]
            want = float(np.dot(w["grad"].ravel(), seen[step - 1]["4.weight"]["grad"].ravel())
                         / (np.linalg.norm(w["grad"]) * np.linalg.norm(seen[step - 1]["4.weight"]["grad"])))
            assert s["dynamics/4.weight/grad_cosine"] == pytest.approx(want, rel=1e-12)
    assert undefined_reference(seen, 1) == 8  # 0.weight, 0.bias: their two cosines; 2.weight: all four
    assert [r for r in mem.records if r.mode == tl.ModeKeys.TRAIN][0].scalar_dict()["activations/1/dead_fraction"] == 1.0
    # no rule fires on a value tensorlens made up: no finding reads a dynamics statistic
    found = runner.findings()
    assert not [f for f in found if f.rule in ("ExplodingTensor", "NonFiniteGradient")], [str(f) for f in found]
    assert not [f for f in found if f.tensor and f.tensor.startswith("dynamics/")]
    # what the defaults do find is true: VanishingGradient on the gradients that really are all zero
    assert found and all(f.rule == "VanishingGradient" for f in found)
    assert all(not seen[f.step][f.tensor.removeprefix("gradients/")]["grad"].any() for f in found)
    # the same offline, through the CLI's entry point
    from tensorlens.cli.group import run as cli

    offline = R.invoke(hook.run_dir, [BUILTIN_RULES[n]() for n in DEFAULT_RULES])
    assert [str(f) for f in offline] == [str(f) for f in found]
    assert not [f for f in offline if f.rule == "ExplodingTensor"]
    capsys.readouterr()
    cli(["rules", hook.run_dir])  # the default rules
    out = capsys.readouterr().out
    assert "ExplodingTensor: no finding" in out and "NonFiniteGradient: no finding" in out, out
    # the store holds the count; the epoch aggregates see only the steps where a value was defined
    run = tl.open_run(hook.run_dir)
    assert run.tensor("dynamics/global").reduction_value(step=1, name="undefined_count") == undefined_reference(seen, 1)
    (epoch,) = [r for r in mem.records if r.mode == tl.ModeKeys.EPOCH]
    e = epoch.scalar_dict()
    cosines = [r.scalar_dict()["dynamics/4.weight/grad_cosine"] for r in train_records[1:]]  # step 0 has none
    assert e["epochs/dynamics/4.weight/grad_cosine_mean"] == pytest.approx(float(np.mean(cosines)), rel=1e-12)
    assert not [k for k in e if k.startswith(("epochs/dynamics/2.weight/update_ratio", "epochs/dynamics/0.weight/grad_cosine"))]
    assert not [k for k, v in e.items() if math.isnan(v)]


def test_a_real_nan_gradient_still_gives_nan_and_fires(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    hook, mem, runner = watch(model, tmp_path)
    train(model, steps=2, poison=1)
    hook.close()
    s = [r for r in mem.records if r.mode == tl.ModeKeys.TRAIN][1].scalar_dict()
    for stat in ("update_l2", "grad_to_weight", "grad_cosine", "update_ratio", "update_cosine"):
        assert math.isnan(s[f"dynamics/4.weight/{stat}"]), stat  # really not finite: NaN, recorded
    assert s["dynamics/4.weight/nan_count"] == 5.0
    assert math.isnan(s["dynamics/global/grad_norm"]) and math.isnan(s["dynamics/global/grad_cosine"])
    assert s["dynamics/global/undefined_count"] == 0.0
    assert s["dynamics/global/grad_nonfinite_count"] == 1.0
    assert any(f.rule == "ExplodingTensor" and f.tensor == "dynamics/4.weight" for f in runner.findings())
    from tensorlens.cli.group import run as cli

    capsys.readouterr()
    cli(["rules", hook.run_dir])
    assert "dynamics/4.weight: 5 NaN" in capsys.readouterr().out
