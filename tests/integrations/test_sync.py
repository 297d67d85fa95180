"""``tensorlens sync`` against the real trackers: a run recorded live into W&B (offline),
TensorBoard and MLflow (a real server on loopback) is synced from its local store into new
tracker runs, and each synced run must equal the live one key for key and value for value.
A second sync sends only the steps recorded since, and nothing is ever sent twice (counted in
the event files and run files, which keep duplicates, unlike MLflow)."""

from __future__ import annotations

import math
import os
import sqlite3
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens.backends.keys import histogram_key, tracker_key
from tensorlens.engine.metadata import flatten
from tensorlens.store.schema import SCHEMA_VERSION
from tensorlens.sync import SyncError, sync_run
from tensorlens.sync.state import SyncState, locate

wandb = pytest.importorskip("wandb")
pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    HISTOGRAMS,
    SCALARS,
    TENSORS,
    EventAccumulator,
)

from tensorlens.integrations.tensorboard import TensorBoardBackend  # noqa: E402
from tensorlens.integrations.wandb import WandbBackend  # noqa: E402

try:  # tests/integrations may or may not be a package
    from .wandb_runfile import RunFile, read_run_dir, run_file_path
except ImportError:
    from wandb_runfile import RunFile, read_run_dir, run_file_path

SAVE_INTERVAL = 2


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # a sync must equal the live run and send every stored statistic: the whole payload
    monkeypatch.setenv("TENSORLENS_TRACKER_STATS", "all")
    yield
    if wandb.run is not None:
        wandb.finish()


