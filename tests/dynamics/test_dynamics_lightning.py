"""The Lightning callback's ``dynamics=``: a real Trainer (CPU) with gradient clipping, the global
gradient norm before clipping (what ``clip_grad_norm_`` returns) and after it
(``record_clipped_gradients=True``), and epoch aggregates at ``on_train_epoch_end``."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl

CALLBACKS = {"lightning.pytorch": "tensorlens.integrations.lightning", "pytorch_lightning": "tensorlens.integrations.pytorch_lightning"}
CLIP = 0.05


def _module(ns: Any) -> Any:
    class Small(ns.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
            self.norms: dict[int, dict[str, float]] = {}

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def _grad_norm(self) -> float:
            return torch.nn.utils.get_total_norm([p.grad for p in self.parameters()]).item()

        def on_before_optimizer_step(self, optimizer: Any) -> None:  # before Lightning clips
            self.norms.setdefault(self.trainer.global_step, {})["before"] = self._grad_norm()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:  # clipped, still in .grad
            self.norms[self.trainer.global_step - 1]["after"] = self._grad_norm()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Small()


@pytest.mark.parametrize("namespace", list(CALLBACKS))
def test_clipped_grad_norm_and_epoch_aggregates(tmp_path: Any, namespace: str) -> None:
    ns = pytest.importorskip(namespace)
    callback_class = importlib.import_module(CALLBACKS[namespace]).TensorLensCallback
    x = torch.linspace(-1.0, 1.0, 48).reshape(16, 3)
    y = torch.stack([x.sum(1), x[:, 0] - x[:, 2]], dim=1) * 3.0
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    mem = tl.MemoryBackend()
    callback = callback_class(save_interval=2, collections=["dynamics"], dynamics=True, record_clipped_gradients=True,
                              backends=[mem], out_dir=str(tmp_path / "run"))
    model = _module(ns)
    trainer = ns.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=str(tmp_path), gradient_clip_val=CLIP, gradient_clip_algorithm="norm",
        callbacks=[callback],
    )
    trainer.fit(model, data)
    train = [r for r in mem.records if str(r.mode) == "train"]
    epochs = [r for r in mem.records if str(r.mode) == "epoch"]
    assert [r.step for r in train] == [0, 2, 4, 6]
    for record in train:
        norms = model.norms[record.step]
        assert norms["before"] > CLIP  # clipping really happened
        assert record.scalar("dynamics/global", "grad_norm") == pytest.approx(norms["before"], rel=1e-6)
        assert record.scalar("dynamics/global", "grad_norm_clipped") == pytest.approx(norms["after"], rel=1e-6)
        assert record.scalar("dynamics/global", "grad_norm_clipped") == pytest.approx(CLIP, rel=1e-4)
        assert "activations/net.1/dead_fraction" in record.scalar_dict()
    # one record per epoch, keyed by the trainer's epoch, at the step the epoch ended
    assert [(e.mode_step, e.step) for e in epochs] == [(0, 4), (1, 8)]
    for epoch, steps in zip(epochs, ([0, 2], [4, 6]), strict=True):
        values = [r.scalar("dynamics/global", "grad_norm") for r in train if r.step in steps]
        assert epoch.scalar("epochs/dynamics/global", "grad_norm_mean") == pytest.approx(np.mean(values), rel=1e-12)
        assert epoch.scalar("epochs/dynamics/global", "grad_norm_max") == max(values)
        ratios = [r.scalar("dynamics/net.0.weight", "update_ratio") for r in train if r.step in steps]
        assert epoch.scalar("epochs/dynamics/net.0.weight", "update_ratio_std") == pytest.approx(np.std(ratios), rel=1e-9)
    run = tl.open_run(callback.hook.run_dir)
    assert run.tensor("epochs/dynamics/global").reduction_value(step=1, name="grad_norm_min") == pytest.approx(
        min(r.scalar("dynamics/global", "grad_norm") for r in train[2:]))


def test_callback_arguments_are_checked() -> None:
    callback_class = importlib.import_module(CALLBACKS["lightning.pytorch"]).TensorLensCallback
    pytest.importorskip("lightning.pytorch")
    with pytest.raises(ValueError, match="Expected `dynamics`"):
        callback_class(dynamics="yes")
    with pytest.raises(ValueError, match="Expected `epoch_statistics`"):
        callback_class(epoch_statistics=[1])
    assert "dynamics" in callback_class(dynamics=tl.DynamicsConfig(units=False)).collections
