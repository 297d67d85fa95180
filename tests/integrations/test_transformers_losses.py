"""The Hugging Face callback records the loss the Trainer logs and names its run after
``TrainingArguments.run_name`` (issue 25, items 3 and 4), with a real Trainer on a tiny GPT-2
built from a config (no downloads), read back against the Trainer's own ``log_history``.
(The loss against W&B, MLflow and TensorBoard: tests/integrations/test_transformers.py.)
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import tensorlens as tl

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from tensorlens.integrations.transformers import TensorLensCallback  # noqa: E402

try:
    from .tiny_tokens import Tokens
except ImportError:
    from tiny_tokens import Tokens

VOCAB, SEQ = 50, 8



def train(tmp_path: Any, callback: TensorLensCallback, run_name: str | None, logging_steps: int = 1,
          report_to: Any = "none") -> Trainer:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=SEQ))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), run_name=run_name, per_device_train_batch_size=4, max_steps=4,
        eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4, logging_steps=logging_steps,
        learning_rate=1e-3, report_to=report_to, use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(16, 1, VOCAB, SEQ), eval_dataset=Tokens(8, 2, VOCAB, SEQ), callbacks=[callback])
    trainer.train()
    return trainer


def test_the_logged_loss_at_the_trainers_steps_and_the_run_named_after_run_name(tmp_path: Any) -> None:
    callback = TensorLensCallback(save_interval=1)
    trainer = train(tmp_path, callback, "tiny-gpt")

    assert callback.run_dir == os.path.join(str(tmp_path / "out"), "tensorlens_runs", "tiny-gpt")
    assert callback.run_dir == callback.recorder.run_dir and callback.recorder.run_name == "tiny-gpt"
    run = tl.open_run(callback.run_dir)
    logged = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    assert sorted(logged) == [1, 2, 3, 4]
    assert run.tensor("losses/loss").values() == pytest.approx(logged, rel=1e-12)
    # eval_loss of the evaluations after steps 2 and 4, in each one's last eval record (2 batches each)
    logged_eval = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    eval_steps = {k.mode_step: k.step for k in run.step_keys() if k.mode == tl.ModeKeys.EVAL}
    stored_eval = run.tensor("losses/loss").values(mode="eval")
    assert sorted(stored_eval) == [1, 3]
    assert {eval_steps[s]: v for s, v in stored_eval.items()} == pytest.approx(logged_eval, rel=1e-12)
    assert run.metadata()["trackers"] == {}  # report_to none: no tracker run
    import tensorlens.rules as R

    assert not [str(n) for n in R.evaluate(run).not_evaluated if "Loss" in str(n)]  # the loss rules have a loss

    # a second run of the same name goes to its own folder
    second = TensorLensCallback(save_interval=1)
    train(tmp_path, second, "tiny-gpt")
    assert os.path.basename(second.run_dir) == "tiny-gpt-2"


def test_losses_only_on_the_steps_the_trainer_logs_and_an_explicit_name_wins(tmp_path: Any) -> None:
    callback = TensorLensCallback(save_interval=2, run_name="mine")
    trainer = train(tmp_path, callback, "ignored", logging_steps=2)
    assert callback.recorder.run_name == "mine"
    run = tl.open_run(callback.run_dir)
    logged = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    assert sorted(logged) == [2, 4]  # each the mean over the 2 steps since the last log
    assert run.tensor("losses/loss").values() == pytest.approx(logged, rel=1e-12)
    assert run.steps("train") == [2, 4]
    # every evaluation's loss, although save_interval=2 saves neither's last batch (eval steps 1, 3)
    logged_eval = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    assert run.tensor("losses/loss").values(mode="eval") == pytest.approx(dict(zip([1, 3], logged_eval, strict=True)), rel=1e-12)


def test_report_to_wandb_and_mlflow_the_ids_in_the_metadata(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    import sys

    from mlflow.tracking._tracking_service import utils as tracking_utils

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    try:
        from wandb_runfile import read_run_dir
    finally:
        sys.path.remove(here)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "tensorlens-hf-names")
    previous = tracking_utils._tracking_uri
    mlflow.set_tracking_uri(uri)  # the MLflowCallback keeps a URI set earlier in the process
    mlflow.MlflowClient(uri).create_experiment("tensorlens-hf-names", artifact_location=(tmp_path / "artifacts").as_uri())
    wandb.init(dir=str(tmp_path), project="tensorlens-hf-names")  # the run WandbCallback finds (WANDB_DIR is read once)
    try:
        callback = TensorLensCallback(save_interval=1)
        trainer = train(tmp_path, callback, "tiny-gpt", report_to=["wandb", "mlflow"])
        wandb_id = wandb.run.id
    finally:
        wandb.finish()
        mlflow.set_tracking_uri(previous)

    assert callback.recorder.run_name == "tiny-gpt"  # TrainingArguments.run_name, as MLflow's run is named
    client = mlflow.MlflowClient(uri)
    [mlflow_run] = client.search_runs([client.get_experiment_by_name("tensorlens-hf-names").experiment_id])
    assert mlflow_run.info.run_name == "tiny-gpt"
    run = tl.open_run(callback.run_dir)
    trackers = run.metadata()["trackers"]
    assert trackers["mlflow"] == {"run_name": "tiny-gpt", "run_id": mlflow_run.info.run_id}
    assert trackers["wandb"]["run_id"] == wandb_id
    # the stored loss is what both trackers got, at the same steps
    stored = run.tensor("losses/loss").values()
    assert stored == pytest.approx(read_run_dir(str(tmp_path)).series("train/loss", "train/global_step"), rel=1e-12)
    assert stored == pytest.approx({m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, "loss")}, rel=1e-12)
    assert sorted(stored) == [1, 2, 3, 4] and trainer.state.global_step == 4
