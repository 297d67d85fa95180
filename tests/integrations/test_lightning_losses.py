"""The Lightning callback records the loss and names its run after the user's (issue 25, items 3
and 4), with a real Trainer, a real offline W&B run (read back from its run file) and MLflow on
SQLite (read back with its client).

What is checked: ``losses/loss`` holds the loss ``training_step`` returns at the steps the
loggers got ``train_loss`` at, and the validation loss the module logs at the step they got
``val_loss`` at; ``WandbLogger(name=...)`` and ``MLFlowLogger(run_name=...)`` name the run (a
second run of the same name goes to ``<name>-2``), their ids are in the metadata, and the
folder is ``callback.run_dir``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
from torch import nn

import tensorlens as tl

ns = pytest.importorskip("lightning.pytorch")
from tensorlens.integrations.lightning import TensorLensCallback  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
X = torch.linspace(-1.0, 1.0, 16 * 3).reshape(16, 3)
Y = torch.stack([X.sum(1), X[:, 0] - X[:, 2]], dim=1) + 0.1


class Tiny(ns.LightningModule):
    """An ``nn.Linear(3, 2)`` with an MSE loss that logs ``train_loss`` and ``val_loss`` and
    keeps every training loss it returns (the reference)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 2)
        self.returned: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("train_loss", loss)
        self.returned.append(float(loss))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(batches: int = 4) -> torch.utils.data.DataLoader:
    data = torch.utils.data.TensorDataset(X[: batches * 4], Y[: batches * 4])
    return torch.utils.data.DataLoader(data, batch_size=4)


def fit(tmp_path: Any, callback: TensorLensCallback, logger: Any, **kwargs: Any) -> Tiny:
    options: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_epochs=2, logger=logger, callbacks=[callback], enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path), num_sanity_val_steps=1,
        log_every_n_steps=1, limit_val_batches=2,
    )
    options.update(kwargs)
    model = Tiny()
    ns.Trainer(**options).fit(model, loader(), loader())
    return model


