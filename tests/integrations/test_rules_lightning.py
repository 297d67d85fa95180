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
    # rules run in the background: the stop comes some batches after the step that fired, long before max_steps
    assert found and trainer.should_stop and found[0].step < trainer.global_step < 200
    assert tl.open_run(str(tmp_path / "run")).findings() == found


def test_rules_are_checked_when_the_callback_is_built() -> None:
    with pytest.raises(ValueError, match="Expected `rules`"):
        TensorLensCallback(rules=[object()])


def test_ddp_ranks_stop_together(tmp_path: Any) -> None:
    """Rules run on rank 0; the callback shares its decision, so rank 1 leaves at the same step
    instead of waiting in the next all-reduce forever."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    script = os.path.join(here, "lightning_ddp_rules.py")
    try:
        proc = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=300,
                              env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the DDP run did not finish in {err.timeout} s (a rank waiting for the other?):\n{err.stderr!r}")
    assert proc.returncode == 0, proc.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["findings"] > 0 and ranks[1]["findings"] == 0  # only rank 0 checks rules
    assert ranks[0]["first"] < ranks[0]["global_step"] == ranks[1]["global_step"] < 30
