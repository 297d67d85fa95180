"""Runs named after the user's W&B or MLflow run (issue 25, item 4), through ``tl.watch``, with
a real offline W&B run and MLflow on SQLite; and the pieces that name them
(:mod:`tensorlens.engine.run_names`, the evaluation loss names of the callbacks)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens.engine.run_names import Naming, TrackerRun, named_after, run_name_from, tracker_metadata
from tensorlens.integrations._step_losses import eval_loss_name, returned_loss


def train_watched(**watch: Any) -> tl.Hook:
    torch.manual_seed(0)
    model, criterion = nn.Linear(3, 2), nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = tl.watch(model, criterion, save_interval=1, **watch)
    for _ in range(2):
        loss = criterion(model(torch.randn(4, 3)), torch.randn(4, 2))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    hook.close()
    return hook


def test_wandb_init_name_names_the_run(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    run = wandb.init(name="healthy", project="tensorlens-names", dir=str(tmp_path))
    try:
        first, second = train_watched(), train_watched()
        explicit = train_watched(run_name="mine")
    finally:
        wandb.finish()
    assert first.run_name == "healthy" and first.run_dir == os.path.abspath(os.path.join("tensorlens_runs", "healthy"))
    assert second.run_name == "healthy-2"  # the name is taken: the next free one, as for any derived name
    assert explicit.run_name == "mine"
    stored = tl.open_run(first.run_dir)
    assert stored.metadata()["trackers"] == {"wandb": {"run_name": "healthy", "run_id": run.id}}
    assert stored.tensor("losses/mseloss").steps() == [0, 1]


def test_mlflow_run_name_names_the_run(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    from mlflow.tracking._tracking_service import utils as tracking_utils

    previous = tracking_utils._tracking_uri  # restored after: later tests keep their own
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    # an experiment of this store (an experiment made active by an earlier test is not in it)
    experiment = mlflow.MlflowClient(uri).create_experiment("tensorlens-names", artifact_location=(tmp_path / "a").as_uri())
    try:
        with mlflow.start_run(run_name="base", experiment_id=experiment) as active:
            hook = train_watched(backends=["local"])  # named after the run even when not sending to it
    finally:
        mlflow.set_tracking_uri(previous)
    assert hook.run_name == "base"
    assert tl.open_run(hook.run_dir).metadata()["trackers"]["mlflow"] == {"run_name": "base", "run_id": active.info.run_id}


def test_without_a_tracker_run_the_name_is_the_time(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with named_after(Naming()):  # no runs: as if no tracker were active
        hook = train_watched()
    assert hook.run_name[:8].isdigit() and tl.open_run(hook.run_dir).metadata()["trackers"] == {}


def test_naming_prefers_a_named_run_and_keeps_the_ids_of_trackers_with_ids() -> None:
    runs = (TrackerRun("wandb", None, "w1"), TrackerRun("mlflow", "base", "m1"), TrackerRun("TensorBoardLogger", "exp-0", "0"))
    assert run_name_from(Naming(runs)) == "base"
    assert tracker_metadata(runs) == {"wandb": {"run_name": None, "run_id": "w1"}, "mlflow": {"run_name": "base", "run_id": "m1"}}


@pytest.mark.parametrize(("key", "name"), [
    ("val_loss", "loss"), ("val/loss", "loss"), ("loss/val", "loss"), ("test_loss", "loss"), ("eval_loss", "loss"),
    ("val_loss_epoch", "loss"), ("val_recon_loss", "recon_loss"), ("val_loss_step", None), ("val_acc", None),
])
def test_evaluation_loss_names(key: str, name: str | None) -> None:
    assert eval_loss_name(key) == name


def test_returned_loss() -> None:
    loss = torch.tensor(0.25)
    assert returned_loss(loss) is loss and returned_loss({"loss": loss, "acc": 1}) is loss
    assert returned_loss(None) is None and returned_loss(torch.ones(3)) is None and returned_loss({"acc": loss}) is None