def test_wandb_logger_names_the_run_and_the_losses_match_wandb(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sys.path.insert(0, HERE)
    try:
        from wandb_runfile import read_run_dir
    finally:
        sys.path.remove(HERE)

    run_dirs, ids = [], []
    for attempt in range(2):  # the same name twice: the second run takes "healthy-2"
        save_dir = tmp_path / f"wandb{attempt}"
        save_dir.mkdir()
        callback = TensorLensCallback(save_interval=1)
        logger = ns.loggers.WandbLogger(name="healthy", project="tensorlens-names", save_dir=str(save_dir), offline=True)
        try:
            fit(tmp_path, callback, logger)
            ids.append(logger.experiment.id)
        finally:
            wandb.finish()
        run_dirs.append(callback.run_dir)
        assert callback.run_dir == callback.hook.run_dir  # the old path still works

    root = os.path.join(str(tmp_path), "tensorlens_runs")
    assert run_dirs == [os.path.join(root, "healthy"), os.path.join(root, "healthy-2")]
    run = tl.open_run(run_dirs[0])
    assert run.metadata()["trackers"]["wandb"] == {"run_name": "healthy", "run_id": ids[0]}
    assert tl.open_run(run_dirs[1]).metadata()["trackers"]["wandb"]["run_id"] == ids[1]

    history = read_run_dir(str(tmp_path / "wandb0"))
    # 4 optimizer steps per epoch, 2 epochs: the loss training_step returned, at the steps W&B has train_loss
    logged = history.series("train_loss", "trainer/global_step")
    stored = run.tensor("losses/loss").values()
    assert sorted(stored) == sorted(logged) == list(range(8))
    assert stored == pytest.approx(logged, rel=1e-6)  # W&B keeps the float32 value
    # the validation loss the module logged (Lightning's mean over the batches), at W&B's step:
    # in the eval record of each validation's last batch
    logged_val = history.series("val_loss", "trainer/global_step")
    assert sorted(logged_val) == [3, 7]
    eval_records = {k.mode_step: k.step for k in run.step_keys() if k.mode == tl.ModeKeys.EVAL}
    stored_val = {eval_records[mode_step]: value for mode_step, value in run.tensor("losses/loss").values(mode="eval").items()}
    assert stored_val == pytest.approx(logged_val, rel=1e-6)
    assert run.tensor_names("losses") == ["losses/loss"]  # train_loss, logged before the evaluations, is not taken for theirs

    # the readers of losses have something to read: the loss rules are evaluated, the report
    # plots the loss instead of saying none was recorded
    import tensorlens.rules as R

    assert not [str(n) for n in R.evaluate(run).not_evaluated if "Loss" in str(n)]
    tl.report(run_dirs[0], path=str(tmp_path / "report.html"))
    text = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "losses/loss" in text and "No loss" not in text


def test_mlflow_logger_names_the_run_and_the_losses_match_mlflow(tmp_path: Any) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logger = ns.loggers.MLFlowLogger(
        experiment_name="tensorlens-names", run_name="base", tracking_uri=uri, artifact_location=str(tmp_path / "artifacts")
    )
    callback = TensorLensCallback(save_interval=2)
    fit(tmp_path, callback, logger, max_epochs=1)

    assert callback.run_dir == os.path.join(str(tmp_path), "tensorlens_runs", "base")
    run = tl.open_run(callback.run_dir)
    assert run.metadata()["trackers"]["mlflow"] == {"run_name": "base", "run_id": logger.run_id}
    client = MlflowClient(tracking_uri=uri)
    logged = {m.step: m.value for m in client.get_metric_history(logger.run_id, "train_loss")}
    stored = run.tensor("losses/loss").values()
    assert sorted(stored) == [0, 2]  # the saved steps (save_interval=2)
    assert stored == pytest.approx({s: logged[s] for s in stored}, rel=1e-6)
    # the evaluation's loss is recorded although its last batch (eval step 1) is not a step
    # save_interval=2 saves: the losses collection saves every eval step
    [(val_step, val_loss)] = [(m.step, m.value) for m in client.get_metric_history(logger.run_id, "val_loss")]
    assert run.tensor("losses/loss").values(mode="eval") == pytest.approx({1: val_loss}, rel=1e-6)
    assert [k.step for k in run.step_keys() if k.mode == tl.ModeKeys.EVAL and k.mode_step == 1] == [val_step]
    assert "weights/layer.weight" not in {n.rsplit("/", 1)[0] for n in run.scalars(step=1, mode="eval")}


def test_an_explicit_run_name_wins_and_accumulated_losses_are_averaged(tmp_path: Any) -> None:
    callback = TensorLensCallback(save_interval=1, run_name="mine")
    logger = ns.loggers.TensorBoardLogger(str(tmp_path / "tb"), name="tb-name")
    model = fit(tmp_path, callback, logger, max_epochs=1, accumulate_grad_batches=2, limit_val_batches=0)

    assert callback.hook.run_name == "mine"
    assert callback.run_dir == os.path.join(os.path.abspath(logger.log_dir), "tensorlens")  # the logger's folder, as before
    # two optimizer steps of two micro-batches: the mean of what training_step returned (not
    # Lightning's loss divided by accumulate_grad_batches)
    stored = tl.open_run(callback.run_dir).tensor("losses/loss").values()
    r = model.returned
    assert stored == pytest.approx({0: (r[0] + r[1]) / 2, 1: (r[2] + r[3]) / 2}, rel=1e-6)


def test_a_tensorboard_logger_names_the_run_by_name_and_version(tmp_path: Any) -> None:
    callback = TensorLensCallback(save_interval=1)
    logger = ns.loggers.TensorBoardLogger(str(tmp_path / "tb"), name="exp", version=3)
    fit(tmp_path, callback, logger, max_epochs=1, limit_val_batches=0, limit_train_batches=1)
    assert callback.hook.run_name == "exp-3"
    assert tl.open_run(callback.run_dir).metadata()["trackers"] == {}
