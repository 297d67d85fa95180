"""Epoch aggregates (``hook.end_epoch()``): mean, min, max and std of chosen statistics across an
epoch's saved steps, against numpy over the very records the backends received; keyed by epoch in
the store; never colliding with train records."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens.backends.keys import tracker_key
from tensorlens.dispatch.epochs import DEFAULT_EPOCH_STATISTICS


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _train(hook: tl.Hook, model: nn.Module, epochs: list[int], criterion: nn.Module | None = None) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    for steps in epochs:
        for _ in range(steps):
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
            out = model(x)
            loss = criterion(out, torch.zeros_like(out)) if criterion is not None else out.square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
        hook.end_epoch()


def _aggregate(values: list[float]) -> dict[str, float]:
    v = np.array(values, dtype=np.float64)
    return {"mean": v.mean(), "min": v.min(), "max": v.max(), "std": v.std()}


def test_epoch_aggregates_equal_numpy_over_the_saved_steps(tmp_path: Any) -> None:
    model = _model()
    criterion = nn.MSELoss()
    mem = tl.MemoryBackend()
    hook = tl.watch(model, criterion, backends=[mem], out_dir=str(tmp_path / "r"), save_interval=2, dynamics=True)
    _train(hook, model, [5, 4, 3], criterion)  # steps 0-4, 5-8, 9-11: saved 0 2 4 | 6 8 | 10
    hook.close()
    train = [r for r in mem.records if str(r.mode) == "train"]
    epochs = [r for r in mem.records if str(r.mode) == "epoch"]
    assert [r.step for r in train] == [0, 2, 4, 6, 8, 10]
    assert [(r.mode_step, r.step) for r in epochs] == [(0, 5), (1, 9), (2, 12)]  # step: where the epoch ended
    groups = [[0, 2, 4], [6, 8], [10]]
    for epoch, steps in enumerate(groups):
        scalars = epochs[epoch].scalar_dict()
        records = [r for r in train if r.step in steps]
        for tensor, stat in (("gradients/0.weight", "l2"), ("weights/2.weight", "l2"), ("dynamics/0.weight", "update_ratio"),
                             ("dynamics/global", "grad_norm"), ("activations/1", "dead_fraction")):
            want = _aggregate([r.scalar(tensor, stat) for r in records])
            for aggregate, value in want.items():
                assert scalars[f"epochs/{tensor}/{stat}_{aggregate}"] == pytest.approx(value, rel=1e-12, abs=1e-15)
        loss = _aggregate([r.scalar("losses/mseloss") for r in records])
        for aggregate, value in loss.items():  # a plain value: mean, min, max, std
            assert scalars[f"epochs/losses/mseloss/{aggregate}"] == pytest.approx(value, rel=1e-12)
        # defaults: no mean/std of every tensor, no histograms
        assert "epochs/gradients/0.weight/mean_mean" not in scalars and not epochs[epoch].histograms
    # the grad cosine exists from step 2 on: epoch 0 aggregates the steps that have it
    assert epochs[0].scalar_dict()["epochs/dynamics/0.weight/grad_cosine_mean"] == pytest.approx(
        np.mean([r.scalar("dynamics/0.weight", "grad_cosine") for r in train[1:3]]), rel=1e-12)

    run = tl.open_run(hook.run_dir)
    view = run.tensor("epochs/gradients/0.weight")
    assert view.steps() == [0, 1, 2]  # epochs
    assert view.reduction_value(step=1, name="l2_mean") == pytest.approx(epochs[1].scalar("epochs/gradients/0.weight", "l2_mean"))
    assert view.reduction_values("l2_max") == {e.mode_step: e.scalar("epochs/gradients/0.weight", "l2_max") for e in epochs}
    assert run.steps() == [0, 2, 4, 6, 8, 10]  # train steps only: epoch records do not collide
    assert run.steps("epoch") == [0, 1, 2]
    assert run.tensor("gradients/0.weight").reduction_value(step=2, name="l2") == train[1].scalar("gradients/0.weight", "l2")
    assert [r.mode_step for r in run.records(mode="epoch")] == [0, 1, 2]
    # trackers: the mode part in the section, as for every mode but train (tensorlens.backends.keys)
    assert tracker_key("tensorlens", "epoch", "worker_0", "epochs/gradients/0.weight/l2_mean") == (
        "tensorlens-epoch-gradients/0.weight/l2_mean")


def test_chosen_statistics_and_empty_epochs(tmp_path: Any) -> None:
    model = _model()
    mem = tl.MemoryBackend()
    hook = tl.watch(model, backends=[mem], out_dir=str(tmp_path / "r"), save_interval=10,
                    epoch_statistics=["gradients/std", "max"])
    _train(hook, model, [3, 3, 3, 3])  # saved 0 | - | - | 10
    hook.end_epoch(epoch=7)  # an epoch given by the caller, with no saved step: no record
    hook.close()
    epochs = [r for r in mem.records if str(r.mode) == "epoch"]
    assert [r.mode_step for r in epochs] == [0, 3]  # epochs 1, 2 and 7 saved no step
    names = set(epochs[0].scalar_dict())
    assert "epochs/gradients/0.weight/std_mean" in names and "epochs/weights/0.weight/std_mean" not in names
    assert "epochs/weights/0.weight/max_max" in names and "epochs/gradients/0.weight/l2_mean" not in names
    train0 = [r for r in mem.records if str(r.mode) == "train"][0]
    assert epochs[0].scalar("epochs/gradients/0.weight", "std_std") == 0.0  # one step: no spread
    assert epochs[0].scalar("epochs/gradients/0.weight", "std_mean") == train0.scalar("gradients/0.weight", "std")


def test_nan_at_one_step_makes_the_epoch_nan_as_numpy_does(tmp_path: Any) -> None:
    mem = tl.MemoryBackend()
    hook = tl.Hook(out_dir=str(tmp_path / "r"), backends=[mem], save_config=tl.SaveConfig(save_interval=1),
                   include_collections=["scalars"])
    for value in (1.0, math.nan, 3.0):
        hook.save_scalar("x", value)
        hook.step()
    hook.end_epoch()
    hook.close()
    (epoch,) = [r for r in mem.records if str(r.mode) == "epoch"]
    assert math.isnan(epoch.scalar("epochs/scalars/x", "mean")) and math.isnan(epoch.scalar("epochs/scalars/x", "max"))


def test_epoch_numbers_continue_when_a_run_is_resumed_and_bad_input_fails(tmp_path: Any) -> None:
    out = str(tmp_path / "r")
    model = _model()
    hook = tl.watch(model, backends=["local"], out_dir=out, save_interval=1)
    _train(hook, model, [2, 2])
    hook.close()
    hook = tl.watch(model, backends=["local"], out_dir=out, save_interval=1, resume="allow")
    _train(hook, model, [2])
    with pytest.raises(ValueError, match="Expected `epoch`"):
        hook.end_epoch(epoch=-1)
    with pytest.raises(ValueError, match="Expected `mode`"):
        hook.set_mode("epoch")
    hook.close()
    assert tl.open_run(out).steps("epoch") == [0, 1, 2]
    with pytest.raises(ValueError, match="Expected `epoch_statistics`"):
        tl.watch(model, backends=[], out_dir=str(tmp_path / "x"), epoch_statistics=[3])  # type: ignore[list-item]
    assert "update_ratio" in DEFAULT_EPOCH_STATISTICS and "value" in DEFAULT_EPOCH_STATISTICS
