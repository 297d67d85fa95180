"""``tl.explain`` on runs recorded by the Lightning callback (a real Trainer) and the Hugging Face
callback (a real ``transformers.Trainer`` on a tiny GPT-2 built from a config, no download): a
fault injected into one module at a known step is traced back to it. The loss comes from the
callbacks themselves (``losses/loss``), as users get it."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
from torch import nn

import tensorlens as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_explain import FAULT_STEP, LAYER, Net, in_layer  # noqa: E402

sys.path.pop(0)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_lightning_weights_scaled_in_one_layer(tmp_path: Any) -> None:
    ns = pytest.importorskip("lightning.pytorch")
    from tensorlens.integrations.lightning import TensorLensCallback

    class Lit(ns.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = Net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if self.global_step == FAULT_STEP:
                with torch.no_grad():
                    getattr(self.net, LAYER).weight.mul_(50.0)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.003)

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(32 * (FAULT_STEP + 6), 16, generator=g), torch.randn(16, 4, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x @ w).argmax(1)), batch_size=32)
    callback = TensorLensCallback(save_interval=1, dynamics=True, histograms=False, backends=["local"])
    trainer = ns.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Lit(), loader)

    result = tl.explain(callback.run_dir)
    assert result.event is not None and result.event.kind == "loss spike", result.message
    assert result.event.tensor == "losses/loss"
    top = result.causes[0]
    assert in_layer(top.tensor.replace("/net.", "/")), [str(c) for c in result.causes[:5]]
    assert abs(top.onset_step - FAULT_STEP) <= 1, top


def test_hugging_face_trainer_nan_through_one_modules_input(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tensorlens.integrations.transformers import TensorLensCallback

    vocab, seq, fault_batch = 50, 8, 24
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=vocab, n_positions=seq)
    )
    target = model.transformer.h[1].mlp.c_fc
    batches = {"seen": 0}

    def count(module: nn.Module, args: Any) -> None:
        batches["seen"] += 1

    def poison(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        if batches["seen"] - 1 != fault_batch:
            return None
        poisoned = args[0].clone()
        poisoned[0, 0, 0] = float("nan")
        return (poisoned,)

    model.register_forward_pre_hook(count)
    target.register_forward_pre_hook(poison)
    tokens = torch.randint(0, vocab, (4 * (fault_batch + 4), seq), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=fault_batch + 3,
        logging_steps=1,
        learning_rate=1e-3,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    callback = TensorLensCallback(save_interval=1, dynamics=True, histograms=False, backends=["local"])
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()

    result = tl.explain(callback.run_dir)
    saved = tl.open_run(callback.run_dir).steps()
    assert result.event is not None and result.event.kind == "non-finite", result.message
    assert result.event.step == saved[fault_batch], (result.event, saved[:3])
    top = result.causes[0]
    assert top.tensor == "activations/transformer.h.1.mlp.c_fc/sample_norm", [str(c) for c in result.causes[:5]]
    assert top.statistic == "nan_count" and top.onset_step == result.event.step
