"""How ``tensorlens compare`` and ``tensorlens rules`` scale with the size of a stored run.

Run it from the repository root::

    python benchmarks/read_scale.py                              # 5,000 tensors x 100 steps
    python benchmarks/read_scale.py --tensors 5000 --steps 2000  # the issue's size (about 4 GB)
    python benchmarks/read_scale.py --store /tmp/big --keep      # build once, time again later
    python benchmarks/read_scale.py --profile compare            # cProfile's top entries instead

Method: a synthetic run is written with tensorlens' own writer (``RunStoreWriter``), one record
per step, shaped like a large model's default record: every tensor has the default statistics
(min, max, mean, std, l2, numel, nan_count, inf_count), and every ``--histogram-every``-th one a
histogram of ``--bins`` bins. Then ``compare_runs(store, store)`` and
``invoke(store, <the default rules>)`` run once each, in this process, and the report gives
their time per step and per tensor-step (one tensor at one step), which is what a larger store
costs (both read step by step, so the time grows with what is read and the memory does not).
A shared machine's noise moves the numbers by tens of percent: compare within one session.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorlens as tl  # noqa: E402
from tensorlens import rules as R  # noqa: E402
from tensorlens.rules.builtin import BUILTIN_RULES, DEFAULT_RULES  # noqa: E402
from tensorlens.store.writer import RunStoreWriter  # noqa: E402

STATS = ("min", "max", "mean", "std", "l2", "numel", "nan_count", "inf_count")
COLLECTIONS = ("weights", "biases", "gradients", "activations")


def build(folder: str, tensors: int, steps: int, bins: int = 32, histogram_every: int = 2) -> float:
    """Write the synthetic run into ``folder``; returns the seconds it took."""
    names = [f"{COLLECTIONS[i % len(COLLECTIONS)]}/layer{i // len(COLLECTIONS)}.w" for i in range(tensors)]
    names.append("losses/loss")
    scalar_names = tuple((n, s) for n in names[:-1] for s in STATS) + (("losses/loss", ""),)
    histogram_names = tuple((n, bins) for n in names[:-1:histogram_every])
    rng = np.random.default_rng(0)
    base = rng.uniform(0.1, 1.0, size=(tensors, len(STATS)))  # a healthy model: no rule fires
    base[:, 0] *= -1.0  # min
    base[:, 5] = 1000.0  # numel
    base[:, 6:8] = 0.0  # no NaN or Inf
    counts = rng.integers(0, 100, size=len(histogram_names) * bins)
    edges = np.concatenate([np.linspace(-1.0, 1.0, bins + 1)] * len(histogram_names))
    info = np.tile(np.array([-1.0, 1.0, 100.0 * bins, 0.0, 1.0, 0, 0, 0, 0, 0, 0]), (len(histogram_names), 1))
    os.makedirs(folder, exist_ok=True)
    started = time.perf_counter()
    writer = RunStoreWriter(os.path.join(folder, "tensorlens.sqlite"))
    for step in range(steps):
        values = np.append((base * (1.0 + 0.01 * step)).ravel(), 1.0 / (1 + step))
        values[5::len(STATS)] = 1000.0
        values[6:-1:len(STATS)] = 0.0
        values[7:-1:len(STATS)] = 0.0
        writer.write(tl.StepRecord.from_arrays(
            step, "train", step, "worker_0", 1e9 + step, scalar_names=scalar_names, scalar_values=values,
            histogram_names=histogram_names, counts=counts, edges=edges, histogram_info=info,
        ))
        if step % 50 == 49:
            print(f"  built {step + 1}/{steps} steps", file=sys.stderr)
    writer.close()
    return time.perf_counter() - started


def measure(folder: str) -> dict[str, float]:
    """Seconds for one ``compare_runs`` of the store with itself and one default ``rules`` pass."""
    out = {}
    started = time.perf_counter()
    result = R.compare_runs(folder, folder)
    out["compare"] = time.perf_counter() - started
    assert result.equal, result.summary()
    started = time.perf_counter()
    R.invoke(folder, [BUILTIN_RULES[n]() for n in DEFAULT_RULES])
    out["rules"] = time.perf_counter() - started
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=5000)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--bins", type=int, default=32)
    parser.add_argument("--histogram-every", type=int, default=2, help="a histogram for every n-th tensor")
    parser.add_argument("--store", help="build (or reuse) the store here instead of a temporary folder")
    parser.add_argument("--keep", action="store_true", help="keep the store given by --store")
    parser.add_argument("--profile", choices=("compare", "rules"), help="print cProfile's top entries of one")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    folder = args.store or tempfile.mkdtemp(prefix="tensorlens-scale-")
    try:
        built = None
        if not os.path.exists(os.path.join(folder, "tensorlens.sqlite")):
            built = build(folder, args.tensors, args.steps, args.bins, args.histogram_every)
        size = os.path.getsize(os.path.join(folder, "tensorlens.sqlite"))
        with tl.open_run(folder) as run:
            steps, tensors = len(run.steps()), len(run.tensor_names())
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            R.compare_runs(folder, folder) if args.profile == "compare" else R.invoke(
                folder, [BUILTIN_RULES[n]() for n in DEFAULT_RULES])
            profile.disable()
            pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
            return
        times = measure(folder)
        # the peak of this whole process (the build too): flat in --steps when reading streams
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        report = {"tensors": tensors, "steps": steps, "store_mb": size / 1e6, "build_s": built, "peak_rss_mb": peak}
        for key, seconds in times.items():
            report[f"{key}_s"] = seconds
            report[f"{key}_ms_per_step"] = 1e3 * seconds / steps
            report[f"{key}_us_per_tensor_step"] = 1e6 * seconds / (steps * tensors)
            report[f"{key}_s_at_5000x2000"] = seconds / (steps * tensors) * 5000 * 2000
        if args.json:
            print(json.dumps(report, indent=2))
            return
        for key, value in report.items():
            print(f"{key:<32} {'-' if value is None else format(value, '.4g')}")
    finally:
        if not (args.store and args.keep):
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
