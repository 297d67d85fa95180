"""PyTorch Lightning + Weights & Biases: the TensorLensCallback logs into the WandbLogger's run.

Runs offline unless WANDB_MODE says otherwise (no account needed); CPU, well under a minute.

    python examples/lightning_wandb.py [OUT_DIR] [EPOCHS]    # default: examples/output/lightning_wandb/
    wandb sync examples/output/lightning_wandb/wandb/offline-run-*  # later, to upload it

``examples/output/`` is ignored by git.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("WANDB_MODE", "offline")  # before wandb is imported

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
import wandb  # noqa: E402
from lightning.pytorch.loggers import WandbLogger  # noqa: E402
from torch import nn  # noqa: E402

import tensorlens as tl  # noqa: E402
from tensorlens.integrations.lightning import TensorLensCallback  # noqa: E402

DEFAULT_OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "output", "lightning_wandb")


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
    tl.setup()  # raise the open-file limit before W&B starts
    torch.manual_seed(0)
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    logger = WandbLogger(project="tensorlens-lightning", save_dir=out_dir)
    # gradients are read before clipping; record_clipped_gradients also records them after it
    callback = TensorLensCallback(save_interval=10, activations=True, record_clipped_gradients=True)
    trainer = L.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        logger=logger,
        callbacks=[callback],
        default_root_dir=out_dir,
        gradient_clip_val=0.2,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=10,
    )
    try:
        trainer.fit(Classifier(), data(2560, seed=1), data(320, seed=2))
        wandb_dir = logger.experiment.dir
    finally:
        wandb.finish()

    run = tl.open_run(callback.hook.run_dir)
    print(f"run folder: {callback.hook.run_dir}")
    print(f"W&B run files: {os.path.dirname(wandb_dir)}")
    print(f"sent to W&B: {callback.hook.backend_stats()['wandb']}")
    print(f"saved train steps: {run.steps()}  (trainer.global_step = {trainer.global_step})")
    grad = run.tensor("gradients/net.0.weight")
    clipped = run.tensor("gradients_clipped/net.0.weight")
    for step in run.steps():
        print(
            f"step {step:4d}  grad l2 {grad.reduction_value(step, 'l2'):.4f}  "
            f"after clipping {clipped.reduction_value(step, 'l2'):.4f}  "
            f"output max {run.tensor('activations/net.4').reduction_value(step, 'max'):.3f}"
        )
    return callback.hook.run_dir


if __name__ == "__main__":
    main(*sys.argv[1:2], *(int(a) for a in sys.argv[2:3]))
