"""Every Python block of the README runs, as written, against a small model (the names the blocks
use, ``model``, ``loss_fn``, ``train``, ``LitModel``, ``loader``, ``hf_model``, ... come from the
prelude below, built only for the blocks that use them)."""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch import nn

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def python_blocks() -> list[tuple[int, str]]:
    text = open(README, encoding="utf-8").read()
    out = []
    for match in re.finditer(r"```python\n(.*?)```", text, re.S):
        out.append((text.count("\n", 0, match.start()) + 1, match.group(1)))
    return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x)))


def prelude(code: str, tmp_path) -> dict[str, object]:
    import tensorlens as tl

    torch.manual_seed(0)
    model = Net()
    loss_fn = nn.CrossEntropyLoss()

    def train(model: nn.Module, steps: int = 101) -> None:
        """The user's loop: SGD on random batches."""
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(steps):
            x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    names: dict[str, object] = {"tl": tl, "torch": torch, "nn": nn, "model": model, "loss_fn": loss_fn, "train": train}
    if "LitModel" in code or "loader" in code:
        import lightning.pytorch as pl

        class LitModel(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = Net()

            def training_step(self, batch, batch_idx):
                x, y = batch
                return loss_fn(self.net(x), y)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.05)

        data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 4, (32,)))
        names.update(LitModel=LitModel, loader=torch.utils.data.DataLoader(data, batch_size=8))
    if "hf_model" in code:
        import transformers

        config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
        names["hf_model"] = transformers.GPT2LMHeadModel(config)
        names["training_args"] = transformers.TrainingArguments(
            output_dir=str(tmp_path / "hf"), max_steps=4, per_device_train_batch_size=2, report_to=[],
            save_strategy="no", logging_steps=1, use_cpu=True, disable_tqdm=True,
        )
        ids = torch.randint(0, 50, (8, 12))
        names["train_dataset"] = [{"input_ids": row, "labels": row} for row in ids]
    return names


@pytest.mark.parametrize("line, code", python_blocks(), ids=[f"line{line}" for line, _ in python_blocks()])
def test_readme_block_runs(line: int, code: str, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    namespace = prelude(code, tmp_path)
    try:
        exec(compile(code, f"README.md:{line}", "exec"), namespace)  # noqa: S102 - the README's own code
    finally:
        if "mlflow" in code:  # the block sets MLflow's process-wide tracking URI: give later tests theirs back
            import mlflow

            mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", ""))


def test_the_readme_states_no_placeholder() -> None:
    text = open(README, encoding="utf-8").read()
    assert "DYNAMICS_TABLE" not in text and "PERFORMANCE_TABLE" not in text
