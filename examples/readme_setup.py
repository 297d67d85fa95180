"""The names the README's Python blocks use, defined once: paste this file, then any block.

A block of the README that starts with ``# names from examples/readme_setup.py: ...`` runs as
pasted after this file (``tests/test_readme.py`` runs each one so). It defines:

- ``model`` (a small classifier whose layers are ``fc1``, ``relu``, ``fc2``), ``loss_fn`` and
  ``train(model, steps=101)``, your training loop (SGD on random batches);
- with Lightning installed: ``LitModel`` (the same network as a ``LightningModule``) and
  ``loader``;
- with transformers installed: ``hf_model`` (a tiny GPT-2 built from a config, no download),
  ``training_args`` and ``train_dataset``.

Complete, runnable scripts for each way of plugging in: ``examples/quickstart.py``,
``examples/lightning_wandb.py``, ``examples/lightning_mlflow.py``, ``examples/hf_trainer.py``,
``examples/sync.py``, ``examples/ddp.py``.

    python examples/readme_setup.py      # trains the model a few steps and lists the names
"""

from __future__ import annotations

import torch
from torch import nn

import tensorlens as tl  # noqa: F401 - the README blocks use it

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x)))


model = Net()
loss_fn = nn.CrossEntropyLoss()


def train(model: nn.Module, steps: int = 101) -> None:
    """Your loop, as usual: SGD on random batches (tensorlens needs no call in it)."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


try:  # the Lightning block only: pip install lightning
    import lightning.pytorch as pl
except ImportError:
    pl = None

if pl is not None:

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
    loader = torch.utils.data.DataLoader(data, batch_size=8)

try:  # the Hugging Face block only: pip install transformers
    import transformers
except ImportError:
    transformers = None

if transformers is not None:
    hf_model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    )
    try:
        training_args = transformers.TrainingArguments(
            output_dir="runs/hf", max_steps=4, per_device_train_batch_size=2, report_to=[],
            save_strategy="no", logging_steps=1, use_cpu=True, disable_tqdm=True,
        )
    except ImportError:  # the Trainer also needs accelerate
        transformers = None
    tokens = torch.randint(0, 50, (8, 12))
    train_dataset = [{"input_ids": row, "labels": row} for row in tokens]


if __name__ == "__main__":
    train(model, steps=3)
    defined = ["tl", "torch", "nn", "model", "loss_fn", "train"]
    defined += ["LitModel", "loader"] if pl is not None else []
    defined += ["hf_model", "training_args", "train_dataset"] if transformers is not None else []
    print("defined:", ", ".join(defined))
