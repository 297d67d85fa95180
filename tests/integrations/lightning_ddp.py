"""A Lightning DDP run on CPU (two processes, gloo) for ``test_lightning.py``.

Usage: ``python lightning_ddp.py OUT_DIR``. Trains the tiny model of the tests with a
TensorBoardLogger, validation after each epoch and gradient clipping, and writes, per rank, ``OUT_DIR/rank<r>.json`` with the backends the callback
created there, the run folder and the final step. Lightning starts the second process by running
this script again, hence the ``__main__`` guard.
"""

from __future__ import annotations

import json
import os
import sys

import lightning.pytorch as L
import torch
from torch import nn

from tensorlens.integrations.lightning import TensorLensCallback

BATCH = 4


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 2)
        self.returned: list[float] = []  # every loss training_step returned on this rank

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.returned.append(float(loss))
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16, 2))
    # Lightning adds a DistributedSampler: 8 samples, 2 batches per rank and epoch
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    val_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 2)), batch_size=BATCH)
    callback = TensorLensCallback(save_interval=1, activations=True, record_clipped_gradients=True)
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=4,
        accumulate_grad_batches=2,  # the issue's own trainer line: DDP + accumulation + bf16 autocast
        precision="bf16-mixed",
        logger=L.loggers.TensorBoardLogger(os.path.join(out_dir, "tb")),
        callbacks=[callback],
        default_root_dir=out_dir,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        gradient_clip_val=0.01,
    )
    model = Tiny()
    trainer.fit(model, loader, val_loader)
    hook = callback.hook
    report = {
        "returned": model.returned,
        "backends": [b.name for b in hook.backends],
        "run_dir": hook.run_dir,
        "global_step": hook.global_step,
        "stats": {name: vars(stats) for name, stats in hook.backend_stats().items()},
    }
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
