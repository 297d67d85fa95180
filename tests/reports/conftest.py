"""Fixtures for the report, explorer and CLI tests: one run recorded by a real hook, one written
with hostile names and NaNs, both small."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens.findings import Finding
from tensorlens.store.writer import RunStoreWriter

try:
    from .browser import Browser
    from .health_runs import train_all
    from .report_runs import HOSTILE, write_names_run, write_run, write_scales_run
except ImportError:
    from browser import Browser
    from health_runs import train_all
    from report_runs import HOSTILE, write_names_run, write_run, write_scales_run


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
    write_run(path, 8, names, {"run_name": f"run {HOSTILE}", "modules": json.dumps(modules)}, nan_steps=(3, 4))
    writer = RunStoreWriter(os.path.join(path, "tensorlens.sqlite"))
    for step in (3, 4):  # what a NaN rule would have stored
        writer.write_finding(Finding("NaNTensor", step, "train", f"gradients/{module}.weight", f"3 NaN in {HOSTILE}", 3.0))
    writer.close()
    return path


@pytest.fixture(scope="session")
def scales_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small MLP watched with scales=True: per-op scales at every saved step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = tl.watch(model, save_interval=1, scales=True, backends=["local"],
                    out_dir=tmp_path_factory.mktemp("runs") / "scales")
    for _ in range(3):
        model(torch.randn(8, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    hook.close()
    return hook.run_dir


@pytest.fixture(scope="session")
def names_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Names that are JavaScript object members, separators, ``image``, long labels (see report_runs)."""
    return write_names_run(str(tmp_path_factory.mktemp("runs") / "names"))


@pytest.fixture(scope="session")
def odd_scales_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Per-op scales and statistics whose names hold separators or are ``image``."""
    return write_scales_run(str(tmp_path_factory.mktemp("runs") / "odd-scales"))


@pytest.fixture(scope="session")
def surrogate_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A store holding names with a lone surrogate (``layer\\udc80``), as an older writer stored them."""
    path = str(tmp_path_factory.mktemp("runs") / "surrogate")
    modules = [{"name": ""}, {"name": "layer\udc80", "type": "Linear\udc81", "extra_repr": "x=\udc82"}]
    write_run(path, 4, ["weights/layer\udc80.weight", "gradients/layer\udc80.weight", "losses/l\udc83"],
              {"modules": json.dumps(modules)})
    with tl.open_run(path) as run:
        assert "weights/layer\udc80.weight" in run.tensor_names()  # the store holds the surrogate itself
    return path


#: The step at which the dead and the NaN run break (see health_runs.py).
FAULT_STEP = 6


@pytest.fixture(scope="session")
def health_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A healthy MLP, a dead-ReLU collapse and a NaN run, trained from the same seed and data for 16
    steps (the last two break at step 6), every step saved with activations and dynamics."""
    return train_all(tmp_path_factory.mktemp("health"), steps=16, fault_step=FAULT_STEP)


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for a module of page tests (those marked ``BROWSER_TESTS``)."""
    with Browser() as b:
        yield b
