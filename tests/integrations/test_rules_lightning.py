"""A rule with action="stop" stops a real Lightning Trainer through the callback."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens import rules as R

pl = pytest.importorskip("lightning.pytorch")
from tensorlens.integrations.lightning import TensorLensCallback  # noqa: E402


class Exploding(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=50.0)  # far too large: the loss explodes


def test_a_stop_rule_sets_trainer_should_stop(tmp_path: Any) -> None:
    x = torch.randn(64, 3) * 10
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    callback = TensorLensCallback(save_interval=1, backends=["local"], out_dir=str(tmp_path / "run"),
                                  rules=[R.ExplodingTensor(collection_names="gradients,weights", action="stop")])
    trainer = pl.Trainer(callbacks=[callback], accelerator="cpu", devices=1, max_steps=200, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    with pytest.warns(R.RuleWarning, match="asks to stop"):
        trainer.fit(Exploding(), data)
    found = callback.hook.findings()
    assert found and trainer.should_stop and trainer.global_step < 200
    assert trainer.global_step <= found[0].step + 3  # stopped within the next batches, not at max_steps
    assert tl.open_run(str(tmp_path / "run")).findings() == found


def test_rules_are_checked_when_the_callback_is_built() -> None:
    with pytest.raises(ValueError, match="Expected `rules`"):
        TensorLensCallback(rules=[object()])
