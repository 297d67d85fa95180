"""Tiny real trainings for the rule tests: each runs a few full-batch steps of a small model
under a real Hook with an online RuleRunner, then the same rules read the stored run offline."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import tensorlens as tl
from tensorlens import rules as R

PARAMETER_COLLECTIONS = ["weights", "biases", "gradients", "losses", "scalars"]


def mlp(hidden: int = 16, out: int = 1, act: type[nn.Module] = nn.ReLU, seed: int = 0, inputs: int = 8) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(inputs, hidden), act(), nn.Linear(hidden, out))
    for layer in (model[0], model[2]):
        nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
        nn.init.zeros_(layer.bias)
    return model


def regression_data(n: int = 64, inputs: int = 8, scale: float = 1.0, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, inputs, generator=generator)
    w = torch.randn(inputs, 1, generator=generator)
    return x, scale * (x @ w)


def clusters(n: int = 90, classes: int = 3, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Well separated 2-D clusters, one per class."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % classes
    centres = torch.tensor([[4.0 * torch.cos(torch.tensor(2 * torch.pi * c / classes)).item(),
                             4.0 * torch.sin(torch.tensor(2 * torch.pi * c / classes)).item()] for c in range(classes)])
    return centres[labels] + 0.3 * torch.randn(n, 2, generator=generator), labels


class Training:
    """One watched training: ``hook`` (save every step), ``runner`` (the online rules), ``run_dir``."""

    def __init__(self, tmp_path: Any, name: str, rules: Sequence[R.Rule], collections: Sequence[str] = PARAMETER_COLLECTIONS,
                 reduction_config: tl.ReductionConfig | None = None, histogram_config: tl.HistogramConfig | None = None) -> None:
        self.run_dir = os.path.join(str(tmp_path), name)
        self.runner = R.RuleRunner(list(rules))
        self.hook = tl.Hook(out_dir=self.run_dir, save_config=tl.SaveConfig(save_interval=1), backends=[self.runner],
                            include_collections=list(collections), reduction_config=reduction_config,
                            histogram_config=histogram_config or tl.HistogramConfig(bins=16))

    def fit(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 12, lr: float = 0.05,
            loss_fn: nn.Module | None = None, batch: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
            after_step: Callable[[int], None] | None = None, optimizer: str = "sgd") -> None:
        """Full-batch training for ``steps`` steps; ``batch(step, x)`` may alter the inputs of a step."""
        loss_fn = self.loss_fn = loss_fn or nn.MSELoss()
        self.hook.register_module(model)
        self.hook.register_loss(loss_fn)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=lr) if optimizer == "adam" else torch.optim.SGD(params, lr=lr)
        for step in range(steps):
            opt.zero_grad()
            inputs = batch(step, x) if batch is not None else x
            loss_fn(model(inputs), y).backward()
            opt.step()
            if after_step is not None:
                after_step(step)

    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module | None = None) -> torch.Tensor:
        """One evaluation step (a forward in eval mode), with the registered loss by default."""
        loss_fn = loss_fn or self.loss_fn
        model.eval()
        with torch.no_grad():
            out = model(x)
            loss_fn(out, y)
        model.train()
        return out

    def close(self) -> list[R.Finding]:
        self.hook.close()
        return self.runner.findings()


def run(tmp_path: Any, name: str, make_rules: Callable[[], Sequence[R.Rule]], train: Callable[[Training], None],
        **training: Any) -> tuple[list, list, str]:
    """``(online findings, offline findings, run dir)`` of one scenario."""
    session = Training(tmp_path, name, make_rules(), **training)
    train(session)
    online = session.close()
    offline = R.invoke(session.run_dir, list(make_rules()))
    return online, offline, session.run_dir


def key(findings: Sequence[Any]) -> list[tuple[str, int, str, str | None]]:
    return sorted((f.rule, f.step, f.mode.value, f.tensor) for f in findings)
