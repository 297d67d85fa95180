"""PyTorch Lightning + MLflow: the TensorLensCallback sends statistics to the MLFlowLogger's run.

No MLflow server: the tracking store is a local SQLite file. CPU, well under a minute.

    python examples/lightning_mlflow.py [OUT_DIR] [EPOCHS]    # default: examples/output/lightning_mlflow/
    mlflow ui --backend-store-uri sqlite:///examples/output/lightning_mlflow/mlflow.db   # to browse it

``examples/output/`` is ignored by git.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as L
import torch
from lightning.pytorch.loggers import MLFlowLogger
from mlflow.tracking import MlflowClient
from torch import nn

import tensorlens as tl
from tensorlens.integrations.lightning import TensorLensCallback

DEFAULT_OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "output", "lightning_mlflow")


class Classifier(L.LightningModule):
    """A small MLP on a synthetic 10-class problem."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def data(n: int, seed: int) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 32, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x @ teacher).argmax(1)), batch_size=64)


def main(out_dir: str = DEFAULT_OUT_DIR, max_epochs: int = 2) -> str:
    tl.setup()
    torch.manual_seed(0)
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tracking_uri = f"sqlite:///{os.path.join(out_dir, 'mlflow.db')}"
    # artifacts (tensorlens' histogram files and heatmaps) would go to ./mlruns without artifact_location
    logger = MLFlowLogger(
        experiment_name="tensorlens-lightning",
        tracking_uri=tracking_uri,
        artifact_location=os.path.join(out_dir, "artifacts"),
    )
    # every 10 optimizer steps (and every 10th validation batch), with activations
    # tracker_stats=["l2", "histogram"]: each tensor's l2 as an MLflow series of its own, besides the
    # histograms (the default payload sends histograms, per-layer images and the global values)
    callback = TensorLensCallback(save_interval=10, activations=True, tracker_stats=["l2", "histogram"])
    trainer = L.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        logger=logger,
        callbacks=[callback],
        default_root_dir=out_dir,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=10,
    )
    trainer.fit(Classifier(), data(2560, seed=1), data(320, seed=2))

    # Read the statistics back from tensorlens' local run store...
    run = tl.open_run(callback.hook.run_dir)
    print(f"run folder: {callback.hook.run_dir}")
    print(f"saved train steps: {run.steps()}  (trainer.global_step = {trainer.global_step})")
    print(f"saved eval steps: {run.steps(mode='eval')}")
    grad = run.tensor("gradients/net.0.weight")
    dead = run.tensor("activations/net.1")
    for step in run.steps():
        print(
            f"step {step:4d}  grad l2 {grad.reduction_value(step, 'l2'):.4f}  "
            f"weight std {run.tensor('weights/net.0.weight').reduction_value(step, 'std'):.4f}  "
            f"relu dead fraction {dead.reduction_value(step, 'zero_fraction'):.2f}"
        )
    # ...and from MLflow, where the same numbers sit beside Lightning's own metrics.
    client = MlflowClient(tracking_uri=tracking_uri)
    metrics = client.get_run(logger.run_id).data.metrics
    key = next(k for k in metrics if k.endswith("gradients/net.0.weight/l2"))
    history = sorted((m.step, m.value) for m in client.get_metric_history(logger.run_id, key))
    print(f"MLflow run {logger.run_id}: {len(metrics)} metrics, e.g. {key}:")
    print("  " + ", ".join(f"step {s}: {v:.4f}" for s, v in history))
    return callback.hook.run_dir


if __name__ == "__main__":
    main(*sys.argv[1:2], *(int(a) for a in sys.argv[2:3]))