def train(out_dir: str, backends: list[Any], steps: int, resume: str = "never", seed: int = 0) -> str:
    """A small MLP: ``steps`` optimizer steps (every ``SAVE_INTERVAL``-th saved), two eval
    batches after every third step; weights, gradients, activations, losses, histograms."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
    loss_fn = nn.MSELoss()
    hook = tl.watch(model, loss_fn, save_interval=SAVE_INTERVAL, activations=True, out_dir=out_dir,
                    backends=backends, resume=resume, histograms=tl.HistogramConfig(bins=8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        loss_fn(model(torch.randn(4, 5)), torch.randn(4, 2)).backward()
        opt.step()
        if step % 3 == 2:
            model.eval()
            with torch.no_grad():
                for _ in range(2):
                    loss_fn(model(torch.randn(4, 5)), torch.randn(4, 2))
            model.train()
    hook.close()
    assert all(s.failed == 0 and s.dropped == 0 for s in hook.backend_stats().values()), hook.backend_stats()
    return hook.run_dir


def same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


# ---------------------------------------------------------------------------------------- readers


def wandb_points(run_file: RunFile) -> dict[tuple[str, int, int | None], Any]:
    """``(key, tensorlens/step, mode step) -> value`` of every tensorlens value in the history;
    a point logged twice fails (W&B keeps both)."""
    points: dict[tuple[str, int, int | None], Any] = {}
    for row in run_file.history:
        if "tensorlens/step" not in row:
            continue
        for key, value in row.items():
            if not key.startswith("tensorlens") or key.endswith("/step") or key.endswith("_table"):
                continue
            section = key.split("/")[0].split("-")  # tensorlens.backends.keys: tensorlens-<mode>-<collection>
            mode = section[1] if len(section) > 1 and section[1] in ("eval", "predict", "global", "epoch") else None
            point = (key, row["tensorlens/step"], row.get(f"tensorlens-{mode}/step") if mode else None)
            assert point not in points, f"{point} logged twice"
            points[point] = value
    return points


def wandb_tables(run_file: RunFile) -> dict[str, Any]:
    """The last table logged under each key (what the chart shows)."""
    out = {}
    for row in run_file.history:
        for key, value in row.items():
            if key.endswith("_table"):
                out[key] = run_file.table(value)
    return out


def tb_events(log_dir: str) -> tuple[dict[tuple[str, int], list[float]], dict[tuple[str, int], list[Any]], EventAccumulator]:
    """``(tag, step) -> [values]`` of every scalar and histogram (lists: duplicates would show)."""
    events = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0, HISTOGRAMS: 0, TENSORS: 0})
    events.Reload()
    scalars: dict[tuple[str, int], list[float]] = {}
    for tag in events.Tags()["scalars"]:
        for e in events.Scalars(tag):
            scalars.setdefault((tag, e.step), []).append(e.value)
    histograms: dict[tuple[str, int], list[Any]] = {}
    for tag in events.Tags()["histograms"]:
        for e in events.Histograms(tag):
            v = e.histogram_value
            histograms.setdefault((tag, e.step), []).append((v.min, v.max, v.num, v.sum, tuple(v.bucket_limit), tuple(v.bucket)))
    return scalars, histograms, events


def the_one_folder(parent: str) -> str:
    found = [os.path.join(parent, d) for d in os.listdir(parent)]
    assert len(found) == 1, found
    return found[0]


# ---------------------------------------------------------------------------------------- W&B


def test_wandb_sync_equals_the_live_run(tmp_path: Any) -> None:
    live = wandb.init(dir=str(tmp_path / "live"), project="sync-tests")
    run_dir = train(str(tmp_path / "run"), [WandbBackend(run=live)], steps=9)
    wandb.finish()
    stored = tl.open_run(run_dir)
    records = list(stored.records())

    result = sync_run(run_dir, "wandb", project="sync-tests", offline=True, wandb_dir=str(tmp_path / "synced"),
                      progress=False)
    assert result.new_run and result.metadata_sent and result.already_sent == 0
    # train steps 0 2 4 6 8; eval mode steps 0 2 4 (three evaluations of two batches)
    assert result.records_sent == len(records) == 5 + 3
    assert result.sent == {("train", "worker_0"): 5, ("eval", "worker_0"): 3}

    live_file = read_run_dir(str(tmp_path / "live"))
    synced_file = read_run_dir(str(tmp_path / "synced"))
    live_points, synced_points = wandb_points(live_file), wandb_points(synced_file)
    assert synced_points.keys() == live_points.keys()
    assert all(same(synced_points[k], live_points[k]) for k in live_points)
    # every statistic of every stored record is there (histograms as exact bins)
    for record in records:
        mode_step = record.mode_step if record.mode != tl.ModeKeys.TRAIN else None
        for entry in record.scalars:
            assert same(synced_points[(tracker_key("tensorlens", record.mode, None, entry.key), record.step, mode_step)], entry.value)
        for h in record.histograms:
            logged = synced_points[(histogram_key("tensorlens", record.mode, None, h.tensor), record.step, mode_step)]
            assert logged["values"] == h.counts.tolist() and logged["bins"] == h.edges.tolist()
    # the custom charts too, built from the same records
    assert wandb_tables(synced_file) == wandb_tables(live_file) != {}
    # the metadata, under the tensorlens key of the run config, as the live run got it
    assert synced_file.config["tensorlens"] == live_file.config["tensorlens"] == stored.metadata()
    assert stored.metadata()["model"]["parameters"] == 5 * 6 + 6 + 6 * 2 + 2
    stored.close()

    # the synced run is an ordinary offline run folder: the command to upload it is printed
    folder = os.path.dirname(run_file_path(str(tmp_path / "synced")))
    assert result.lines[-1].strip() == f"wandb sync {folder}"


def test_wandb_sync_again_sends_only_new_steps_and_charts_continue(tmp_path: Any) -> None:
    run_dir = train(str(tmp_path / "run"), ["local"], steps=5)
    first = sync_run(run_dir, "wandb", project="p", offline=True, wandb_dir=str(tmp_path / "wb"), progress=False)
    nothing = sync_run(run_dir, "wandb", project="p", offline=True, wandb_dir=str(tmp_path / "wb"), progress=False)
    assert nothing.records_sent == 0 and nothing.already_sent == first.records_sent and nothing.run_id == first.run_id
    train(run_dir, ["local"], steps=5, resume="allow", seed=1)  # the run goes on: 5 more steps
    second = sync_run(run_dir, "wandb", project="p", offline=True, wandb_dir=str(tmp_path / "wb"), progress=False)
    assert second.run_id == first.run_id and not second.new_run
    with tl.open_run(run_dir) as stored:
        total = len(stored.step_keys())
    assert first.records_sent + second.records_sent == total and second.already_sent == first.records_sent

    # the sync with nothing new opened no W&B run: two offline folders, uploaded in order
    assert second.lines[-1].split()[:6] == ["wandb", "sync", "--id", first.run_id, "-p", "p"]
    folders = second.lines[-1].split()[-2:]
    assert len(os.listdir(tmp_path / "wb" / "wandb")) == 2 + 3  # the folders, latest-run, debug logs
    files = [read_run_dir(folder) for folder in folders]  # waits for the service to finish each file
    points = [wandb_points(f) for f in files]
    assert not points[0].keys() & points[1].keys()  # never a point twice
    with tl.open_run(run_dir) as stored:
        merged = {**points[0], **points[1]}
        for record in stored.records():
            mode_step = record.mode_step if record.mode != tl.ModeKeys.TRAIN else None
            for entry in record.scalars:
                assert same(merged.pop((tracker_key("tensorlens", record.mode, None, entry.key), record.step, mode_step)), entry.value)
        train_steps = stored.steps("train")
    # nothing else was sent (but the derived global count of NaN/Inf, tensorlens.backends.payload)
    assert all(key.endswith(("/histogram", "/nonfinite_count")) for key, _, _ in merged)
    # the profile chart of the last session covers the whole run, not only its own steps
    profile = wandb_tables(files[1])["tensorlens-gradients/per-layer/l2_table"]
    assert sorted({row[0] for row in profile["data"]}) == train_steps
    # each session's folder carries the metadata (each is uploaded on its own)
    assert all(f.config["tensorlens"]["model"]["parameters"] == 50 for f in files)


# ---------------------------------------------------------------------------------------- TensorBoard


def test_tensorboard_sync_equals_the_live_run_and_never_duplicates(tmp_path: Any) -> None:
    live_dir = str(tmp_path / "live-tb")
    run_dir = train(str(tmp_path / "run"), [TensorBoardBackend(log_dir=live_dir)], steps=6)
    result = sync_run(run_dir, "tensorboard", logdir=str(tmp_path / "tb"), progress=False)
    folder = the_one_folder(str(tmp_path / "tb"))
    assert os.path.basename(folder) == result.run_id
    live_scalars, live_histograms, live_events = tb_events(live_dir)
    synced_scalars, synced_histograms, synced_events = tb_events(folder)
    assert synced_scalars == live_scalars and synced_histograms == live_histograms
    assert all(len(v) == 1 for v in synced_scalars.values())
    # the metadata: a text table and this run's hparams
    assert "tensorlens/metadata/text_summary" in synced_events.Tags()["tensors"]
    text = synced_events.Tensors("tensorlens/metadata/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| model.parameters | 50 |" in text
    assert text == live_events.Tensors("tensorlens/metadata/text_summary")[0].tensor_proto.string_val[0].decode()

    # more steps, then sync twice: every (tag, step) exactly once, the new ones included
    train(run_dir, ["local"], steps=4, resume="allow", seed=3)
    again = sync_run(run_dir, "tensorboard", logdir=str(tmp_path / "tb"), progress=False)
    assert sync_run(run_dir, "tensorboard", logdir=str(tmp_path / "tb"), progress=False).records_sent == 0
    assert again.run_id == result.run_id and again.records_sent > 0
    scalars, histograms, events = tb_events(folder)
    assert all(len(v) == 1 for v in scalars.values()) and all(len(v) == 1 for v in histograms.values())
    with tl.open_run(run_dir) as stored:
        expected = Counter()
        for record in stored.records():
            step = record.step if record.mode == tl.ModeKeys.TRAIN else record.mode_step
            for entry in record.scalars:
                expected[(tracker_key("tensorlens", record.mode, None, entry.key), step)] += 1
                assert scalars[(tracker_key("tensorlens", record.mode, None, entry.key), step)] == [pytest.approx(np.float32(entry.value), nan_ok=True)]
    derived = {k for k in scalars if k[0].endswith("/nonfinite_count")}  # the payload's global count of NaN/Inf
    assert Counter({k: len(v) for k, v in scalars.items() if k not in derived}) == expected
    assert len(events.Tensors("tensorlens/metadata/text_summary")) == 1  # sent with the new run only


def test_every_worker_file_is_replayed(tmp_path: Any) -> None:
    """A run folder with a file per worker (``include_workers="all"``): each worker's records
    reach the tracker under its own keys, and each worker's progress is kept apart."""
    run_dir = train(str(tmp_path / "run"), ["local"], steps=4)
    with tl.open_run(run_dir) as stored:
        records = list(stored.records())
    # worker 1's file, as a second rank writes it (its own LocalBackend)
    from tensorlens.backends.local import LocalBackend

    worker = LocalBackend()
    worker.open(tl.RunInfo("r", run_dir, rank=1, world_size=2))
    for r in records:
        worker.write(r.replace(worker="worker_1", scalar_values=r.scalar_values * 2))
    worker.close()
    result = sync_run(run_dir, "tensorboard", logdir=str(tmp_path / "tb"), progress=False)
    assert result.sent == {("train", "worker_0"): 2, ("eval", "worker_0"): 1, ("train", "worker_1"): 2, ("eval", "worker_1"): 1}
    scalars, _, _ = tb_events(the_one_folder(str(tmp_path / "tb")))
    key = "gradients/0.weight/l2"
    for step in (0, 2):
        own, other = (scalars[(tracker_key("tensorlens", "train", None, key), step)][0],
                      scalars[(tracker_key("tensorlens", "train", "worker_1", key), step)][0])
        assert other == pytest.approx(2 * own)
    with SyncState(state_path(run_dir)) as state:
        assert state.progress(result.target) == {
            ("train", "worker_0"): (2, 2), ("eval", "worker_0"): (0, 3),
            ("train", "worker_1"): (2, 2), ("eval", "worker_1"): (0, 3),
        }


