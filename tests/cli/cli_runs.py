"""Runs for the CLI tests, written straight through the store writer (no torch, no training), and
the CLI run in a subprocess. The fixtures over them are in conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from tensorlens.records import StepRecord
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


def cli(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess[str]:
    """``python -m tensorlens ARGS`` in a subprocess, output captured (not a terminal)."""
    return subprocess.run([sys.executable, "-m", "tensorlens", *args], capture_output=True, text=True,
                          env=env or ENV, timeout=120, **kwargs)
