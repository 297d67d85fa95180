"""Shared test settings: W&B never goes online, runs land in pytest's tmp folders."""

from __future__ import annotations

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


import pytest  # noqa: E402


@pytest.fixture(params=["native", "torch"])
def kernel(request, monkeypatch):
    """Run a test with the compiled CPU kernel and with PyTorch ops alone (TENSORLENS_NATIVE=0):
    both must give the same, exact statistics."""
    from tensorlens.stats import native

    if request.param == "torch":
        monkeypatch.setenv("TENSORLENS_NATIVE", "0")
    native.reset()
    if request.param == "native" and not native.available():
        pytest.skip("no C compiler here: the compiled kernel is not built (PyTorch ops are used)")
    yield request.param
    monkeypatch.undo()
    native.reset()
