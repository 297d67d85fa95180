"""Health at a glance of a Lightning run, the issue's own case: an MLP trained with Adam at lr 1.5
under a real Trainer and the TensorLensCallback collapses into dead ReLUs. The report's health card
says DeadRelu (not an exploding tensor: no NaN was made up), reads the loss the callback recorded
(LossNotDecreasing is evaluated), and the explorer marks the dead ReLU's module."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tensorlens.reports import build_explorer, build_report, load_run
from tensorlens.reports.health import run_health

ns = pytest.importorskip("lightning.pytorch")
from tensorlens.integrations.lightning import TensorLensCallback  # noqa: E402

try:
    from .test_health import _cards
    from .test_report import payload
except ImportError:
    from test_health import _cards
    from test_report import payload


class Collapse(ns.LightningModule):
    """Regression of sin(x . w) by a 2-hidden-layer ReLU MLP, Adam at lr 1.5: too large a step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1.5)


def test_a_lightning_dead_relu_collapse_in_the_report(tmp_path: Any) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16 * 40, 8, generator=generator)
    y = torch.sin(x @ torch.randn(8, 1, generator=generator)) + 0.1 * torch.randn(16 * 40, 1, generator=generator)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    callback = TensorLensCallback(save_interval=1, activations=True, dynamics=True, run_name="collapse")
    trainer = ns.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, callbacks=[callback],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(Collapse(), data)
    health = run_health(load_run(callback.run_dir))
    fired = {r.rule for r in health.fired}
    assert "DeadRelu" in fired and not fired & {"ExplodingTensor", "NonFiniteGradient"}, fired
    assert health.first_nonfinite is None and health.status == "warning"
    assert "LossNotDecreasing" in health.rules and all(n.rule != "LossNotDecreasing" for n in health.not_evaluated)
    dead = {r.rule: r for r in health.fired}["DeadRelu"].tensors
    assert dead and all(t.startswith("activations/net.") for t in dead)
    card = _cards(build_report(callback.run_dir).html)["collapse"]
    assert 'tl-status-warning"' in card and "\u25b2 DeadRelu" in card and "ExplodingTensor</td>" not in card
    marks = payload(build_explorer(callback.run_dir).html)["health"]
    module = dead[0].split("/", 1)[1]
    assert "DeadRelu" in [r[0] for r in marks[module]["rules"]]
