"""The Lightning callback with a real Trainer (CPU, tiny model, a few steps), in both namespaces.

What is checked: steps equal ``trainer.global_step``; gradients read in ``on_before_optimizer_step``
are the accumulated, AMP-unscaled ones (against a numpy reference of the whole run); the
clipped-gradient option; validation, test and predict get their own modes and mode steps;
routing to each logger's tracker (read back from the tracker itself); DDP on CPU.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sqlite3
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
NAMESPACES = ["lightning.pytorch", "pytorch_lightning"]
CALLBACK_MODULES = {
    "lightning.pytorch": "tensorlens.integrations.lightning",
    "pytorch_lightning": "tensorlens.integrations.pytorch_lightning",
}
LR = 0.1
BATCH = 4
X = torch.linspace(-1.0, 1.0, 16 * 3).reshape(16, 3) * torch.tensor([1.0, -2.0, 0.5])
Y = torch.stack([X.sum(1), X[:, 0] - X[:, 2]], dim=1) + 0.1


def namespace(name: str) -> tuple[Any, type]:
    """The Lightning namespace module and the TensorLensCallback made for it."""
    ns = pytest.importorskip(name)
    return ns, importlib.import_module(CALLBACK_MODULES[name]).TensorLensCallback


def make_model(ns: Any, validation_summary: bool = False, optimizers: int = 1, manual: bool = False) -> Any:
    """A LightningModule with one ``nn.Linear(3, 2)`` and an MSE loss (gradients known in closed form).

    ``training_step`` calls ``self.layer`` and never ``self(...)``: step boundaries must not
    depend on the root module's forward.
    """

    class Tiny(ns.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = not manual and optimizers == 1
            torch.manual_seed(0)
            self.layer = nn.Linear(3, 2)
            self.forward_hooks_seen: list[tuple[int, int]] = []  # (global_step, hooks on self.layer)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.forward_hooks_seen.append((self.trainer.global_step, len(self.layer._forward_hooks)))
            x, y = batch
            loss = nn.functional.mse_loss(self.layer(x).float(), y)
            self.log("train_loss", loss)  # the user's own logging goes on beside tensorlens
            if manual:
                optimizer = self.optimizers()
                optimizer.zero_grad()
                self.manual_backward(loss)
                optimizer.step()
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            loss = nn.functional.mse_loss(self.layer(x), y)
            if validation_summary:
                tl.summarize_scalar("val_loss", loss)
            self.log("val_loss", loss)

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.validation_step(batch, batch_idx)

        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
            return self.layer(batch[0])

        def configure_optimizers(self) -> Any:
            opts = [torch.optim.SGD(self.parameters(), lr=LR) for _ in range(optimizers)]
            return opts[0] if optimizers == 1 else opts

    return Tiny()


def loader(batches: int = 4) -> torch.utils.data.DataLoader:
    data = torch.utils.data.TensorDataset(X[: batches * BATCH], Y[: batches * BATCH])
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)


def trainer(ns: Any, tmp_path: Any, **kwargs: Any) -> Any:
    options = dict(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    options.update(kwargs)
    return ns.Trainer(**options)


def step_table(run_dir: str) -> list[tuple[str, int, int]]:
    """``(mode, mode_step, global_step)`` of every stored record of rank 0 (the store's own table)."""
    with sqlite3.connect(os.path.join(run_dir, "tensorlens.sqlite")) as db:
        return sorted(db.execute("SELECT mode, mode_step, step FROM steps"))


def reference_gradients(steps: int, accumulate: int) -> list[dict[str, np.ndarray]]:
    """Float64 replay of the run: per optimizer step, the gradient the optimizer receives.

    Lightning divides each micro-batch loss by ``accumulate_grad_batches`` before ``backward``,
    so the accumulated gradient is the sum of the micro-batch gradients of ``loss / accumulate``.
    """
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    w = layer.weight.detach().double().numpy().copy()
    b = layer.bias.detach().double().numpy().copy()
    x_all, y_all = X.double().numpy(), Y.double().numpy()
    batches = len(X) // BATCH  # the loader's batches per epoch, in order
    out = []
    micro = 0
    for _ in range(steps):
        gw, gb = np.zeros_like(w), np.zeros_like(b)
        for _ in range(accumulate):
            i = micro % batches
            micro += 1
            x, y = x_all[i * BATCH:(i + 1) * BATCH], y_all[i * BATCH:(i + 1) * BATCH]
            residual = x @ w.T + b - y
            scale = 2.0 / residual.size / accumulate  # d mean(r^2) / dr, then Lightning's 1/accumulate
            gw += scale * residual.T @ x
            gb += scale * residual.sum(0)
        out.append({"layer.weight": gw, "layer.bias": gb})
        w, b = w - LR * gw, b - LR * gb
    return out


def assert_matches(run: tl.Run, step: int, name: str, reference: np.ndarray, rtol: float = 1e-5) -> None:
    view = run.tensor(f"gradients/{name}")
    expected = {"l2": np.linalg.norm(reference), "mean": reference.mean(), "min": reference.min(), "max": reference.max()}
    for stat, value in expected.items():
        got = view.reduction_value(step=step, name=stat)
        assert got == pytest.approx(value, rel=rtol, abs=1e-7), (name, step, stat)
    assert view.reduction_value(step=step, name="numel") == reference.size


# ---------------------------------------------------------------------------------------- arguments


def test_arguments_are_checked_eagerly() -> None:
    _, callback = namespace("lightning.pytorch")
    cases = [
        (dict(save_interval=0), "Expected `save_interval` to be an integer >= 1, but got 0"),
        (dict(collections="gradients"), "Expected `collections` to be None or a list of collection names"),
        (dict(activations="yes"), "Expected `activations` to be a bool, but got 'yes'"),
        (dict(histograms=64), "Expected `histograms` to be a bool or a tl.HistogramConfig, but got 64"),
        (dict(reductions=["l2"]), "Expected `reductions` to be None or a tl.ReductionConfig"),
        (dict(include_workers="some"), "Expected `include_workers` to be one of ['reduce', 'one', 'all'], but got 'some'"),
        (dict(record_clipped_gradients=1), "Expected `record_clipped_gradients` to be a bool, but got 1"),
        (dict(backends="nowhere"), "Expected `backends` to be \"loggers\" or a list of"),
        (dict(backends=[42]), "Expected `backends` to be \"loggers\" or a list of"),
        (dict(out_dir=3), "Expected `out_dir` to be None or a path, but got 3"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as info:
            callback(**kwargs)
        assert message in str(info.value), (kwargs, str(info.value))


@pytest.mark.parametrize(
    ("package", "module", "extra"),
    [
        ("lightning", "tensorlens.integrations.lightning", "lightning"),
        ("pytorch_lightning", "tensorlens.integrations.pytorch_lightning", "pytorch-lightning"),
    ],
)
def test_missing_package_names_the_extra(package: str, module: str, extra: str) -> None:
    script = textwrap.dedent(
        f"""
        import sys, importlib.abc

        import tensorlens, tensorlens.integrations
        loaded = [m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning")]
        assert not loaded, loaded  # import tensorlens never imports Lightning

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == {package!r}:
                    raise ImportError("blocked for the test: " + name)
                return None

        sys.meta_path.insert(0, Block())
        try:
            import {module}
        except ImportError as err:
            print("hint:", err)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"pip install 'tensorlens[{extra}]'" in proc.stdout


# ---------------------------------------------------------------------------------------- steps and gradients


@pytest.mark.parametrize("name", NAMESPACES)
def test_steps_follow_global_step_and_gradients_are_accumulated(name: str, tmp_path: Any) -> None:
    ns, callback_class = namespace(name)
    callback = callback_class(save_interval=1, out_dir=tmp_path / "run")
    seen: list[tuple[int, int]] = []

    class Probe(ns.Callback):
        # runs after TensorLensCallback: the two step counters must agree at every batch
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            seen.append((trainer.global_step, callback.hook.global_step))

    model = make_model(ns)
    fit = trainer(ns, tmp_path, max_steps=4, accumulate_grad_batches=2, callbacks=[callback, Probe()])
    fit.fit(model, loader())

    assert fit.global_step == 4
    assert seen == [(s, s) for s in (0, 1, 1, 2, 2, 3, 3, 4)]  # micro-batches: the step moves every second one
    assert callback.hook.closed  # teardown closed it
    run = tl.open_run(callback.hook.run_dir)
    assert run.steps() == [0, 1, 2, 3]  # one record per optimizer step, not per micro-batch
    assert run.steps(mode="train") == [0, 1, 2, 3]
    for step, grads in enumerate(reference_gradients(steps=4, accumulate=2)):
        for param, reference in grads.items():
            assert_matches(run, step, param, reference)
    counts, _ = run.tensor("gradients/layer.weight").histogram(step=0)
    assert counts.sum() == 6


def test_gradients_are_unscaled_under_amp(tmp_path: Any) -> None:
    ns, callback_class = namespace("lightning.pytorch")
    from lightning.pytorch.plugins import MixedPrecision

    # "16-mixed" with a GradScaler on CPU: Lightning unscales before on_before_optimizer_step
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    callback = callback_class(save_interval=1, out_dir=tmp_path / "run")
    fit = trainer(ns, tmp_path, max_steps=2, callbacks=[callback], plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    fit.fit(make_model(ns), loader())

    run = tl.open_run(callback.hook.run_dir)
    for step, grads in enumerate(reference_gradients(steps=2, accumulate=1)):
        # float16 forward: close to the float64 reference, and nowhere near 1024 times it
        assert_matches(run, step, "layer.weight", grads["layer.weight"], rtol=2e-2)


def test_manual_optimization_with_one_optimizer(tmp_path: Any) -> None:
    ns, callback_class = namespace("lightning.pytorch")
    callback = callback_class(save_interval=1, out_dir=tmp_path / "run")
    fit = trainer(ns, tmp_path, max_steps=3, callbacks=[callback])
    fit.fit(make_model(ns, manual=True), loader())

    run = tl.open_run(callback.hook.run_dir)
    assert fit.global_step == 3
    assert run.steps() == [0, 1, 2]
    for step, grads in enumerate(reference_gradients(steps=3, accumulate=1)):
        assert_matches(run, step, "layer.weight", grads["layer.weight"])


def test_clipped_gradients_are_recorded_after_clipping(tmp_path: Any) -> None:
    ns, callback_class = namespace("lightning.pytorch")
    clip = 0.05
    callback = callback_class(save_interval=2, record_clipped_gradients=True, out_dir=tmp_path / "run")
    fit = trainer(ns, tmp_path, max_steps=4, gradient_clip_val=clip, gradient_clip_algorithm="norm", callbacks=[callback])
    fit.fit(make_model(ns), loader())

    run = tl.open_run(callback.hook.run_dir)
    params = ["layer.weight", "layer.bias"]
    assert run.tensor("gradients_clipped/layer.weight").steps() == [0, 2]  # same saved steps as the gradients
    for step in (0, 2):
        raw = {p: run.tensor(f"gradients/{p}").reduction_value(step=step, name="l2") for p in params}
        total = math.sqrt(sum(v * v for v in raw.values()))
        assert total > clip  # the test is meaningless unless clipping did something
        factor = min(1.0, clip / (total + 1e-6))  # torch.nn.utils.clip_grad_norm_
        for p in params:
            clipped = run.tensor(f"gradients_clipped/{p}").reduction_value(step=step, name="l2")
            assert clipped == pytest.approx(raw[p] * factor, rel=1e-5)


def test_no_clipped_gradients_unless_asked(tmp_path: Any) -> None:
    ns, callback_class = namespace("lightning.pytorch")
    callback = callback_class(save_interval=1, out_dir=tmp_path / "run")
    trainer(ns, tmp_path, max_steps=2, gradient_clip_val=0.05, callbacks=[callback]).fit(make_model(ns), loader())
    assert "gradients_clipped" not in tl.open_run(callback.hook.run_dir).collections()


def test_activations_only_on_saved_steps(tmp_path: Any) -> None:
    ns, callback_class = namespace("lightning.pytorch")
    callback = callback_class(save_interval=2, activations=True, out_dir=tmp_path / "run")
    model = make_model(ns)
    trainer(ns, tmp_path, max_steps=4, callbacks=[callback]).fit(model, loader())

    run = tl.open_run(callback.hook.run_dir)
    assert run.tensor("activations/layer").steps() == [0, 2]
    assert run.tensor("activations/layer").reduction_value(step=0, name="numel") == BATCH * 2
    # a module hook on the layer during saved steps only, none left after the run
    assert model.forward_hooks_seen == [(0, 1), (1, 0), (2, 1), (3, 0)]
    assert len(model.layer._forward_hooks) == 0


# ---------------------------------------------------------------------------------------- modes


def test_validation_test_and_predict_get_their_own_modes(tmp_path: Any) -> None:
    ns, callback_class = namespace("lightning.pytorch")
    callback = callback_class(save_interval=1, activations=True, out_dir=tmp_path / "run")
    model = make_model(ns, validation_summary=True)
    # 2 optimizer steps per epoch, 3 validation batches after each epoch; the 2 sanity-check
    # batches before training are not recorded
    fit = trainer(ns, tmp_path, max_steps=-1, max_epochs=2, limit_train_batches=2, limit_val_batches=3, num_sanity_val_steps=2, callbacks=[callback])
    fit.fit(model, loader(), loader())
    fit.test(model, loader(2))
    fit.validate(model, loader(1))
    fit.predict(model, loader(2))

    table = step_table(callback.hook.run_dir)
    assert [(m, s, g) for m, s, g in table if m == "train"] == [("train", s, s) for s in range(4)]
    # eval mode steps count batches across validation and test, from one stage to the next;
    # each record keeps the step Lightning's loggers log it at: inside fit, the train step it
    # follows (global_step - 1), in test and validate after fit, global_step
    assert [(s, g) for m, s, g in table if m == "eval"] == [(0, 1), (1, 1), (2, 1), (3, 3), (4, 3), (5, 3), (6, 4), (7, 4), (8, 4)]
    assert [(s, g) for m, s, g in table if m == "predict"] == [(0, 4), (1, 4)]

    run = tl.open_run(callback.hook.run_dir)
    assert run.tensor("summaries/val_loss").steps(mode="eval") == list(range(9))
    assert run.tensor("summaries/val_loss").steps() == []  # the sanity check did not leak into train step 0
    assert run.tensor("activations/layer").steps(mode="predict") == [0, 1]
    # eval records hold activations, never weights or gradients (no optimizer step there)
    eval_names = set(run.scalars(step=0, mode="eval"))
    assert any(k.startswith("activations/layer/") for k in eval_names)
    assert not any(k.startswith(("gradients/", "weights/")) for k in eval_names)
    x, y = X[:BATCH], Y[:BATCH]
    with torch.no_grad():
        first_val_loss = nn.functional.mse_loss(model.layer(x), y)  # evaluated with the final weights
    assert run.tensor("summaries/val_loss").value(step=6, mode="eval") == pytest.approx(float(first_val_loss), rel=1e-5)


def test_resume_from_checkpoint_continues_steps(tmp_path: Any) -> None:
    ns, callback_class = namespace("lightning.pytorch")
    first = callback_class(save_interval=1, out_dir=tmp_path / "run")
    checkpoint = ns.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    fit = trainer(ns, tmp_path, max_steps=2, limit_val_batches=1, enable_checkpointing=True, callbacks=[first, checkpoint])
    fit.fit(make_model(ns, validation_summary=True), loader(2), loader(1))

    second = callback_class(save_interval=1, out_dir=tmp_path / "run")
    fit = trainer(ns, tmp_path, max_steps=4, limit_val_batches=1, enable_checkpointing=True,
                  callbacks=[second, ns.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt2"))])
    fit.fit(make_model(ns, validation_summary=True), loader(2), loader(1), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))

    table = step_table(str(tmp_path / "run"))
    assert [(s, g) for m, s, g in table if m == "train"] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    # the eval counter came back from the checkpoint: the second run's validation is eval step 1
    # (each at the step its loggers log it at, Lightning's _batches_that_stepped, which the
    # resumed loop restores one further on)
    assert [(s, g) for m, s, g in table if m == "eval"] == [(0, 1), (1, 4)]


# ---------------------------------------------------------------------------------------- routing


def test_csv_logger_gets_the_local_store_only(tmp_path: Any) -> None:
    ns, callback_class = namespace("lightning.pytorch")
    callback = callback_class(save_interval=1)
    logger = ns.loggers.CSVLogger(str(tmp_path / "logs"))
    trainer(ns, tmp_path, max_steps=2, logger=logger, callbacks=[callback]).fit(make_model(ns), loader())

    assert [b.name for b in callback.hook.backends] == ["local"]
    assert callback.hook.run_dir == os.path.join(os.path.abspath(logger.log_dir), "tensorlens")
    assert tl.open_run(callback.hook.run_dir).steps() == [0, 1]
    assert os.path.isfile(os.path.join(logger.log_dir, "metrics.csv"))  # the logger kept working


def test_no_logger_writes_under_default_root_dir(tmp_path: Any) -> None:
    ns, callback_class = namespace("lightning.pytorch")
    callback = callback_class(save_interval=1)
    trainer(ns, tmp_path, max_steps=1, logger=False, callbacks=[callback]).fit(make_model(ns), loader())
    assert os.path.dirname(callback.hook.run_dir) == os.path.join(str(tmp_path), "tensorlens_runs")
    assert tl.open_run(callback.hook.run_dir).steps() == [0]


@pytest.mark.parametrize("name", NAMESPACES)
def test_tensorboard_logger(name: str, tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import HISTOGRAMS, SCALARS, EventAccumulator

    ns, callback_class = namespace(name)
    callback = callback_class(save_interval=2, tracker_stats="all")  # every tensor's statistics, read back below
    logger = ns.loggers.TensorBoardLogger(str(tmp_path / "tb"))
    trainer(ns, tmp_path, max_steps=4, logger=logger, callbacks=[callback]).fit(make_model(ns), loader())

    assert sorted(b.name for b in callback.hook.backends) == ["local", "tensorboard"]
    assert callback.hook.run_dir == os.path.join(os.path.abspath(logger.log_dir), "tensorlens")
    events = EventAccumulator(logger.log_dir, size_guidance={SCALARS: 0, HISTOGRAMS: 0})
    events.Reload()
    series = events.Scalars("tensorlens-gradients/layer.weight/l2")
    assert [e.step for e in series] == [0, 2]
    run = tl.open_run(callback.hook.run_dir)
    for event in series:
        stored = run.tensor("gradients/layer.weight").reduction_value(step=event.step, name="l2")
        assert event.value == pytest.approx(stored, rel=1e-6)  # TensorBoard keeps float32
    assert "tensorlens-weights/layer.weight/histogram" in events.Tags()["histograms"]
    assert callback.hook.backend_stats()["tensorboard"].failed == 0


def test_mlflow_logger(tmp_path: Any) -> None:
    pytest.importorskip("mlflow")
    ns, callback_class = namespace("lightning.pytorch")
    callback = callback_class(save_interval=2, tracker_stats="all")  # every tensor's statistics, read back below
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    # artifacts (histogram files, heatmaps) go to ./mlruns of the working directory unless told
    logger = ns.loggers.MLFlowLogger(
        experiment_name="tensorlens-lightning", tracking_uri=uri, artifact_location=str(tmp_path / "artifacts")
    )
    trainer(ns, tmp_path, max_steps=4, logger=logger, callbacks=[callback]).fit(make_model(ns), loader())

    assert sorted(b.name for b in callback.hook.backends) == ["local", "mlflow"]
    assert callback.hook.backend_stats()["mlflow"].failed == 0
    assert callback.hook.run_dir.startswith(os.path.join(str(tmp_path), "tensorlens_runs"))

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    # named after the MLflow run (a name MLflow chose here), its id kept in the metadata
    mlflow_name = client.get_run(logger.run_id).info.run_name
    assert os.path.basename(callback.run_dir) == mlflow_name == callback.hook.run_name
    assert tl.open_run(callback.run_dir).metadata()["trackers"]["mlflow"] == {"run_name": mlflow_name, "run_id": logger.run_id}
    keys = [k for k in client.get_run(logger.run_id).data.metrics if k.endswith("gradients/layer.weight/l2")]
    assert len(keys) == 1, sorted(client.get_run(logger.run_id).data.metrics)
    history = sorted((m.step, m.value) for m in client.get_metric_history(logger.run_id, keys[0]))
    assert [s for s, _ in history] == [0, 2]
    stored = tl.open_run(callback.hook.run_dir).tensor("gradients/layer.weight").reduction_values("l2")
    assert [v for _, v in history] == pytest.approx([stored[0], stored[2]], rel=1e-12)
    assert os.listdir(tmp_path / "artifacts")  # the backend's artifacts went into the logger's run


def test_wandb_logger_offline(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    ns, callback_class = namespace("lightning.pytorch")
    callback = callback_class(save_interval=2, tracker_stats="all")  # every tensor's statistics, read back below
    logger = ns.loggers.WandbLogger(project="tensorlens-lightning", save_dir=str(tmp_path), offline=True)
    try:
        trainer(ns, tmp_path, max_steps=4, logger=logger, callbacks=[callback]).fit(make_model(ns), loader())
        run_id = logger.experiment.id
    finally:
        wandb.finish()

    assert sorted(b.name for b in callback.hook.backends) == ["local", "wandb"]
    stats = callback.hook.backend_stats()["wandb"]
    assert (stats.written, stats.failed, stats.dropped) == (3, 0, 0)  # steps 0 and 2, then the epoch's aggregates
    # an unnamed offline W&B run: named after the project and the run id, as Lightning names it
    assert os.path.basename(callback.hook.run_dir) == f"tensorlens-lightning-{run_id}"
    sys.path.insert(0, HERE)
    try:
        from wandb_runfile import read_run_dir, run_file_path
    finally:
        sys.path.remove(HERE)
    assert os.path.basename(run_file_path(str(tmp_path))).startswith("run-")
    history = read_run_dir(str(tmp_path)).history
    rows = [row for row in history if any(k.endswith("gradients/layer.weight/l2") for k in row)]
    # every tensorlens row also carries the x-axis WandbLogger defines for all metrics
    assert sorted(row["trainer/global_step"] for row in rows) == [0, 2]


# ---------------------------------------------------------------------------------------- unsupported


def test_several_optimizers_fail_early(tmp_path: Any) -> None:
    ns, callback_class = namespace("lightning.pytorch")
    callback = callback_class(out_dir=tmp_path / "run")
    model = make_model(ns, optimizers=2)
    with pytest.raises(RuntimeError, match="supports one optimizer, but the LightningModule configured 2"):
        trainer(ns, tmp_path, max_steps=1, callbacks=[callback]).fit(model, loader())
    # the check runs before anything is recorded: no recorder, no run folder, nothing attached
    assert callback.hook is None and not os.path.exists(tmp_path / "run")


# ---------------------------------------------------------------------------------------- DDP


def test_ddp_only_rank_zero_writes_trackers(tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")
    script = os.path.join(HERE, "lightning_ddp.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    try:
        proc = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the DDP run did not finish in {err.timeout} s:\n{(err.stderr or b'')[-3000:]!r}")
    assert proc.returncode == 0, proc.stderr[-5000:]
    ranks = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert sorted(ranks[0]["backends"]) == ["local", "tensorboard"]
    assert ranks[1]["backends"] == ["local"]  # the logger on rank 1 is a dummy: no tracker there
    assert ranks[0]["run_dir"] == ranks[1]["run_dir"]  # one run folder, chosen on rank 0
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 4
    # accumulate_grad_batches=2 over 2 batches per rank and epoch: one optimizer step per epoch,
    # so 4 epochs, each followed by validation: 4 train + 4 eval records, and 4 epoch aggregates
    # (on_train_epoch_end)
    assert ranks[0]["stats"]["tensorboard"] == {"written": 12, "failed": 0, "dropped": 0, "abandoned": 0, "produced": 12}
    events = [f for _, _, files in os.walk(tmp_path / "tb") for f in files if f.startswith("events.out.tfevents")]
    assert len(events) == 1  # one writer, rank 0's

    run = tl.open_run(ranks[0]["run_dir"])
    assert run.workers() == ["reduced"]
    # the loss: each rank's mean over its 2 micro-batches, merged across ranks as their mean
    # (what self.log("train_loss", loss, sync_dist=True) shows)
    per_rank = [np.array(ranks[r]["returned"]).reshape(4, 2).mean(axis=1) for r in (0, 1)]
    assert run.tensor("losses/loss").values() == pytest.approx(dict(enumerate((per_rank[0] + per_rank[1]) / 2)), rel=1e-6)
    assert run.steps(mode="train") == [0, 1, 2, 3]
    assert run.steps(mode="epoch") == [0, 1, 2, 3]
    grad = run.tensor("gradients/layer.weight")
    # DDP gradients are all-reduced, the same on both ranks: merging must not count them twice
    assert grad.reduction_value(step=0, name="numel") == 6
    assert run.tensor("gradients_clipped/layer.weight").reduction_value(step=0, name="numel") == 6
    # activations differ per rank (each has its half of the batch) and the step accumulates two
    # micro-batches: the merge holds both halves of both micro-batches
    assert run.tensor("activations/layer").reduction_value(step=0, name="numel") == 2 * 2 * BATCH * 2
    # one validation batch per rank after each of the 4 epochs: eval steps 0..3, merged too
    assert run.steps(mode="eval") == [0, 1, 2, 3]
    assert run.tensor("activations/layer").reduction_value(step=1, mode="eval", name="numel") == 2 * BATCH * 2
