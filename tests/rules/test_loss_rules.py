"""LossNotDecreasing (window means, SageMaker's parameters, a rise judged against the loss's own
noise) and LossSpike (robust z-score over a trailing window), each checked against a numpy
reference on loss series recorded by a real Hook, online and offline."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens import rules as R

pytestmark = pytest.mark.filterwarnings("ignore::tensorlens.rules.RuleWarning")


class Given(nn.Module):
    """A loss module that returns the value it is given: the series is recorded as it is."""

    def forward(self, value: torch.Tensor) -> torch.Tensor:
        return value


def record(tmp_path: Any, values: list[float], rules: list[R.Rule]) -> tuple[str, list[R.Finding]]:
    """Record ``values`` as the loss of consecutive optimizer steps (every step saved), with
    ``rules`` online; returns the run folder and the online findings."""
    model, given = nn.Linear(1, 1), Given()
    runner = R.RuleRunner(rules)
    hook = tl.Hook(out_dir=str(tmp_path / "run"), save_config=tl.SaveConfig(save_interval=1), backends=[runner],
                   include_collections=["losses"])
    hook.register_module(model).register_loss(given)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for value in values:
        opt.zero_grad()
        given(torch.tensor(value, dtype=torch.float32) + 0.0 * model.weight.sum()).backward()
        opt.step()
    hook.close()
    return hook.run_dir, runner.findings()


def f32(values: np.ndarray) -> list[float]:
    """The values as the store holds them (the loss is a float32 tensor)."""
    return np.asarray(values, dtype=np.float32).astype(np.float64).tolist()


# ------------------------------------------------------------------------ LossNotDecreasing


def not_decreasing_reference(values: list[float], num_steps: int = 10, diff_percent: float = 0.1,
                             increase_threshold_percent: float = 5.0, noise_tolerance: float = 4.0) -> list[tuple[int, str]]:
    """``(step, "flat" | "rise")`` per firing, from the rule's documented definition."""
    v = np.asarray(values, dtype=np.float64)
    out = []
    for step in range(len(v)):
        k = step // num_steps
        if step % num_steps or k < 2:
            continue  # comparisons happen at the first loss of a window, from the third window on
        before, now = v[(k - 2) * num_steps:(k - 1) * num_steps], v[(k - 1) * num_steps:k * num_steps]
        decrease = 100.0 * (before.mean() - now.mean()) / abs(before.mean())
        changes = np.diff(v[:step + 1])[-32:]
        noise = 1.4826 * np.median(np.abs(changes - np.median(changes))) / math.sqrt(2.0)
        error = noise * math.sqrt(1.0 / len(now) + 1.0 / len(before)) if step >= 5 else None
        if 0.0 <= decrease < diff_percent:
            if noise_tolerance == 0 or error is None or noise_tolerance * error < diff_percent / 100 * abs(before.mean()):
                out.append((step, "flat"))
        elif -decrease > increase_threshold_percent and (noise_tolerance == 0 or error is not None):
            if noise_tolerance == 0 or now.mean() - before.mean() > noise_tolerance * error:
                out.append((step, "rise"))
    return out


def test_loss_not_decreasing_matches_the_reference(tmp_path: Any) -> None:
    rng = np.random.default_rng(0)
    noisy = 2.0 * np.exp(-np.arange(60) / 15.0) + 0.5 + 0.15 * rng.standard_normal(60)  # learning, noisy batches
    stuck = np.full(40, 0.5)  # lr 0: the same loss every step
    jumped = np.full(30, 1.5) + 0.01 * rng.standard_normal(30)  # a rise far beyond the noise
    values = f32(np.concatenate([noisy, stuck, jumped]))
    run_dir, online = record(tmp_path, values, [R.LossNotDecreasing()])
    expected = not_decreasing_reference(values)
    assert [s for s, _ in expected] == [80, 90, 100, 110]  # the series does what it was built for
    offline = R.invoke(run_dir, R.LossNotDecreasing())
    assert [(f.step, "flat" if "decreased by only" in f.message else "rise") for f in offline] == expected
    assert [(f.step, f.message) for f in online] == [(f.step, f.message) for f in offline]
    assert offline[0].tensor == "losses/given" and "steps 60-69, 10 values" in offline[0].message
    assert offline[-1].value == pytest.approx(np.mean(values[100:110]))


