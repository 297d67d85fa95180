"""Runs for the report, explorer and CLI tests: one recorded by a real hook, one written with
hostile names and NaNs, both small."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens.records import HISTOGRAM_INFO, StepRecord
from tensorlens.store.writer import RunStoreWriter

HOSTILE = "<img src=x onerror=alert(1)>"


@pytest.fixture(scope="session")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small MLP trained 12 steps, every step saved, activations on, two eval passes."""
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("runs") / "mlp"
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = tl.watch(model, loss_fn, save_interval=1, activations=True, backends=["local"], out_dir=out)
    for step in range(12):
        x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step in (5, 11):
            model.eval()
            with torch.no_grad():
                loss_fn(model(torch.randn(16, 8)), torch.randint(0, 4, (16,)))
            model.train()
    hook.close()
    return hook.run_dir


def write_run(path: str, steps: int, names: list[str], meta: dict[str, str] | None = None,
              nan_steps: tuple[int, ...] = (), seed: int = 0) -> str:
    """A run store written directly: ``names`` tensors with min/max/mean/std/l2/nan/inf and
    16-bin histograms, a loss, ``steps`` train steps; the first gradient is NaN at ``nan_steps``."""
    rng = np.random.default_rng(seed)
    stats = ("min", "max", "mean", "std", "l2", "numel", "nan_count", "inf_count")
    scalar_names = tuple((t, s) for t in names for s in stats) + (("losses/loss", ""),)
    writer = RunStoreWriter(os.path.join(path, "tensorlens.sqlite"), meta or {})
    for step in range(steps):
        values = []
        counts, edges, infos = [], [], []
        for i, name in enumerate(names):
            data = rng.normal(scale=1.0 + i, size=500)
            row = [data.min(), data.max(), data.mean(), data.std(), np.linalg.norm(data), data.size, 0, 0]
            if step in nan_steps and name.startswith("gradients/") and i == names.index(next(n for n in names if n.startswith("gradients/"))):
                row[:5] = [np.nan] * 5
                row[6] = 3
            values += row
            c, e = np.histogram(data, bins=16)
            counts.append(c)
            edges.append(e)
            info = np.zeros(len(HISTOGRAM_INFO))
            info[:3] = data.min(), data.max(), data.size
            infos.append(info)
        values.append(2.0 / (1 + step))
        writer.write(StepRecord.from_arrays(
            step, "train", step, "worker_0", 1.7e9 + step, scalar_names=scalar_names, scalar_values=np.array(values),
            histogram_names=tuple((n, 16) for n in names), counts=np.concatenate(counts), edges=np.concatenate(edges),
            histogram_info=np.stack(infos),
        ))
    writer.close()
    return path


@pytest.fixture(scope="session")
def hostile_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Module, tensor and run names that are markup, a module list in the meta, NaN at steps 3-4."""
    path = str(tmp_path_factory.mktemp("runs") / "hostile")
    module = f"enc.{HOSTILE}"
    names = [f"weights/{module}.weight", f"gradients/{module}.weight", f"activations/{module}",
             "weights/enc.fc\"'&.weight", "gradients/enc.fc\"'&.weight"]
    modules = [
        {"name": "", "type": "Net", "extra_repr": ""},
        {"name": "enc", "type": "Encoder", "extra_repr": f"note={HOSTILE}"},
        {"name": module, "type": "Linear", "extra_repr": "in_features=4, out_features=4, bias=False",
         "parameters": {"weight": [4, 4]}, "call_order": 1},
        {"name": "enc.fc\"'&", "type": "Linear", "extra_repr": "in_features=4, out_features=2, bias=False",
         "parameters": {"weight": [2, 4]}, "call_order": 0},
    ]
    return write_run(path, 8, names, {"run_name": f"run {HOSTILE}", "modules": json.dumps(modules)}, nan_steps=(3, 4))
