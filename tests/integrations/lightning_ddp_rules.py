"""A Lightning DDP run on CPU (two processes, gloo) whose loss explodes, for ``test_rules_lightning.py``:
a rule with ``action="stop"`` (checked on rank 0) must stop both ranks at the same step.

Usage: ``python lightning_ddp_rules.py OUT_DIR``; writes ``OUT_DIR/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import lightning.pytorch as L
import torch
from torch import nn

from tensorlens import rules as R
from tensorlens.integrations.lightning import TensorLensCallback


class Exploding(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=50.0)


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 3) * 10
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    callback = TensorLensCallback(save_interval=1, backends=["local"], out_dir=os.path.join(out_dir, "run"),
                                  rules=[R.ExplodingTensor(collection_names="gradients,weights", action="stop")])
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=30, logger=False, callbacks=[callback],
                        default_root_dir=out_dir, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(Exploding(), loader)
    report = {"global_step": trainer.global_step, "findings": len(callback.hook.findings()),
              "first": callback.hook.findings()[0].step if callback.hook.findings() else None}
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