def test_a_noisy_healthy_loss_is_quiet_but_not_without_the_noise_tolerance(tmp_path: Any) -> None:
    """Batch-to-batch noise of +-30 % around a slowly falling loss: SageMaker's plain comparison of
    means (noise_tolerance=0) fires on it, the default does not."""
    rng = np.random.default_rng(1)
    values = f32((1.0 - 0.002 * np.arange(200)) * np.exp(0.3 * rng.standard_normal(200)))
    run_dir, online = record(tmp_path, values, [R.LossNotDecreasing()])
    assert online == [] and R.invoke(run_dir, R.LossNotDecreasing()) == []
    plain = R.invoke(run_dir, R.LossNotDecreasing(noise_tolerance=0))
    assert plain and [f.step for f in plain] == [s for s, _ in not_decreasing_reference(values, noise_tolerance=0)]


def test_loss_not_decreasing_sparse_saves_compare_single_losses_as_sagemaker(tmp_path: Any) -> None:
    """With num_steps below the save interval each window holds one loss: SageMaker's comparison."""
    values = f32(np.array([1.0, 0.9, 0.9, 0.8]))
    run_dir, _ = record(tmp_path, values, [])
    found = R.invoke(run_dir, R.LossNotDecreasing(num_steps=1))
    assert [f.step for f in found] == [3] and "decreased by only 0%" in found[0].message  # 0.9 -> 0.9, seen at step 3


def test_loss_not_decreasing_keeps_sagemakers_parameters() -> None:
    rule = R.create_rule("LossNotDecreasing", num_steps="20", diff_percent="0.5", increase_threshold_percent="10",
                         mode="TRAIN", use_losses_collection="False", tensor_regex="loss")
    assert (rule.num_steps, rule.diff_percent, rule.increase_threshold_percent, rule.mode) == (20, 0.5, 10.0, tl.ModeKeys.TRAIN)
    assert R.LossNotDecreasing().num_steps == 10 and R.LossNotDecreasing().diff_percent == 0.1
    assert R.LossNotDecreasing().increase_threshold_percent == 5.0


# --------------------------------------------------------------------------------- LossSpike


def spike_reference(values: list[float], window: int = 20, min_history: int = 5, threshold: float = 6.0,
                    factor: float = 2.0) -> list[int]:
    """The steps LossSpike fires at, from its documented definition."""
    history: list[float] = []
    spiking, out = False, []
    for step, x in enumerate(values):
        if not math.isfinite(x):
            spike = True
        elif len(history) >= min_history:
            h = np.asarray(history[-window:])
            median = np.median(h)
            scale = 1.4826 * np.median(np.abs(h - median))
            z = (x - median) / scale if scale > 0 else (math.inf if x > median else 0.0)
            spike = bool(z > threshold and x > factor * median)
        else:
            spike = False
        if spike and not spiking:
            out.append(step)
        spiking = spike
        if math.isfinite(x):
            history.append(x)
    return out


def test_loss_spike_matches_the_reference(tmp_path: Any) -> None:
    rng = np.random.default_rng(2)
    values = f32(np.exp(0.2 * rng.standard_normal(120)))  # a noisy loss around 1
    values[50] = values[51] = 12.0  # one spike over two steps: one finding
    values[70], values[71] = math.nan, math.inf  # the loss stops being finite
    values[90] = 30.0
    values[100] = 1.6  # far above the median for this noise, but not twice it: no spike
    run_dir, online = record(tmp_path, values, [R.LossSpike()])
    expected = spike_reference(values)
    assert expected == [50, 70, 90]
    offline = R.invoke(run_dir, R.LossSpike())
    assert [f.step for f in offline] == expected and [(f.step, f.message) for f in online] == [(f.step, f.message) for f in offline]
    assert "robust standard deviations above the median" in offline[0].message and offline[0].value == 12.0
    assert offline[1].message.startswith("loss is nan") and math.isnan(offline[1].value)


def test_loss_spike_needs_history_and_checks_its_parameters(tmp_path: Any) -> None:
    values = f32(np.array([1.0, 1.0, 1.0, 1.0, 50.0, 1.0, 1.0, 1.0, 1.0, 1.0, 50.0]))
    run_dir, _ = record(tmp_path, values, [])
    assert [f.step for f in R.invoke(run_dir, R.LossSpike())] == [10]  # 4 values before step 4: too few
    assert [f.step for f in R.invoke(run_dir, R.LossSpike(min_history=2))] == [4, 10]
    with pytest.raises(ValueError, match="min_history"):
        R.LossSpike(window=5, min_history=6)
    with pytest.raises(ValueError, match="factor"):
        R.LossSpike(factor=0.5)
