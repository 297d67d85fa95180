"""The Hugging Face ``Trainer`` callback with a real Trainer (CPU, a tiny GPT-2 built from a
config, no downloads), the trackers of ``report_to`` (W&B offline, MLflow on SQLite,
TensorBoard) read back from their own files, and DDP with two gloo processes.

The numbers are checked against plain torch hooks on the same model: gradient hooks give each
optimizer step's accumulated gradient before the Trainer clips it, and a TrainerCallback reads
the clipped one just before the optimizer steps.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
import torch

import tensorlens as tl

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from tensorlens.integrations.transformers import TensorLensCallback  # noqa: E402

try:
    from .tiny_tokens import Tokens
except ImportError:
    from tiny_tokens import Tokens

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
VOCAB, SEQ = 100, 16
MAX_GRAD_NORM = 0.5  # the tiny model's gradient norm is ~0.95: every step is clipped



def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ))


class Reference(TrainerCallback):
    """Independent captures: per optimizer step (numbered by the global step it reaches), the
    accumulated gradients before clipping (gradient hooks; the last micro-batch's write wins) and
    the gradients the optimizer uses (read in ``on_pre_optimizer_step``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.before: dict[int, dict[str, np.ndarray]] = {}
        self.after: dict[int, dict[str, np.ndarray]] = {}
        self.step = 0
        for name, param in model.named_parameters():
            param.register_post_accumulate_grad_hook(self._hook(name))

    def _hook(self, name: str) -> Any:
        def hook(param: torch.Tensor) -> None:
            self.before.setdefault(self.step, {})[name] = param.grad.detach().double().numpy().copy()

        return hook

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step = state.global_step + 1

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.after[self.step] = {n: p.grad.detach().double().numpy().copy() for n, p in model.named_parameters()}


def train(tmp_path: Any, callback: TensorLensCallback, report_to: list[str], max_grad_norm: float = MAX_GRAD_NORM,
          max_steps: int = 4, accumulation: int = 2, save_steps: int | None = None) -> tuple[Trainer, Reference]:
    model = tiny_gpt2()
    reference = Reference(model)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=accumulation,
        max_steps=max_steps, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4, logging_steps=1,
        max_grad_norm=max_grad_norm, learning_rate=1e-3, report_to=report_to, use_cpu=True,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, disable_tqdm=True, seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64, 1, VOCAB, SEQ), eval_dataset=Tokens(8, 2, VOCAB, SEQ),
                      callbacks=[reference, callback])
    trainer.train()
    return trainer, reference


def assert_statistics(run: tl.Run, step: int, tensor: str, reference: np.ndarray, mode: str | None = None) -> None:
    expected = {"l2": np.linalg.norm(reference), "mean": reference.mean(), "min": reference.min(), "max": reference.max(),
                "numel": reference.size}
    for stat, value in expected.items():
        got = run.tensor(tensor).reduction_value(step=step, name=stat, mode=mode)
        assert got == pytest.approx(value, rel=1e-5, abs=1e-8), (tensor, step, stat)


@pytest.fixture
def trackers(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """W&B offline and MLflow on SQLite, everything in tmp_path (the working directory too)."""
    wandb = pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    from mlflow.tracking._tracking_service import utils as tracking_utils

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "tensorlens-hf")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "tensorlens-hf")
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    # the MLflowCallback keeps a tracking URI set earlier in the process: set ours, restore it after;
    # the experiment exists already, with its artifacts here (the default is ./mlruns)
    previous = tracking_utils._tracking_uri
    mlflow.set_tracking_uri(uri)
    mlflow.MlflowClient(uri).create_experiment("tensorlens-hf", artifact_location=(tmp_path / "artifacts").as_uri())
    yield
    mlflow.set_tracking_uri(previous)
    if wandb.run is not None:
        wandb.finish()


# ---------------------------------------------------------------------------------------- one process