class FailingTensorBoard(TensorBoardBackend):
    """A real TensorBoard backend whose disk 'fills up' (or whose user presses Ctrl-C) after
    ``fail_after`` records."""

    def __init__(self, fail_after: int, error: BaseException, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_after = fail_after
        self.error = error

    def write(self, record: Any) -> None:
        if self.fail_after == 0:
            raise self.error
        self.fail_after -= 1
        super().write(record)


@pytest.mark.parametrize("error", [OSError("No space left on device"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_a_sync_that_stops_midway_continues_without_resending(tmp_path: Any, error: BaseException) -> None:
    from tensorlens.integrations.sync_targets import TensorBoardTarget

    class Flaky(TensorBoardTarget):
        def start(self, run_name: str, run_id: str | None) -> tuple[Any, str]:
            backend, run_id = super().start(run_name, run_id)
            return FailingTensorBoard(7, error, log_dir=backend.log_dir), run_id

    run_dir = train(str(tmp_path / "run"), ["local"], steps=10)
    tables = _table_sql(run_dir)
    expected = (SyncError, "stopped after 7 new records.*No space left") if isinstance(error, OSError) else (KeyboardInterrupt, None)
    with pytest.raises(expected[0], match=expected[1]):
        sync_run(run_dir, Flaky(logdir=str(tmp_path / "tb")), progress=False, checkpoint_every=3)
    rest = sync_run(run_dir, "tensorboard", logdir=str(tmp_path / "tb"), progress=False)
    with tl.open_run(run_dir) as stored:
        assert rest.already_sent == 7 and rest.records_sent == len(stored.step_keys()) - 7
    scalars, histograms, _ = tb_events(the_one_folder(str(tmp_path / "tb")))
    assert all(len(v) == 1 for v in scalars.values()) and all(len(v) == 1 for v in histograms.values())
    # the store is only read: the same tables, and the reader's checks still pass
    assert _table_sql(run_dir) == tables
    with tl.open_run(run_dir) as stored:
        assert stored.meta["schema_version"] == SCHEMA_VERSION
        assert len(list(stored.records())) == rest.already_sent + rest.records_sent


def state_path(run_dir: str) -> str:
    """The sync state of a run folder (beside its store, see tensorlens.sync.state)."""
    return locate(os.path.join(run_dir, "tensorlens.sqlite")).path


def _table_sql(run_dir: str) -> dict[str, str]:
    db = sqlite3.connect(os.path.join(run_dir, "tensorlens.sqlite"))
    try:
        return dict(db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'"))
    finally:
        db.close()


# ---------------------------------------------------------------------------------------- options and CLI


def test_bad_options_fail_before_anything_is_sent(tmp_path: Any) -> None:
    run_dir = train(str(tmp_path / "run"), ["local"], steps=1)
    with pytest.raises(ValueError, match="Expected `logdir` to be None with --to wandb"):
        sync_run(run_dir, "wandb", logdir="tb")
    with pytest.raises(ValueError, match="Expected `logdir` to be the folder TensorBoard reads"):
        sync_run(run_dir, "tensorboard")
    with pytest.raises(ValueError, match="Expected `to` to be one of"):
        sync_run(run_dir, "neptune")
    with pytest.raises(FileNotFoundError, match="no tensorlens run"):
        sync_run(str(tmp_path / "nothing"), "tensorboard", logdir="tb")
    with pytest.raises(ValueError, match="checkpoint_every"):
        sync_run(run_dir, "tensorboard", logdir="tb", checkpoint_every=0)
    assert not os.path.exists("tb")


def test_command_line(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("click")
    from tensorlens.cli import main

    run_dir = train(str(tmp_path / "run"), ["local"], steps=3)
    assert main(["sync", run_dir, "--to", "tensorboard", "--logdir", str(tmp_path / "tb"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "tensorlens sync: 3 new records" in out and "created run" in out
    assert "eval/worker_0: 1, train/worker_0: 2" in out
    assert f"tensorboard --logdir {tmp_path / 'tb'}" in out
    assert main(["sync", run_dir, "--to", "tensorboard", "--logdir", str(tmp_path / "tb")]) == 0
    assert "0 new records" in capsys.readouterr().out
    assert main(["sync", run_dir, "--to", "tensorboard", "--logdir", str(tmp_path / "tb"), "--new-run"]) == 0
    assert "3 new records" in capsys.readouterr().out
    with tl.open_run(run_dir) as stored:
        name = stored.meta["run_name"]
    assert sorted(os.listdir(tmp_path / "tb")) == [name, name + "-2"]  # a new run never shares a folder
    # errors: one line each, exit code 1 (2 for a usage error), no traceback
    assert main(["sync", run_dir, "--to", "wandb", "--logdir", "x"]) == 1
    err = capsys.readouterr().err
    assert "Error: Expected `logdir` to be None with --to wandb" in err and "Traceback" not in err
    (tmp_path / "empty").mkdir()
    assert main(["sync", str(tmp_path / "empty"), "--to", "tensorboard", "--logdir", "tb"]) == 1
    assert "Error: no tensorlens run" in capsys.readouterr().err
    assert main(["sync", str(tmp_path / "missing"), "--to", "tensorboard", "--logdir", "tb"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["sync", run_dir, "--to", "neptune"]) == 2
    assert main(["sync", "--help"]) == 0
    assert "--tracking-uri" in capsys.readouterr().out


def test_two_runs_of_one_model_have_one_metadata_key_set(tmp_path: Any) -> None:
    a = train(str(tmp_path / "a"), ["local"], steps=1)
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    hook = tl.Hook(out_dir=str(tmp_path / "b"), save_config=tl.SaveConfig(save_interval=7, end_step=100),
                   reduction_config=tl.ReductionConfig(reductions=["max"], norms=[]),
                   include_collections=["gradients"], backends=["local"])
    hook.register_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    model(torch.randn(2, 5, dtype=torch.float64)).sum().backward()
    opt.step()
    hook.close()
    with tl.open_run(a) as ra, tl.open_run(hook.run_dir) as rb:
        ma, mb = flatten(ra.metadata()), flatten(rb.metadata())
    assert ma.keys() == mb.keys()
    assert ma["model.dtype"] == "float32" and mb["model.dtype"] == "float64"
    assert mb["config.save.train.end_step"] == 100 and ma["config.save.train.end_step"] is None


# ---------------------------------------------------------------------------------------- rule findings


def train_dead_relu(out_dir: str, backends: list[Any], steps: int, resume: str = "never") -> list[Any]:
    """A net whose ReLUs are all dead: VanishingGradient fires on three tensors every saved step."""
    from tensorlens import rules as R

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    runner = R.RuleRunner([R.VanishingGradient()])
    hook = tl.Hook(out_dir=out_dir, save_config=tl.SaveConfig(save_interval=1), backends=[*backends, runner],
                   include_collections=["weights", "biases", "gradients"], resume=resume)
    hook.register_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    hook.close()
    return runner.findings()


def tb_texts(log_dir: str) -> list[tuple[str, int, str]]:
    events = EventAccumulator(str(log_dir), size_guidance={TENSORS: 0})
    events.Reload()
    return sorted(
        (tag, e.step, e.tensor_proto.string_val[0].decode())
        for tag in events.Tags()["tensors"] if "/rules/" in tag for e in events.Tensors(tag)
    )


@pytest.mark.filterwarnings("ignore::tensorlens.rules.RuleWarning")
def test_rule_findings_are_replayed_like_live_and_sent_once(tmp_path: Any) -> None:
    live = wandb.init(dir=str(tmp_path / "live"), project="sync-tests")
    found = train_dead_relu(str(tmp_path / "run"), [WandbBackend(run=live), TensorBoardBackend(log_dir=str(tmp_path / "live-tb"))], 4)
    wandb.finish()
    assert len(found) == 12
    run_dir = str(tmp_path / "run")
    with tl.open_run(run_dir) as stored:
        assert [str(f) for f in stored.findings()] == [str(f) for f in found]

    to_wandb = {"project": "sync-tests", "offline": True, "wandb_dir": str(tmp_path / "wb"), "progress": False}
    first = sync_run(run_dir, "wandb", **to_wandb)
    tb = sync_run(run_dir, "tensorboard", logdir=str(tmp_path / "tb"), progress=False)
    assert first.findings_sent == tb.findings_sent == 12
    # TensorBoard: the same text entries as live; W&B: the same alerts (once per tensor) and summary
    assert tb_texts(the_one_folder(str(tmp_path / "tb"))) == tb_texts(str(tmp_path / "live-tb"))
    live_file = read_run_dir(str(tmp_path / "live"))
    synced_file = read_run_dir(first.lines[-1].split()[-1])
    assert sorted(a["text"] for a in synced_file.alerts) == sorted(a["text"] for a in live_file.alerts)
    assert len(synced_file.alerts) == 3
    rules = {k: v for k, v in synced_file.summary.items() if "/rules/" in k}
    assert rules == {k: v for k, v in live_file.summary.items() if "/rules/" in k}
    assert rules["tensorlens/rules/VanishingGradient/count"] == 12

    # two more steps, six more findings: only they are sent, and the counts go on
    more = train_dead_relu(run_dir, ["local"], 2, resume="allow")
    assert len(more) == 6
    again = sync_run(run_dir, "wandb", **to_wandb)
    tb_again = sync_run(run_dir, "tensorboard", logdir=str(tmp_path / "tb"), progress=False)
    assert again.findings_sent == tb_again.findings_sent == 6
    second_file = read_run_dir(again.lines[-1].split()[-1])
    assert second_file.alerts == []  # those tensors were alerted on already
    assert second_file.summary["tensorlens/rules/VanishingGradient/count"] == 18
    texts = tb_texts(the_one_folder(str(tmp_path / "tb")))
    assert len(texts) == len(set(texts)) == 18
    assert sync_run(run_dir, "tensorboard", logdir=str(tmp_path / "tb"), progress=False).findings_sent == 0


def test_a_damaged_sync_state_is_an_error_not_a_resend(tmp_path: Any) -> None:
    run_dir = train(str(tmp_path / "run"), ["local"], steps=3)
    first = sync_run(run_dir, "tensorboard", logdir=str(tmp_path / "tb"), progress=False)
    db = sqlite3.connect(state_path(run_dir))
    with db:  # a bit flipped on disk: the progress says less was sent than was
        db.execute("UPDATE sync_progress SET mode_step = mode_step - 2 WHERE mode = 'train'")
    db.close()
    with pytest.raises(tl.CorruptRunError, match="sync_progress.*--new-run"):
        sync_run(run_dir, "tensorboard", logdir=str(tmp_path / "tb"), progress=False)
    # --new-run starts that destination over, in a new folder
    fresh = sync_run(run_dir, "tensorboard", logdir=str(tmp_path / "tb"), progress=False, new_run=True)
    assert fresh.new_run and fresh.records_sent == first.records_sent and fresh.run_id == first.run_id + "-2"


def test_sync_benchmark_runs(tmp_path: Any) -> None:
    """``benchmarks/sync.py`` in its quickest form (no time is asserted)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks", "sync.py")
    spec = importlib.util.spec_from_file_location("tensorlens_benchmark_sync", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.run_benchmark(steps=3, layers=1, targets=["tensorboard"])
    assert result["records"] == 3 and result["histograms_per_record"] == 4
    row = result["targets"]["tensorboard"]
    assert row["records"] == 3 and row["again_records"] == 0 and row["records_per_s"] > 0
