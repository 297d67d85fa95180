"""Runs for the CLI tests, written straight through the store writer (no torch, no training):
a small run, one with every statistic, one whose names hold terminal control sequences."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tensorlens.records import StepRecord
from tensorlens.stats.registry import STATISTICS
from tensorlens.store.writer import RunStoreWriter

#: Names a hostile or broken writer could store: OSC 52 (writes the clipboard), OSC 0 (the window
#: title), ESC[2J (clears the screen), a bare CR (overwrites the line), a C1 CSI, a bidi override.
HOSTILE_NAMES = [
    "gradients/\x1b]52;c;aGVsbG8=\x07clip",
    "weights/\x1b]0;pwned\x07title",
    "activations/\x1b[2Jclear",
    "losses/over\rwrite",
    "weights/c1\x9b31mred",
    "weights/bidi\u202etxt.exe",
]
ENV = {**os.environ, "TENSORLENS_DEBUG": "0"}
ENV.pop("COLUMNS", None)


def write_store(path: str, names: list[str], stats: tuple[str, ...], steps: int = 3, seed: int = 0) -> str:
    """A run folder at ``path``: ``names`` with ``stats`` (and a plain loss) at ``steps`` train steps."""
    rng = np.random.default_rng(seed)
    os.makedirs(path, exist_ok=True)
    scalar_names = tuple((t, s) for t in names for s in stats) + (("losses/loss", ""),)
    writer = RunStoreWriter(os.path.join(path, "tensorlens.sqlite"), {})
    for step in range(steps):
        writer.write(StepRecord.from_arrays(step, "train", step, "worker_0", 1.7e9 + step, scalar_names=scalar_names,
                                            scalar_values=rng.random(len(scalar_names))))
    writer.close()
    return path


@pytest.fixture
def small_run(tmp_path) -> str:
    return write_store(str(tmp_path / "runs" / "small"), ["gradients/a.weight", "weights/a.weight"],
                       ("min", "max", "mean", "std", "l2", "nan_count", "inf_count"))


@pytest.fixture
def wide_run(tmp_path) -> str:
    """Every statistic tensorlens knows (27), for two tensors."""
    return write_store(str(tmp_path / "runs" / "wide"), ["gradients/encoder.layers.0.attention.q_proj.weight",
                                                         "weights/b"], tuple(STATISTICS))


@pytest.fixture
def hostile_run(tmp_path) -> str:
    return write_store(str(tmp_path / "runs" / "hostile"), HOSTILE_NAMES, ("l2", "max", "l2\x1b[2J"))


def cli(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess[str]:
    """``python -m tensorlens ARGS`` in a subprocess, output captured (not a terminal)."""
    return subprocess.run([sys.executable, "-m", "tensorlens", *args], capture_output=True, text=True,
                          env=env or ENV, timeout=120, **kwargs)
