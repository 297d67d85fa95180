"""What writing and reading the run store cost, with every row checked (CRC-32, types, sizes).

Run it from the repository root::

    python benchmarks/store_read.py                  # 3000 steps of 441 scalars and 53 histograms
    python benchmarks/store_read.py --steps 500 --json

Method: one synthetic record per step, shaped like the README's reference MLP (63 tensors x 7
statistics, 53 histograms of 64 bins), written by ``RunStoreWriter`` on this thread (only the
write is timed: the records are built first), then read back through ``tl.open_run``. Each read
is repeated and the best time kept (the machine's noise only adds). Compare two checkouts by
running this file with each one's interpreter: the numbers move by tens of percent between runs
on a shared machine, so compare within one session.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np

import tensorlens as tl
from tensorlens.store.writer import RunStoreWriter

STATS = ("min", "max", "mean", "std", "l2", "numel", "nan_count")


def _best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def run(steps: int = 3000, tensors: int = 63, histograms: int = 53) -> dict[str, float]:
    """Milliseconds per operation (``write`` is per step)."""
    names = [f"weights/layer{i}.weight" for i in range(tensors)]
    rng = np.random.default_rng(0)
    records = [
        tl.StepRecord(
            step, "train", step, "worker_0", 1e9 + step,
            scalars=[tl.ScalarEntry(n, s, float(step)) for n in names for s in STATS],
            histograms=[tl.HistogramEntry(n, rng.integers(0, 9, 64), np.linspace(0, 1, 65), 0.0, 1.0, 100, 1.0, 1.0)
                        for n in names[:histograms]],
        )
        for step in range(steps)
    ]
    with tempfile.TemporaryDirectory() as folder:
        writer = RunStoreWriter(os.path.join(folder, "tensorlens.sqlite"))
        started = time.perf_counter()
        for record in records:
            writer.write(record)
        write = (time.perf_counter() - started) / steps
        writer.close()
        with tl.open_run(folder) as stored:
            view = stored.tensor(names[min(5, histograms - 1)])  # one with a histogram
            out = {
                "write per step": write,
                "open_run": _best(lambda: tl.open_run(folder).close(), 5),
                "steps()": _best(stored.steps, 5),
                "tensor_names()": _best(stored.tensor_names, 5),
                f"reduction_values over {steps} steps": _best(lambda: view.reduction_values("l2"), 3),
                "reduction_value at one step": _best(lambda: view.reduction_value(steps // 2, "l2"), 20),
                "histogram at one step": _best(lambda: view.histogram(steps // 2), 20),
                f"records() of {steps} steps": _best(lambda: sum(1 for _ in stored.records()), 1),
            }
    return {key: value * 1e3 for key, value in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.steps)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for key, ms in result.items():
        print(f"{key:<36} {ms:9.3f} ms")


if __name__ == "__main__":
    main()
