"""Runs the report, explorer and CLI tests read: written straight through the store writer
(hostile names, NaNs, long runs). The fixtures are in conftest.py."""

from __future__ import annotations

import os

import numpy as np

from tensorlens.records import HISTOGRAM_INFO, StepRecord
from tensorlens.store.writer import RunStoreWriter

HOSTILE = "<img src=x onerror=alert(1)>"


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
