"""Training dynamics in a real (offline) W&B run with the default payload: the global dynamics under
``tensorlens/dynamics/global/...``, the update ratio of every layer as one chart (not one series per
tensor), and the epoch aggregates of the global values, read back from the run file."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import tensorlens as tl

wandb = pytest.importorskip("wandb")

from tensorlens.integrations.wandb import PROFILE_COLUMNS, WandbBackend  # noqa: E402

try:  # tests/integrations may or may not be a package
    from .wandb_runfile import read_run_dir
except ImportError:
    from wandb_runfile import read_run_dir


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield
    if wandb.run is not None:
        wandb.finish()


def test_update_ratio_profile_and_epochs_in_wandb(tmp_path: Any) -> None:
    wandb.init(dir=str(tmp_path), project="tensorlens-tests")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    hook = tl.watch(model, save_interval=2, out_dir=tmp_path / "tl", dynamics=True)  # backends="auto": local + wandb
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch_steps in (3, 2):
        for _ in range(epoch_steps):
            model(torch.randn(5, 6)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        hook.end_epoch()
    hook.close()
    wandb.finish()

    run_file = read_run_dir(str(tmp_path))
    stored = tl.open_run(hook.run_dir)
    rows = {row["tensorlens/step"]: row for row in run_file.history if "tensorlens/dynamics/global/grad_norm" in row}
    assert sorted(rows) == [0, 2, 4]
    for step, row in rows.items():
        assert row["tensorlens/dynamics/global/grad_norm"] == stored.tensor("dynamics/global").reduction_value(step, "grad_norm")
        # per-tensor dynamics are in the store and in the per-layer panels, not series of their own
        assert not any(k.startswith("tensorlens-dynamics/0.weight/") for k in row)
        assert stored.tensor("dynamics/0.weight").reduction_value(step, "update_ratio") is not None
        # a parameter's histogram: at the first saved step of every 100 train steps (tracker_histogram_interval)
        assert ("tensorlens-gradients/0.weight/histogram" in row) == (step == 0)
        assert "tensorlens-activations/1/unit_active_rate/histogram" not in row  # its per-sample part: stored only

    # the update ratio by layer depth: one line per saved step, every parameter a point
    tables = [row["tensorlens-dynamics/per-layer/update_ratio_table"] for row in run_file.history
              if "tensorlens-dynamics/per-layer/update_ratio_table" in row]
    profile = run_file.table(tables[-1])
    assert profile["columns"] == list(PROFILE_COLUMNS)
    names = [name for name, _ in model.named_parameters()]
    expected = [[step, depth, name, stored.tensor(f"dynamics/{name}").reduction_value(step, "update_ratio")]
                for step in (0, 2, 4) for depth, name in enumerate(names)]
    assert profile["data"] == expected
    assert "tensorlens-dynamics/per-layer/update_ratio" in run_file.config["_wandb"]["visualize"]

    # epoch records: keyed tensorlens-epoch/..., at the step the epoch ended, with the epoch
    epochs = [row for row in run_file.history if "tensorlens-epoch/dynamics/global/grad_norm_mean" in row]
    assert [(row["tensorlens/step"], row["tensorlens-epoch/step"]) for row in epochs] == [(3, 0), (5, 1)]
    assert not any(k.startswith("tensorlens-epoch-") for row in epochs for k in row)  # per-tensor: stored only
    assert epochs[1]["tensorlens-epoch/dynamics/global/grad_norm_mean"] == (
        stored.tensor("epochs/dynamics/global").reduction_value(step=1, name="grad_norm_mean"))
    stored.close()


def test_profiles_are_checked() -> None:
    assert WandbBackend(profile=("gradients", "l2")).profiles == (("gradients", "l2"),)
    assert WandbBackend(profile=[("dynamics", "update_ratio"), ("dynamics", "grad_to_weight")]).profiles == (
        ("dynamics", "update_ratio"), ("dynamics", "grad_to_weight"))
    assert WandbBackend(profile=None).profiles == ()
    with pytest.raises(ValueError, match="Expected `profile`"):
        WandbBackend(profile=[("gradients",)])
