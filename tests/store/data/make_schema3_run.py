"""Writes ``schema3_run/``: a small run stored by tensorlens 0.1.0 at commit c3f22d1 (run store schema 3,
before per-row checksums), and ``schema3_expected.json``: what that release's own reader read back.

It was run once, against that release, from a checkout of it::

    git worktree add /tmp/tl-c3f22d1 c3f22d1
    cd tests/store/data && PYTHONPATH=/tmp/tl-c3f22d1 python make_schema3_run.py

``tests/store/test_legacy.py`` opens the stored run with today's reader and compares.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.nn as nn

import tensorlens as tl

HERE = os.path.dirname(os.path.abspath(__file__))
RUN = os.path.join(HERE, "schema3_run")


def main() -> None:
    shutil.rmtree(RUN, ignore_errors=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = tl.Hook(
        out_dir=RUN, save_config=tl.SaveConfig(save_interval=1),
        include_collections=["weights", "biases", "gradients", "activations", "losses", "scalars"], backends=["local"],
        histogram_config=tl.HistogramConfig(bins=8),
    )
    hook.register_module(model)
    criterion = nn.MSELoss()
    hook.register_loss(criterion)
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    for step in range(3):
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        hook.save_scalar("lr", 0.1 / (step + 1))
        optimizer.step()
    hook.set_mode(tl.ModeKeys.EVAL)
    with torch.no_grad():
        model(x)
    hook.close()

    run = tl.open_run(RUN)
    expected = {"steps": run.steps(), "tensors": sorted(run.tensor_names()), "values": {}, "histograms": {}}
    for name in expected["tensors"]:
        view = run.tensor(name)
        for step in view.steps():
            for stat in ("mean", "l2", "min", "max", "std"):
                try:
                    expected["values"][f"{name}|{step}|{stat}"] = view.reduction_value(step, stat)
                except Exception:
                    pass
    counts, edges = run.tensor("gradients/0.weight").histogram(2)[:2]
    expected["histograms"]["gradients/0.weight|2"] = {"counts": [int(c) for c in counts], "edges": [float(e) for e in edges]}
    del run, view  # the release's reader holds the file open
    import gc

    gc.collect()
    # one file, no -wal/-shm beside it: the rollback journal (the rows are the release's own)
    import sqlite3

    db = sqlite3.connect(os.path.join(RUN, "tensorlens.sqlite"))
    db.execute("PRAGMA journal_mode=DELETE")
    db.execute("VACUUM")
    db.close()
    with open(os.path.join(HERE, "schema3_expected.json"), "w", encoding="utf-8") as file:
        json.dump(expected, file, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
