"""How fast ``tensorlens sync`` replays a stored run into each tracker, and what a second sync costs.

Run it from the repository root::

    python benchmarks/sync.py                         # every target, readable table
    python benchmarks/sync.py --steps 50 --targets tensorboard --json

Method: one run is recorded first (``tl.watch`` on an MLP of ``--layers`` linear layers, every
step saved with 64-bin histograms of weights, biases and gradients, ``--steps`` steps, into the
local store only). Then, for each target, in a temporary folder: a first sync of the whole run
(a new tracker run: W&B offline, MLflow on a SQLite store, TensorBoard event files), and a
second sync with nothing new. Times are wall clock, including opening and closing the tracker
run (W&B starts its service process; that is most of a short sync). Nothing asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

import tensorlens as tl
from tensorlens.sync import sync_run

TARGETS = ("tensorboard", "wandb", "mlflow")


def record(run_dir: str, steps: int, layers: int) -> tuple[int, int, int]:
    """The run to sync; returns (records, scalars per record, histograms per record)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(64, 64), nn.ReLU())])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tl.watch(model, save_interval=1, backends=["local"], out_dir=run_dir):
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(32, 64)).pow(2).mean().backward()
            opt.step()
    with tl.open_run(run_dir) as run:
        first = next(run.records())
        return len(run.step_keys()), len(first.scalar_names), len(first.histogram_names)


def options(target: str, folder: str) -> dict[str, Any]:
    if target == "wandb":
        return {"offline": True, "wandb_dir": folder, "project": "tensorlens-bench"}
    if target == "mlflow":
        return {"tracking_uri": f"sqlite:///{os.path.join(folder, 'mlflow.db')}", "experiment": "bench",
                "artifact_location": os.path.join(folder, "artifacts")}
    return {"logdir": os.path.join(folder, "tb")}


def run_benchmark(steps: int, layers: int, targets: list[str]) -> dict[str, Any]:
    os.environ.setdefault("WANDB_SILENT", "true")
    out: dict[str, Any] = {"steps": steps, "layers": layers, "targets": {}}
    with tempfile.TemporaryDirectory(prefix="tensorlens-sync-bench-") as tmp:
        records, scalars, histograms = record(os.path.join(tmp, "run"), steps, layers)
        out.update(records=records, scalars_per_record=scalars, histograms_per_record=histograms)
        for target in targets:
            folder = os.path.join(tmp, target)
            os.makedirs(folder)
            started = time.perf_counter()
            first = sync_run(os.path.join(tmp, "run"), target, progress=False, **options(target, folder))
            first_s = time.perf_counter() - started
            started = time.perf_counter()
            again = sync_run(os.path.join(tmp, "run"), target, progress=False, **options(target, folder))
            again_s = time.perf_counter() - started
            out["targets"][target] = {
                "records": first.records_sent, "first_s": round(first_s, 3),
                "records_per_s": round(first.records_sent / first_s, 1), "again_records": again.records_sent,
                "again_s": round(again_s, 3),
            }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run_benchmark(args.steps, args.layers, args.targets)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['records']} records of {result['scalars_per_record']} scalars and "
          f"{result['histograms_per_record']} histograms (64 bins) each")
    print(f"{'target':<12} {'first sync':>11} {'records/s':>10} {'again (nothing new)':>20}")
    for target, row in result["targets"].items():
        print(f"{target:<12} {row['first_s']:>10.2f}s {row['records_per_s']:>10.1f} {row['again_s']:>19.2f}s")


if __name__ == "__main__":
    main(sys.argv[1:])
