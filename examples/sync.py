"""Record a run with no tracker at all, then replay it into MLflow and W&B: ``tensorlens sync``.

A cluster without network, or a run started before a tracker was chosen: tensorlens keeps every
saved step in its local run store, and ``tensorlens sync`` replays it through the same backends
a live run uses. Syncing again later sends only the steps recorded since. CPU, seconds.

    python examples/sync.py [OUT_DIR]            # default: examples/output/sync/

The same from a shell::

    tensorlens sync OUT_DIR/run --to mlflow --tracking-uri sqlite:///OUT_DIR/mlflow.db
    tensorlens sync OUT_DIR/run --to wandb --offline --wandb-dir OUT_DIR     # then: wandb sync <folder>
    tensorlens sync OUT_DIR/run --to tensorboard --logdir OUT_DIR/tb

``examples/output/`` is ignored by git.
"""

from __future__ import annotations

import os
import shutil
import sys

import torch
from torch import nn

import tensorlens as tl
from tensorlens.sync import sync_run

DEFAULT_OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "output", "sync")


def train(run_dir: str, steps: int, resume: str = "never", seed: int = 0) -> None:
    """A small classifier; every 10th step saved, an evaluation of 4 batches every 25 steps."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    teacher = torch.randn(16, 4)
    # backends=["local"]: no tracker, only the run store
    with tl.watch(model, loss_fn, save_interval=10, activations=True, backends=["local"], out_dir=run_dir,
                  run_name="offline-run", resume=resume):
        for step in range(steps):
            x = torch.randn(32, 16)
            loss = loss_fn(model(x), (x @ teacher).argmax(1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 25 == 24:
                model.eval()
                with torch.no_grad():
                    for _ in range(4):
                        x = torch.randn(32, 16)
                        loss_fn(model(x), (x @ teacher).argmax(1))
                model.train()


def main(out_dir: str = DEFAULT_OUT_DIR) -> None:
    from mlflow import MlflowClient

    shutil.rmtree(out_dir, ignore_errors=True)  # the example starts afresh each time
    run_dir = os.path.join(out_dir, "run")
    mlflow_uri = f"sqlite:///{os.path.join(out_dir, 'mlflow.db')}"
    targets = {
        "mlflow": {"tracking_uri": mlflow_uri, "experiment": "tensorlens-sync",
                   "artifact_location": os.path.join(out_dir, "mlflow-artifacts")},
        "wandb": {"offline": True, "wandb_dir": out_dir, "project": "tensorlens-sync"},
    }

    train(run_dir, steps=100)
    print(f"recorded {run_dir}: train steps {tl.open_run(run_dir).steps('train')}")
    for to, options in targets.items():
        result = sync_run(run_dir, to, progress=False, **options)
        print(f"\n[{to}] sent {result.records_sent} records to a new run {result.run_id}")
        print("\n".join(result.lines))

    # The run goes on; syncing again sends only the new steps, into the same tracker runs.
    train(run_dir, steps=50, resume="allow", seed=1)
    for to, options in targets.items():
        result = sync_run(run_dir, to, progress=False, **options)
        print(f"\n[{to}] again: {result.records_sent} new records, {result.already_sent} there already "
              f"(same run: {result.run_id})")
        if to == "wandb":
            print("\n".join(result.lines))

    # Read one series back from MLflow: the local store's values, at the same steps. Trackers get the
    # default payload (histograms, per-layer charts, global values, losses): the loss is there under
    # its documented key (tensorlens.backends.keys); TENSORLENS_TRACKER_STATS=all would send every statistic.
    client = MlflowClient(mlflow_uri)
    run_id = sync_run(run_dir, "mlflow", progress=False, **targets["mlflow"]).run_id
    key = "tensorlens-losses/crossentropyloss"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
    with tl.open_run(run_dir) as stored_run:
        stored = {step: stored_run.scalars(step)["losses/crossentropyloss"] for step in stored_run.steps("train")}
    print(f"\n{key} in MLflow: {[(s, round(v, 4)) for s, v in history]}")
    print(f"equal to the local store: {history == sorted(stored.items())}")
    params = client.get_run(run_id).data.params
    print(f"run metadata as MLflow params: {len([p for p in params if p.startswith('tensorlens.')])}, e.g. "
          f"tensorlens.model.parameters = {params['tensorlens.model.parameters']}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
