"""How fast ``tensorlens sync`` replays a stored run into each tracker, and what a second sync costs.

Run it from the repository root::

    python benchmarks/sync.py                         # every target, readable table
    python benchmarks/sync.py --steps 50 --targets tensorboard --json
    python benchmarks/sync.py --model gpt2 --steps 70 --targets mlflow --mlflow-server --tracker-stats default all

Method: one run is recorded first (``tl.watch`` on an MLP of ``--layers`` linear layers, every
step saved with 64-bin histograms of weights, biases and gradients, ``--steps`` steps, into the
local store only). Then, for each target, in a temporary folder: a first sync of the whole run
(a new tracker run: W&B offline, MLflow on a SQLite store, TensorBoard event files), and a
second sync with nothing new. Times are wall clock, including opening and closing the tracker
run (W&B starts its service process; that is most of a short sync). Nothing asserts a time.

``--model gpt2`` records the run of issue 24 instead: a 4-layer, 64-wide GPT-2 from config with
``activations=True, dynamics=True``, saved every 5 steps. ``--mlflow-server`` syncs to a real
``mlflow server`` (SQLite store, on 127.0.0.1, started here) over HTTP instead of a ``sqlite:///``
store; ``--tracker-stats`` syncs once per payload choice (interleaved, each into a new run of one store).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import torch
from torch import nn

import tensorlens as tl
from tensorlens.sync import sync_run

TARGETS = ("tensorboard", "wandb", "mlflow")


def record(run_dir: str, steps: int, layers: int, model_name: str = "mlp") -> tuple[int, int, int]:
    """The run to sync; returns (records, scalars per record, histograms per record)."""
    torch.manual_seed(0)
    if model_name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=32, bos_token_id=0, eos_token_id=0)
        gpt = GPT2LMHeadModel(config)
        opt = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
        with tl.watch(gpt, activations=True, dynamics=True, save_interval=5, backends=["local"], out_dir=run_dir):
            for _ in range(steps):
                tokens = torch.randint(0, 256, (2, 16))
                gpt(tokens, labels=tokens).loss.backward()
                opt.step()
                opt.zero_grad()
    else:
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


def options(target: str, folder: str, server: str | None = None) -> dict[str, Any]:
    if target == "wandb":
        return {"offline": True, "wandb_dir": folder, "project": "tensorlens-bench"}
    if target == "mlflow" and server:
        return {"tracking_uri": server, "experiment": f"bench-{os.path.basename(folder)}"}
    if target == "mlflow":
        return {"tracking_uri": f"sqlite:///{os.path.join(folder, 'mlflow.db')}", "experiment": "bench",
                "artifact_location": os.path.join(folder, "artifacts")}
    return {"logdir": os.path.join(folder, "tb")}


def start_mlflow_server(root: str) -> tuple[subprocess.Popen[bytes], str]:
    """A real ``mlflow server`` (SQLite store, its own process group) on a free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
               "--artifacts-destination", f"{root}/artifacts", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(os.path.join(root, "server.log"), "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with opener.open(f"{uri}/health", timeout=2):
                return process, uri
        except OSError:
            time.sleep(0.5)
    os.killpg(process.pid, signal.SIGTERM)
    raise RuntimeError(f"mlflow server did not start (see {root}/server.log)")


def run_benchmark(
    steps: int, layers: int, targets: list[str], model: str = "mlp", server: bool = False,
    tracker_stats: list[str] | None = None, run: str | None = None,
) -> dict[str, Any]:
    os.environ.setdefault("WANDB_SILENT", "true")
    out: dict[str, Any] = {"steps": steps, "layers": layers, "model": model, "targets": {}}
    process = None
    with tempfile.TemporaryDirectory(prefix="tensorlens-sync-bench-") as tmp:
        run_dir = run or os.path.join(tmp, "run")
        if run is None:
            record(run_dir, steps, layers, model)
        with tl.open_run(run_dir) as stored:
            first_record = next(stored.records())
            out.update(records=len(stored.step_keys()), scalars_per_record=len(first_record.scalar_names),
                       histograms_per_record=len(first_record.histogram_names))
        uri = None
        if server and "mlflow" in targets:
            process, uri = start_mlflow_server(tmp)
        try:
            for target in targets:
                for choice in tracker_stats or [None]:
                    name = target if choice is None else f"{target}:{choice}"
                    folder = os.path.join(tmp, name.replace(":", "-"))
                    os.makedirs(folder)
                    given = options(target, folder, uri if target == "mlflow" else None)
                    started = time.perf_counter()
                    first = sync_run(run_dir, target, progress=False, tracker_stats=choice, **given)
                    first_s = time.perf_counter() - started
                    started = time.perf_counter()
                    again = sync_run(run_dir, target, progress=False, tracker_stats=choice, **given)
                    again_s = time.perf_counter() - started
                    out["targets"][name] = {
                        "records": first.records_sent, "first_s": round(first_s, 3),
                        "records_per_s": round(first.records_sent / first_s, 1), "again_records": again.records_sent,
                        "again_s": round(again_s, 3),
                    }
        finally:
            if process is not None:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=30)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    parser.add_argument("--model", choices=("mlp", "gpt2"), default="mlp")
    parser.add_argument("--mlflow-server", action="store_true", help="sync to a real mlflow server over HTTP")
    parser.add_argument("--tracker-stats", nargs="+", default=None, help="payload choices to sync, e.g. default all")
    parser.add_argument("--run", default=None, help="sync this recorded run instead of recording one")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run_benchmark(args.steps, args.layers, args.targets, args.model, args.mlflow_server, args.tracker_stats, args.run)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['records']} records of {result['scalars_per_record']} scalars and "
          f"{result['histograms_per_record']} histograms (64 bins) each")
    print(f"{'target':<16} {'first sync':>11} {'records/s':>10} {'again (nothing new)':>20}")
    for target, row in result["targets"].items():
        print(f"{target:<16} {row['first_s']:>10.2f}s {row['records_per_s']:>10.1f} {row['again_s']:>19.2f}s")


if __name__ == "__main__":
    main(sys.argv[1:])