def test_trainer_with_wandb_mlflow_and_tensorboard(tmp_path: Any, trackers: Any) -> None:
    import mlflow
    import wandb
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    try:
        from .wandb_runfile import read_run_dir
    except ImportError:
        from wandb_runfile import read_run_dir

    # the run the WandbCallback finds and logs into (started here: WANDB_DIR is read once per process)
    wandb.init(dir=str(tmp_path), project="tensorlens-hf")
    # every tensor's statistics to the trackers (tracker_stats="all"): they are read back below
    callback = TensorLensCallback(save_interval=1, activations=True, record_clipped_gradients=True, tracker_stats="all")
    trainer, reference = train(tmp_path, callback, ["wandb", "mlflow", "tensorboard"])
    recorder = callback.recorder
    assert recorder.closed and [b.name for b in recorder.backends] == ["local", "wandb", "mlflow", "tensorboard"]
    # 4 train records, 4 eval records (2 evaluations of 2 batches) and the epoch's aggregates, everywhere
    assert all(s.written == 9 and s.failed == 0 and s.dropped == 0 for s in recorder.backend_stats().values())
    wandb_run_id = wandb.run.id
    wandb.finish()

    # steps: the global step each optimizer step reaches (the Trainer's logs use the same);
    # evaluations (2 batches each) after steps 2 and 4
    run = tl.open_run(recorder.run_dir)
    assert trainer.state.global_step == 4
    assert run.steps("train") == [1, 2, 3, 4]
    assert [(k.step, k.mode_step) for k in run.step_keys() if k.mode == tl.ModeKeys.EVAL] == [(2, 0), (2, 1), (4, 2), (4, 3)]
    assert recorder.run_dir == os.path.join(str(tmp_path / "out"), "tensorlens_runs", os.path.basename(recorder.run_dir))

    # gradients: accumulated over both micro-batches and not clipped; gradients_clipped: clipped
    names = [n for n, _ in trainer.model.named_parameters()]
    for step in (1, 2, 3, 4):
        for name in names:
            assert_statistics(run, step, f"gradients/{name}", reference.before[step][name])
            assert_statistics(run, step, f"gradients_clipped/{name}", reference.after[step][name])
        clipped_norm = np.sqrt(sum(run.tensor(f"gradients_clipped/{n}").reduction_value(step, "l2") ** 2 for n in names))
        assert clipped_norm == pytest.approx(MAX_GRAD_NORM, rel=1e-4)
        unclipped_norm = np.sqrt(sum(run.tensor(f"gradients/{n}").reduction_value(step, "l2") ** 2 for n in names))
        assert unclipped_norm > 1.5 * MAX_GRAD_NORM
        # the Trainer's own log of that step: its grad_norm is the norm before clipping, at the same global step
        [logged] = [e["grad_norm"] for e in trainer.state.log_history if e.get("step") == step and "grad_norm" in e]
        assert unclipped_norm == pytest.approx(float(logged), rel=1e-5)
    assert run.tensor("activations/transformer.h.0.mlp.c_fc").reduction_value(step=3, name="numel", mode="eval") == 4 * SEQ * 128

    # W&B: the Trainer's run; our rows carry train/global_step, the x axis of the Trainer's rows
    run_file = read_run_dir(str(tmp_path))
    assert run_wandb_id(run_file) == wandb_run_id
    ours = [row for row in run_file.history if "tensorlens/step" in row]
    assert all(row["train/global_step"] == row["tensorlens/step"] for row in ours)
    assert sorted({row["tensorlens/step"] for row in ours if "tensorlens-gradients/transformer.wte.weight/l2" in row}) == [1, 2, 3, 4]
    theirs = sorted(row["train/global_step"] for row in run_file.history if "train/loss" in row)
    assert theirs == [1, 2, 3, 4]
    # the loss the Trainer logs is the run's losses/loss, at the steps W&B got it at
    assert run.tensor("losses/loss").values() == pytest.approx(run_file.series("train/loss", "train/global_step"), rel=1e-12)
    key = "tensorlens-gradients/transformer.h.1.attn.c_proj.weight/l2"
    assert {row["tensorlens/step"]: row[key] for row in ours if key in row} == \
        run.tensor("gradients/transformer.h.1.attn.c_proj.weight").reduction_values("l2")
    assert run_file.config["tensorlens"]["model"]["parameters"] == sum(p.numel() for p in trainer.model.parameters())

    # MLflow: the run the Trainer's MLflowCallback started, with our metrics at the same steps
    client = mlflow.MlflowClient()
    [mlflow_run] = client.search_runs([client.get_experiment_by_name("tensorlens-hf").experiment_id])
    history = client.get_metric_history(mlflow_run.info.run_id, key)
    assert [(m.step, m.value) for m in history] == sorted(run.tensor(key[len("tensorlens-"):-3]).reduction_values("l2").items())
    assert [m.step for m in client.get_metric_history(mlflow_run.info.run_id, "loss")] == [1, 2, 3, 4]
    assert list((tmp_path / "artifacts").glob("*/artifacts/tensorlens/histograms/train/histograms-*.json"))
    params = mlflow_run.data.params
    assert params["tensorlens.model.class"] == "GPT2LMHeadModel" and "learning_rate" in params  # ours next to the Trainer's

    # TensorBoard: our event file in the TensorBoardCallback's own folder: one TensorBoard run
    [folder] = os.listdir(tmp_path / "out" / "runs")
    events = EventAccumulator(str(tmp_path / "out" / "runs" / folder), size_guidance={SCALARS: 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars(key)] == [1, 2, 3, 4]


def run_wandb_id(run_file: Any) -> str:
    return os.path.basename(run_file.path)[len("run-"):-len(".wandb")]


def test_without_clipping_gradients_are_read_before_the_optimizer(tmp_path: Any) -> None:
    callback = TensorLensCallback(save_interval=2, backends=["local"], record_clipped_gradients=True,
                                  collections=["gradients", "weights"])
    trainer, reference = train(tmp_path, callback, [], max_grad_norm=0.0, max_steps=5, accumulation=3)
    run = tl.open_run(callback.recorder.run_dir)
    assert run.steps("train") == [2, 4]  # every second global step, as logging_steps=2 would log
    for step in (2, 4):
        for name, _ in trainer.model.named_parameters():
            assert_statistics(run, step, f"gradients/{name}", reference.before[step][name])
            np.testing.assert_array_equal(reference.before[step][name], reference.after[step][name])
    # nothing clipped: no gradients_clipped (the epoch's aggregates sit in their own collection)
    assert run.collections() == ["epochs", "gradients", "weights"]


def test_dynamics_epochs_and_a_stop_rule(tmp_path: Any) -> None:
    from tensorlens import rules as R

    class StopAtOnce(R.Rule):  # a rule that fires on the first saved step it sees
        def invoke_at_step(self, record: tl.StepRecord) -> tl.Finding | None:
            if record.mode == tl.ModeKeys.TRAIN:
                return self.finding(record, "gradients/transformer.wte.weight", "stop here")
            return None

    callback = TensorLensCallback(save_interval=1, backends=["local"], dynamics=True, record_clipped_gradients=True,
                                  rules=[StopAtOnce(action="stop")])
    trainer, reference = train(tmp_path, callback, [], max_steps=6, accumulation=1)
    run = tl.open_run(callback.recorder.run_dir)
    saved = run.steps("train")
    assert 1 in saved and len(saved) < 6 and trainer.state.global_step < 6  # the rule stopped the Trainer
    grads = reference.before[1]
    total = float(np.sqrt(sum(np.sum(g * g) for g in grads.values())))
    assert run.tensor("dynamics/global").reduction_value(step=1, name="grad_norm") == pytest.approx(total, rel=1e-5)
    clipped = run.tensor("dynamics/global").reduction_value(step=1, name="grad_norm_clipped")
    assert clipped == pytest.approx(min(total, MAX_GRAD_NORM), rel=1e-4)
    assert [f.rule for f in run.findings()][:1] == ["StopAtOnce"]
    assert run.steps("epoch") == [0]  # the stopped epoch still ends with its aggregates


def test_training_resumed_from_a_checkpoint_continues_the_run(tmp_path: Any) -> None:
    callback = TensorLensCallback(save_interval=1, backends=["local"], run_name="resumed", activations=True)
    trainer, _ = train(tmp_path, callback, [], max_steps=2, save_steps=2)
    first = callback.recorder.run_dir
    trainer.args.max_steps = 4
    trainer.train(resume_from_checkpoint=True)  # global_step 2 from the checkpoint, then 3 and 4
    assert callback.recorder.run_dir == first and callback.recorder.resumed  # a second train() continues the folder
    run = tl.open_run(first)
    assert run.steps("train") == [1, 2, 3, 4]
    assert run.steps("eval") == [0, 1, 2, 3]  # eval mode steps go on too


def test_options_are_checked_when_the_callback_is_made() -> None:
    with pytest.raises(ValueError, match="Expected `save_interval`"):
        TensorLensCallback(save_interval=0)
    with pytest.raises(ValueError, match="Expected `backends` to be \"report_to\" or a list"):
        TensorLensCallback(backends=["report_to", "neptune"])
    with pytest.raises(ValueError, match="Expected `include_workers`"):
        TensorLensCallback(include_workers="some")
    with pytest.raises(ValueError, match="Expected `resume`"):
        TensorLensCallback(resume="maybe")
    with pytest.raises(ValueError, match="Expected `histograms`"):
        TensorLensCallback(histograms=64)
    assert TensorLensCallback(activations=True).options.collections[-1] == "activations"


def test_deepspeed_and_fsdp1_fail_with_the_reason() -> None:
    from types import SimpleNamespace

    from tensorlens.integrations.transformers import _check_supported

    with pytest.raises(RuntimeError, match="does not support DeepSpeed"):
        _check_supported(SimpleNamespace(deepspeed="ds_config.json"))
    with pytest.raises(RuntimeError, match="does not support FSDP version 1"):
        _check_supported(SimpleNamespace(deepspeed=None, fsdp="full_shard", fsdp_config={"version": 1}))
    _check_supported(SimpleNamespace(deepspeed=None, fsdp="full_shard", fsdp_config={"version": 2}))


# ---------------------------------------------------------------------------------------- DDP


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ddp_two_processes_reduce_gradients_and_eval_activations(tmp_path: Any) -> None:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "WANDB_MODE": "disabled"}
    procs = []
    for rank in (0, 1):
        log = open(tmp_path / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(
            [sys.executable, os.path.join(HERE, "transformers_ddp.py"), str(tmp_path)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT,
            cwd=tmp_path, start_new_session=True,
        ), log))
    deadline = time.monotonic() + 300
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
    logs = {r: (tmp_path / f"rank{r}.log").read_text(errors="replace")[-4000:] for r in (0, 1)}
    assert all(proc.returncode == 0 for proc, _ in procs), logs

    import json

    ranks = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    captured = {r: torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)}
    assert ranks[0]["world_size"] == 2 and ranks[0]["global_step"] == ranks[1]["global_step"] == 4
    assert ranks[0]["run_dir"] == ranks[1]["run_dir"]
    run = tl.open_run(ranks[0]["run_dir"])
    # the loss the Trainer logged (every 2 steps, gathered across ranks), merged across ranks unchanged
    assert ranks[0]["losses"] == ranks[1]["losses"] and sorted(ranks[0]["losses"]) == ["2", "4"]
    assert run.tensor("losses/loss").values() == pytest.approx({int(s): v for s, v in ranks[0]["losses"].items()}, rel=1e-12)
    eval_steps = {k.mode_step: k.step for k in run.step_keys() if k.mode == tl.ModeKeys.EVAL}
    stored_eval = {eval_steps[s]: v for s, v in run.tensor("losses/loss").values(mode="eval").items()}
    assert stored_eval == pytest.approx({int(s): v for s, v in ranks[0]["eval_losses"].items()}, rel=1e-12)
    assert run.workers() == ["reduced"]
    assert run.steps("train") == [1, 2, 3, 4]
    # DDP averages the ranks' accumulated gradients; the record holds statistics of that average
    for step in (1, 2, 3, 4):
        for name, local0 in captured[0]["gradients"][step].items():
            average = (local0 + captured[1]["gradients"][step][name]) / 2
            assert_statistics(run, step, f"gradients/{name}", average.numpy())
    # each eval batch: the ranks' outputs differ (each has half the data): merged, they are both halves
    eval_keys = [k for k in run.step_keys() if k.mode == tl.ModeKeys.EVAL]
    assert [(k.step, k.mode_step) for k in eval_keys] == [(2, 0), (2, 1), (4, 2), (4, 3)]
    for k in eval_keys:
        both = torch.cat([captured[0]["eval_outputs"][k.mode_step].flatten(), captured[1]["eval_outputs"][k.mode_step].flatten()])
        assert_statistics(run, k.mode_step, "activations/transformer.h.0.mlp.c_fc", both.numpy(), mode="eval")
