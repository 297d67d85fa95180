"""The local run store: readable while written, intact after kill -9, names never become paths."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl


def test_readable_while_training_writes(tmp_path) -> None:
    model = nn.Linear(4, 2)
    hook = tl.watch(model, save_interval=1, out_dir=tmp_path / "run", backends=["local"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for _ in range(4):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        hook.flush()
        with tl.open_run(hook.run_dir) as run:  # a reader beside the live writer
            seen.append(run.steps())
    hook.close()
    assert seen == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]


CRASHING_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, torch
    import tensorlens as tl
    model = torch.nn.Linear(8, 4)
    hook = tl.watch(model, save_interval=1, out_dir=sys.argv[1], backends=["local"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 4:
            hook.flush()          # steps 0..4 are on disk
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_kill_9_keeps_every_flushed_step(tmp_path) -> None:
    script = tmp_path / "crash.py"
    script.write_text(CRASHING_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    with tl.open_run(str(tmp_path / "run")) as run:
        steps = run.steps()
        assert steps[:5] == [0, 1, 2, 3, 4]
        for step in steps:  # every step present is whole
            assert len(run.scalars(step)) == len(run.scalars(0))
        assert run.tensor("gradients/weight").reduction_value(step=4, name="l2") > 0


def test_hostile_names_stay_inside_the_run_folder(tmp_path) -> None:
    outside = tmp_path / "x"
    run_dir = tmp_path / "a" / "b" / "run"
    hook = tl.Hook(out_dir=run_dir, save_config=tl.SaveConfig(save_interval=1), include_collections=["summaries", "scalars"],
                   reduction_config=tl.ReductionConfig(save_raw_tensor=True))
    hook.save_tensor("../../x", torch.ones(3), collections_to_write="summaries")
    hook.save_scalar("../../../x", 1.0)
    hook.step()
    hook.close()
    assert not outside.exists()
    assert sorted(os.listdir(run_dir)) == [n for n in sorted(os.listdir(run_dir)) if n.startswith("tensorlens")]
    run = tl.open_run(str(run_dir))
    assert "summaries/../../x" in run.tensor_names()
    assert run.read_tensor("summaries/../../x", step=0).tensor.tolist() == [1.0, 1.0, 1.0]


def test_run_name_is_sanitised(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    hook = tl.Hook(run_name="../../evil/name")
    hook.close()
    assert os.path.dirname(hook.run_dir) == str(tmp_path / "tensorlens_runs")
    assert os.sep not in os.path.basename(hook.run_dir) and not os.path.basename(hook.run_dir).startswith(".")


def test_default_run_folder_and_reader_errors(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = nn.Linear(2, 2)
    with tl.watch(model, save_interval=1, backends=["local"]) as hook:
        model(torch.randn(1, 2)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert hook.run_dir.startswith(str(tmp_path / "tensorlens_runs"))
    run = tl.open_run(hook.run_dir)
    with pytest.raises(KeyError, match="no tensor"):
        run.tensor("gradients/nope")
    with pytest.raises(KeyError, match="its statistics:"):
        run.tensor("gradients/weight").reduction_value(step=0, name="median")
    with pytest.raises(FileNotFoundError):
        tl.open_run(str(tmp_path))


def test_nan_survives_the_store(tmp_path) -> None:
    hook = tl.Hook(out_dir=tmp_path / "run", save_config=tl.SaveConfig(save_interval=1), include_collections=["summaries"])
    hook.save_tensor("t", torch.tensor([1.0, float("nan")]), collections_to_write="summaries")
    hook.step()
    hook.close()
    view = tl.open_run(str(tmp_path / "run")).tensor("summaries/t")
    assert view.reduction_value(step=0, name="nan_count") == 1
    assert view.reduction_value(step=0, name="mean") != view.reduction_value(step=0, name="mean")  # NaN


def _record(step: int, tensors: list[str], value: float) -> tl.StepRecord:
    scalars = [tl.ScalarEntry(name, stat, value + i) for i, name in enumerate(tensors) for stat in ("mean", "l2")]
    scalars.append(tl.ScalarEntry("losses/loss", None, -value))
    histograms = [
        tl.HistogramEntry(name, np.arange(bins, dtype=np.int64) * (step + 1), np.linspace(-1.0, 1.0, bins + 1),
                          -1.0, 1.0, int(np.arange(bins).sum() * (step + 1)), 0.5, 2.5, nan_count=step, sampled=bool(step % 2))
        for name, bins in zip(tensors, (3, 5, 7), strict=False)
    ]
    return tl.StepRecord(step, tl.ModeKeys.TRAIN, step, "worker_0", 1000.0 + step, scalars=scalars, histograms=histograms)


def test_packed_rows_read_back_across_changing_layouts(tmp_path) -> None:
    # A step's scalars and histograms are packed into one row each, named by a layout; the set of
    # tensors changes between steps (a module not called, a collection switched on).
    from tensorlens.store.writer import RunStoreWriter

    writer = RunStoreWriter(str(tmp_path / "tensorlens.sqlite"))
    layouts = [["weights/a", "weights/b"], ["weights/a", "weights/b"], ["weights/b", "gradients/c"], ["weights/a", "weights/b"]]
    for step, names in enumerate(layouts):
        writer.write(_record(step, names, float(step)))
    writer.close()
    run = tl.open_run(str(tmp_path))
    assert run.tensor_names() == ["gradients/c", "losses/loss", "weights/a", "weights/b"]
    assert run.tensor("weights/a").reduction_values("mean") == {0: 0.0, 1: 1.0, 3: 3.0}
    assert run.tensor("weights/b").reduction_values("l2") == {0: 1.0, 1: 2.0, 2: 2.0, 3: 4.0}
    assert run.tensor("gradients/c").steps() == [2]
    assert run.tensor("losses/loss").values() == {0: -0.0, 1: -1.0, 2: -2.0, 3: -3.0}
    assert run.tensor("weights/b").reduction_names() == ["l2", "mean"]
    assert run.scalars(step=2) == {"weights/b/mean": 2.0, "weights/b/l2": 2.0, "gradients/c/mean": 3.0,
                                   "gradients/c/l2": 3.0, "losses/loss": -2.0}
    counts, edges, info = run.tensor("gradients/c").histogram_with_info(step=2)
    np.testing.assert_array_equal(counts, np.arange(5) * 3)
    np.testing.assert_array_equal(edges, np.linspace(-1.0, 1.0, 6))
    assert info == {"min": -1.0, "max": 1.0, "count": 30, "sum": 0.5, "sum_squares": 2.5, "nan_count": 2,
                    "inf_count": 0, "rejected": 0, "underflow": 0, "overflow": 0, "sampled": False}
    with pytest.raises(KeyError, match="no histogram"):
        run.tensor("weights/a").histogram(step=2)


def test_a_store_of_another_schema_is_refused_clearly(tmp_path) -> None:
    import sqlite3

    with sqlite3.connect(tmp_path / "tensorlens.sqlite") as db:
        db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        db.execute("INSERT INTO meta VALUES ('schema_version', '2')")
    with pytest.raises(tl.CorruptRunError, match="schema 2; this tensorlens reads schema 4 .open it with the tensorlens") as raised:
        tl.open_run(str(tmp_path))
    assert isinstance(raised.value, ValueError) and raised.value.table == "meta"


def test_one_record_per_step_reaches_every_backend_and_entries_store_the_same_bytes(tmp_path, monkeypatch) -> None:
    # A step is built once, as arrays, and every backend gets that same record; a record rebuilt
    # from its entry views (what a tracker iterates) must store exactly the same rows.
    import sqlite3

    from tensorlens.backends.local import LocalBackend
    from tensorlens.store.writer import RunStoreWriter

    received = []
    write = LocalBackend.write
    monkeypatch.setattr(LocalBackend, "write", lambda self, record: (received.append(record), write(self, record)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    memory = tl.MemoryBackend()
    hook = tl.Hook(
        out_dir=tmp_path / "packed", backends=["local", memory], include_collections=["all"],
        reduction_config=tl.ReductionConfig(reductions=("min", "max", "mean", "std", "median"), abs_reductions=("mean",),
                                            counts=("zero_fraction",), save_shape=True),
        save_config=tl.SaveConfig(save_interval=1),
    )
    hook.register_module(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(5, 6)
        if step == 2:
            x[0, 0] = float("nan")  # NaN counts and a histogram binned again with a finite mask
        loss = model(x).pow(2).mean()
        hook.save_scalar("lr_scale", 0.5 * step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            model(torch.randn(3, 6))  # an eval-free extra forward: activations of two calls merge
    hook.close()
    assert len(received) == 4 and all(a is b for a, b in zip(received, memory.records, strict=True))
    writer = RunStoreWriter(str(tmp_path / "records" / "tensorlens.sqlite"))
    for record in memory.records:
        writer.write(tl.StepRecord(record.step, record.mode, record.mode_step, record.worker, record.wall_time,
                                   scalars=record.scalars, histograms=record.histograms, tensors=record.tensors,
                                   shapes=record.shapes))
    writer.close()

    def rows(path):
        with sqlite3.connect(path) as db:
            return {table: sorted(db.execute(f"SELECT * FROM {table}").fetchall())
                    for table in ("steps", "layouts", "scalars", "histograms", "tensors", "shapes")}

    packed, reference = rows(tmp_path / "packed" / "tensorlens.sqlite"), rows(tmp_path / "records" / "tensorlens.sqlite")
    assert len(reference["scalars"]) == 4 and len(reference["histograms"]) == 4 and reference["shapes"]
    assert packed == reference


def test_records_read_back_equal_the_records_every_backend_received(tmp_path) -> None:
    # Run.records() yields the type live backends get: rules, reports and sync take one input
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
    memory = tl.MemoryBackend()
    hook = tl.Hook(out_dir=tmp_path, backends=["local", memory], include_collections=["all"],
                   reduction_config=tl.ReductionConfig(save_raw_tensor=True, save_shape=True),
                   save_config=tl.SaveConfig(save_interval=2))
    hook.register_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model(torch.randn(3, 4))  # the store keeps one shape per tensor (the last): same batch size here
    hook.close()
    run = tl.open_run(str(tmp_path))
    stored = list(run.records())
    order = [(r.step, list(tl.ModeKeys).index(r.mode), r.mode_step) for r in stored]
    assert order == sorted(order) and len(stored) == len(memory.records)
    live = sorted(memory.records, key=lambda r: (r.step, list(tl.ModeKeys).index(r.mode), r.mode_step))
    assert all(a == b for a, b in zip(live, stored, strict=True))
    assert [r.mode for r in run.records(mode="eval")] == [tl.ModeKeys.EVAL]
    assert [r.step for r in run.records(mode="train", start_step=1, end_step=4)] == [2]
