"""Writes ``schema3_run/``: a small run stored by tensorlens 0.1.0 at commit c3f22d1 (run store schema 3,
before per-row checksums), and ``schema3_expected.json``: what that release's own reader read back.

It was run once, against that release, from a checkout of it::

    git worktree add /tmp/tl-c3f22d1 c3f22d1
    cd tests/store/data && PYTHONPATH=/tmp/tl-c3f22d1 python make_schema3_run.py

``tests/store/test_legacy.py`` opens the stored run with today's reader and compares.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sqlite3

import torch
import torch.nn as nn

import tensorlens as tl

HERE = os.path.dirname(os.path.abspath(__file__))
RUN = os.path.join(HERE, "schema3_run")


def main() -> None:
    release = os.environ.get("PYTHONPATH", "")
    assert release and tl.__file__.startswith(release), f"run it with PYTHONPATH=<a checkout of c3f22d1>, not {tl.__file__}"
    shutil.rmtree(RUN, ignore_errors=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = tl.Hook(
        out_dir=RUN, save_config=tl.SaveConfig(save_interval=1),
        include_collections=["weights", "biases", "gradients", "activations", "losses", "scalars"], backends=["local"],
        histogram_config=tl.HistogramConfig(bins=8),
    )
    # biases (3 and 2 values) also store their raw tensor and shape: rows of ``tensors`` and ``shapes``
    hook.get_collection("biases").reduction_config = tl.ReductionConfig(save_raw_tensor=True, save_shape=True)
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
                except KeyError:  # a statistic its collection does not record (TensorNotFound)
                    pass
    counts, edges, info = run.tensor("gradients/0.weight").histogram_with_info(2)
    expected["histograms"]["gradients/0.weight|2"] = {
        "counts": [int(c) for c in counts], "edges": [float(e) for e in edges], "info": info,
    }
    expected["raw"] = {
        f"{name}|{step}": run.read_tensor(name, step).tensor.tolist() for name in ("biases/0.bias", "biases/2.bias")
        for step in run.steps()
    }
    expected["shapes"] = {name: list(run.shape(name)) for name in ("biases/0.bias", "biases/2.bias")}
    del run, view  # the release's reader holds the file open
    gc.collect()
    # one small file, no -wal/-shm beside it: the rollback journal, small pages (the rows are the release's own)
    db = sqlite3.connect(os.path.join(RUN, "tensorlens.sqlite"))
    db.execute("PRAGMA journal_mode=DELETE")
    db.execute("PRAGMA page_size=1024")  # applied by VACUUM: 1/4 of the file (mostly near-empty pages of 9 B-trees)
    db.execute("VACUUM")
    db.close()
    with open(os.path.join(HERE, "schema3_expected.json"), "w", encoding="utf-8") as file:
        json.dump(expected, file, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
