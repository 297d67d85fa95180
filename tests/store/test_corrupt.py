"""The reader never trusts its file: every read of a damaged or hostile store either returns what
the intact store returns or raises ``tl.CorruptRunError`` naming the file, never hangs, never
returns garbage.

A real store is written by training a small model (scalars, histograms in two layouts, eval steps,
raw tensors, shapes), then copies of it are damaged in many ways: truncated, bytes flipped inside
blobs on disk, rows edited through SQL (with and without a recomputed checksum), layouts rewritten,
tables and rows deleted, files replaced by FIFOs, folders, symlink loops, other programs' databases.
Each copy is read completely, query by query, and each answer is compared with the intact store's.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import socket
import sqlite3
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens.store.schema import COLUMNS, row_checksum, select

pytestmark = pytest.mark.timeout(600)  # a hang fails the test instead of holding the suite


# ----------------------------------------------------------------------------- the intact store


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[str, Any]]]:
    """A run folder written by real training, and everything the reader returns for it."""
    folder = tmp_path_factory.mktemp("pristine") / "run"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))

    class ProbeIsZero(tl.rules.Rule):  # fires at step 0 (the probe is all zeros): findings are stored
        def invoke_at_step(self, record: tl.StepRecord) -> bool:
            return record.scalar("summaries/probe", "max") == 0.0

    hook = tl.Hook(
        out_dir=folder, backends=["local"], include_collections=["weights", "gradients", "activations", "summaries"],
        save_config=tl.SaveConfig(save_interval=2), histogram_config=tl.HistogramConfig(bins=8),
        rules=[ProbeIsZero(action=lambda finding: None)],
    )
    hook.register_module(model)
    hook.get_collection("summaries").reduction_config = tl.ReductionConfig(save_raw_tensor=True, save_shape=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        if step == 3:  # a module left out from here on: the steps after use a second layout
            hook.get_collection("activations").include(r"^0$")
        loss = model(torch.randn(5, 4)).pow(2).mean()
        tl.summarize_tensor("probe", torch.arange(6.0).reshape(2, 3) * step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        model(torch.randn(3, 4))
    hook.close()
    with tl.open_run(str(folder)) as run:
        answers = _read_everything(run)
    assert all(not isinstance(a, BaseException) for _, a in answers), answers
    assert dict(answers)["findings"] and dict(answers)["ended"] is True
    return folder, answers


def _read_everything(run: tl.Run) -> list[tuple[str, Any]]:
    """Every query of the reader, in a fixed order: ``(what, answer or the exception raised)``."""
    out: list[tuple[str, Any]] = []

    def ask(what: str, fn: Callable[[], Any]) -> Any:
        try:
            answer = fn()
        except tl.CorruptRunError as err:
            answer = err
        except KeyError as err:  # TensorNotFound: a legitimate answer when a name is not stored
            answer = ("not found", str(err))
        out.append((what, answer))
        return answer

    ask("meta", lambda: {k: v for k, v in run.meta.items() if k != "ended_at"})
    ask("ended", lambda: run.ended)
    ask("findings", lambda: [(f.rule, f.step, str(f.mode), f.tensor, f.message) for f in run.findings()])
    ask("step_keys", run.step_keys)
    ask("workers", run.workers)
    ask("modes", run.modes)
    for mode in (None, "train", "eval"):
        ask(f"steps {mode}", lambda mode=mode: run.steps(mode=mode))
    names = ask("tensor_names", run.tensor_names)
    ask("collections", run.collections)
    records = ask("records", lambda: [_plain(r) for r in run.records()])
    del records
    for step in (0, 2, 4):
        ask(f"scalars {step}", lambda step=step: run.scalars(step))
    ask("scalars eval 0", lambda: run.scalars(0, mode="eval"))
    for name in names if isinstance(names, list) else []:
        view = tl.TensorView(run, name)
        ask(f"{name} steps", view.steps)
        stats = ask(f"{name} reduction_names", view.reduction_names)
        for stat in (stats if isinstance(stats, list) else [])[:3]:
            ask(f"{name} {stat}", lambda view=view, stat=stat: view.reduction_values(stat))
        ask(f"{name} value", lambda view=view: view.values())
        for step in (0, 4):
            ask(f"{name} max {step}", lambda view=view, step=step: view.reduction_value(step, "max"))
            ask(f"{name} histogram {step}", lambda view=view, step=step: _plain(view.histogram_with_info(step)))
        ask(f"{name} shape", lambda name=name: run.shape(name))
    for step in (0, 2, 4):
        ask(f"raw {step}", lambda step=step: _plain(run.read_tensor("summaries/probe", step)))
    return out


def _plain(value: Any) -> Any:
    """Comparable form: arrays as (dtype, shape, bytes), records through their own equality."""
    if isinstance(value, np.ndarray):
        return (str(value.dtype), value.shape, value.tobytes())
    if isinstance(value, tl.StepRecord):
        return (value.step, str(value.mode), value.mode_step, value.worker, value.wall_time, value.scalar_names,
                _plain(value.scalar_values), value.histogram_names, _plain(value.counts), _plain(value.edges),
                _plain(value.histogram_info), [(t.tensor, _plain(t.value)) for t in value.tensors], dict(value.shapes))
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, *(_plain(v) for v in value)]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def _assert_correct_or_refused(damaged: Path, pristine_answers: list[tuple[str, Any]], label: str) -> int:
    """Read the damaged store completely; return how many answers were refusals."""
    try:
        run = tl.open_run(str(damaged))
    except tl.CorruptRunError as err:
        assert str(damaged) in str(err) or os.path.basename(str(damaged)) in str(err), err
        return len(pristine_answers)
    with run:
        answers = _read_everything(run)
    refused = 0
    wanted = dict(pristine_answers)
    for what, got in answers:
        if isinstance(got, tl.CorruptRunError):
            refused += 1
            assert "corrupt run store" in str(got), (label, what, got)
            continue
        assert what in wanted, f"{label}: asked {what!r}, which the intact store never led to"
        assert _plain(got) == _plain(wanted[what]), f"{label}: {what} returned garbage: {got!r} != {wanted[what]!r}"
    # fewer answers: a name list or step list was refused, so its follow-up queries were not asked
    return refused + max(0, len(pristine_answers) - len(answers))


def _copy(pristine_folder: Path, tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(pristine_folder, target)
    return target


def _db(folder: Path) -> Path:
    return folder / "tensorlens.sqlite"


# ----------------------------------------------------------------------------- damage on disk


def test_truncated_files_are_refused_or_read_correctly(pristine, tmp_path: Path) -> None:
    folder, answers = pristine
    size = _db(folder).stat().st_size
    rng = random.Random(0)
    cuts = sorted({1, 15, 16, 99, 100, 101, 511, 512, 4096, size - 1, *(rng.randrange(1, size) for _ in range(25))})
    refusals = 0
    for cut in cuts:
        damaged = _copy(folder, tmp_path, f"cut{cut}")
        with open(_db(damaged), "r+b") as file:
            file.truncate(cut)
        refusals += _assert_correct_or_refused(damaged, answers, f"truncated at {cut}") > 0
    assert refusals == len(cuts)  # every truncation loses pages that some query reads


def _blobs(db: Path) -> list[tuple[str, str, bytes]]:
    """Every blob and layout text of the store: ``(table, column, bytes as stored in the file)``."""
    out = []
    with sqlite3.connect(db) as con:
        for table, columns in COLUMNS.items():
            for name, kind in columns:
                if kind in (bytes, str) and name not in ("mode", "worker", "kind", "key"):
                    for (value,) in con.execute(f"SELECT {name} FROM {table}"):
                        raw = value if isinstance(value, bytes) else value.encode()
                        if len(raw) >= 8:
                            out.append((table, name, raw))
    con.close()
    return out


def test_bytes_flipped_inside_blobs_on_disk_are_refused(pristine, tmp_path: Path) -> None:
    """Damage where SQLite cannot see it (inside a blob or a layout's text): the row's checksum does."""
    folder, answers = pristine
    content = _db(folder).read_bytes()
    rng = random.Random(1)
    blobs = [b for b in _blobs(_db(folder)) if content.count(b[2]) == 1]  # found once in the file: unambiguous
    assert {table for table, _, _ in blobs} >= {"scalars", "histograms", "layouts", "tensors"}
    cases = rng.sample(blobs, min(60, len(blobs)))
    for i, (table, column, raw) in enumerate(cases):
        at = content.index(raw) + rng.randrange(len(raw))
        damaged = _copy(folder, tmp_path, f"flip{i}")
        data = bytearray(_db(damaged).read_bytes())
        data[at] ^= 1 << rng.randrange(8)
        _db(damaged).write_bytes(bytes(data))
        refused = _assert_correct_or_refused(damaged, answers, f"bit flipped in {table}.{column}")
        assert refused > 0, f"a bit flipped in {table}.{column} went unnoticed"


@pytest.mark.parametrize("seed", range(3))
def test_random_damage_anywhere_never_hangs_nor_raises_anything_else(pristine, tmp_path: Path, seed: int) -> None:
    """Bytes flipped anywhere (page headers, B-tree cells, free space): the reader answers or
    refuses with CorruptRunError; anything else (a crash, another exception, a hang) fails."""
    folder, answers = pristine
    rng = random.Random(100 + seed)
    size = _db(folder).stat().st_size
    for i in range(20):
        damaged = _copy(folder, tmp_path, f"random{i}")
        data = bytearray(_db(damaged).read_bytes())
        for _ in range(rng.choice([1, 4, 32])):
            data[rng.randrange(100, size)] ^= 1 << rng.randrange(8)
        _db(damaged).write_bytes(bytes(data))
        try:
            with tl.open_run(str(damaged)) as run:
                _read_everything(run)
        except tl.CorruptRunError:
            pass


# ----------------------------------------------------------------------------- edited rows and tables


def _edit(folder: Path, sql: str, args: tuple[Any, ...] = ()) -> None:
    con = sqlite3.connect(_db(folder))
    with con:
        con.execute(sql, args)
    con.close()


def _rewrite_row(folder: Path, table: str, change: Callable[[list[Any]], None], recompute: bool) -> None:
    """Change the first row of ``table``; with ``recompute``, give it a matching checksum (crafted)."""
    con = sqlite3.connect(_db(folder))
    rowid, *row = con.execute(f"SELECT rowid, {select(table)} FROM {table} ORDER BY rowid LIMIT 1").fetchone()
    values = row[:-1]
    change(values)
    crc = row_checksum(tuple(values)) if recompute else row[-1]
    names = [name for name, _ in COLUMNS[table]]
    with con:
        con.execute(f"UPDATE {table} SET {', '.join(f'{n} = ?' for n in names)}, crc = ? WHERE rowid = ?", (*values, crc, rowid))
    con.close()


def _change(values: list[Any], column: int) -> None:
    """Change one value a little: a bit of a text or blob, a number (far from any other row's:
    a key changed to another row's key would be refused by SQLite), a NULL to a text."""
    value = values[column]
    if isinstance(value, bytes):
        values[column] = bytes([value[0] ^ 1]) + value[1:]
    elif isinstance(value, str):
        values[column] = chr(ord(value[0]) ^ 1) + value[1:]
    elif isinstance(value, int):
        values[column] = value + 1000
    elif isinstance(value, float):
        values[column] = value * 2 + 1
    else:
        values[column] = "was NULL"


EDITS: dict[str, tuple[str, Callable[[list[Any]], None], bool]] = {
    # a value changed behind the checksum's back: refused by the checksum
    **{f"{table}.{name} changed": (table, lambda v, i=i: _change(v, i), False)
       for table, columns in COLUMNS.items() for i, (name, _) in enumerate(columns)},
    # crafted rows with a valid checksum: refused by the checks of types, sizes and values
    "a text where a step is expected": ("steps", lambda v: v.__setitem__(3, "7"), True),
    "an unknown mode": ("steps", lambda v: v.__setitem__(0, "bogus"), True),
    "an infinite wall time": ("steps", lambda v: v.__setitem__(4, math.inf), True),
    "a negative step": ("steps", lambda v: v.__setitem__(3, -1), True),
    "scalars one value short": ("scalars", lambda v: v.__setitem__(4, v[4][:-8]), True),
    "histogram counts one bin short": ("histograms", lambda v: v.__setitem__(4, v[4][:-8]), True),
    "a negative histogram count": ("histograms", lambda v: v.__setitem__(4, struct.pack("<q", -5) + v[4][8:]), True),
    "NaN as a histogram's count": ("histograms", lambda v: v.__setitem__(6, v[6][:16] + struct.pack("<d", math.nan) + v[6][24:]), True),
    "1.5 values binned": ("histograms", lambda v: v.__setitem__(6, v[6][:16] + struct.pack("<d", 1.5) + v[6][24:]), True),
    "a scalars row naming a histograms layout": ("scalars", lambda v: v.__setitem__(3, 2), True),
    "a row naming a missing layout": ("scalars", lambda v: v.__setitem__(3, 999), True),
    "a layout that is not JSON": ("layouts", lambda v: v.__setitem__(2, "[[\"a\", "), True),
    "a layout of the wrong shape": ("layouts", lambda v: v.__setitem__(2, json.dumps({"a": 1})), True),
    "a layout with one name less": ("layouts", lambda v: v.__setitem__(2, json.dumps(json.loads(v[2])[:-1])), True),
    "a layout of an unknown kind": ("layouts", lambda v: v.__setitem__(1, "tensors"), True),
    "a raw tensor that is not npy": ("tensors", lambda v: v.__setitem__(6, b"not an array at all"), True),
    "a raw tensor of objects": ("tensors", lambda v: v.__setitem__(6, b"\x93NUMPY\x01\x00v\x00{'descr': '|O', 'fortran_order': False, 'shape': (2,), }" + b" " * 52 + b"\n" + b"\0" * 16), True),
    "a shape that is not a list of sizes": ("shapes", lambda v: v.__setitem__(1, "[-3, \"x\"]"), True),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_edited_rows_are_refused(pristine, tmp_path: Path, edit: str) -> None:
    folder, answers = pristine
    table, change, recompute = EDITS[edit]
    damaged = _copy(folder, tmp_path, "edited")
    _rewrite_row(damaged, table, change, recompute)
    assert _assert_correct_or_refused(damaged, answers, edit) > 0, f"{edit}: nothing was refused"


@pytest.mark.parametrize("table", sorted(COLUMNS))
def test_a_deleted_table_is_refused(pristine, tmp_path: Path, table: str) -> None:
    folder, answers = pristine
    damaged = _copy(folder, tmp_path, "dropped")
    _edit(damaged, f"DROP TABLE {table}")
    with pytest.raises(tl.CorruptRunError, match=rf"tables \['{table}'\] are missing"):
        tl.open_run(str(damaged))


def test_deleted_rows_are_refused_where_they_are_needed(pristine, tmp_path: Path) -> None:
    folder, answers = pristine
    damaged = _copy(folder, tmp_path, "no-layout")
    _edit(damaged, "DELETE FROM layouts WHERE id = 1")
    assert _assert_correct_or_refused(damaged, answers, "a layout deleted") > 0
    damaged = _copy(folder, tmp_path, "no-version")
    _edit(damaged, "DELETE FROM meta WHERE key = 'schema_version'")
    with pytest.raises(tl.CorruptRunError, match="it has tables but no schema version"):
        tl.open_run(str(damaged))


# ----------------------------------------------------------------------------- not a store at all


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
def test_a_fifo_is_refused_without_opening_it(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    os.mkfifo(folder / "tensorlens.sqlite")  # opening it for reading would block until a writer came
    with pytest.raises(tl.CorruptRunError, match=r"tensorlens.sqlite: it is a FIFO, not a store file"):
        tl.open_run(str(folder))
    with pytest.raises(tl.CorruptRunError, match="it is a FIFO, not a run folder or a store file"):
        tl.open_run(str(folder / "tensorlens.sqlite"))


def test_paths_that_are_not_stores_are_refused_clearly(pristine, tmp_path: Path) -> None:
    folder, _ = pristine
    cases: dict[str, tuple[Path, str]] = {}

    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    cases["symlink loop"] = (loop, "it cannot be opened: Too many levels of symbolic links")

    holder = tmp_path / "folder-as-file"
    (holder / "tensorlens.sqlite").mkdir(parents=True)
    cases["a folder named like the store"] = (holder, "it is a folder, not a store file")

    text = tmp_path / "text" / "tensorlens.sqlite"
    text.parent.mkdir()
    text.write_text("hello, I am not a database\n" * 10)
    cases["a text file"] = (text.parent, "it is not an SQLite database")

    huge = tmp_path / "huge" / "tensorlens.sqlite"
    huge.parent.mkdir()
    with open(huge, "wb") as file:
        file.truncate(8 << 30)  # 8 GiB of zeros, sparse: only the header is ever read
    cases["a huge file of zeros"] = (huge.parent, "it is not an SQLite database")

    header_only = tmp_path / "short" / "tensorlens.sqlite"
    header_only.parent.mkdir()
    header_only.write_bytes(_db(folder).read_bytes()[:60])
    cases["a file shorter than an SQLite header"] = (header_only.parent, "it is truncated")

    other = tmp_path / "other" / "tensorlens.sqlite"
    other.parent.mkdir()
    con = sqlite3.connect(other)
    with con:
        con.execute("CREATE TABLE moz_places (id INTEGER PRIMARY KEY, url TEXT)")
        con.execute("INSERT INTO moz_places (url) VALUES ('https://example.org')")
    con.close()
    cases["an SQLite database of another program"] = (other.parent, r"an SQLite database of another program \(its tables: \['moz_places'\]\)")

    if hasattr(socket, "AF_UNIX") and len(str(tmp_path)) < 90:
        sock_dir = tmp_path / "sock"
        sock_dir.mkdir()
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(sock_dir / "tensorlens.sqlite"))
        cases["a socket"] = (sock_dir, "it is a socket, not a store file")

    for label, (path, message) in cases.items():
        with pytest.raises(tl.CorruptRunError, match=message):
            tl.open_run(str(path))
        print(f"{label}: refused")
    with pytest.raises(FileNotFoundError):
        tl.open_run(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no tensorlens run store"):
        tl.open_run(str(tmp_path / "empty"))


def test_a_store_being_created_reads_as_empty_then_as_written(tmp_path: Path) -> None:
    """A worker's file that exists but holds nothing yet is not damage: it reads as empty."""
    from tensorlens.store.writer import RunStoreWriter

    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "tensorlens-worker_1.sqlite").touch()
    writer = RunStoreWriter(str(folder / "tensorlens.sqlite"))
    writer.write(tl.StepRecord(0, "train", 0, "worker_0", 1.0, scalars=[tl.ScalarEntry("scalars/x", None, 2.0)]))
    with tl.open_run(str(folder)) as run:
        assert run.steps() == [0] and run.workers() == ["worker_0"]
        late = RunStoreWriter(str(folder / "tensorlens-worker_1.sqlite"))  # it starts while the reader is open
        late.write(tl.StepRecord(1, "train", 1, "worker_1", 2.0, scalars=[tl.ScalarEntry("scalars/x", None, 3.0)]))
        assert run.steps() == [0, 1] and run.workers() == ["worker_0", "worker_1"]
        assert run.tensor("scalars/x").values(worker="worker_1") == {1: 3.0}
    writer.close()
    late.close()


def test_paths_with_uri_characters_open(tmp_path: Path) -> None:
    """The reader opens SQLite through a URI: '?', '#' and '%' in a folder name are not syntax."""
    from tensorlens.store.writer import RunStoreWriter

    folder = tmp_path / "odd ?name #1 %41"
    writer = RunStoreWriter(str(folder / "tensorlens.sqlite"))
    writer.write(tl.StepRecord(0, "train", 0, "worker_0", 1.0, scalars=[tl.ScalarEntry("scalars/x", None, 2.0)]))
    writer.close()
    with tl.open_run(str(folder)) as run:
        assert run.tensor("scalars/x").values() == {0: 2.0}


if sys.platform == "win32":  # pragma: no cover - FIFOs, sockets and sparse files are POSIX here
    pytestmark = [pytestmark, pytest.mark.skip(reason="POSIX file kinds")]


def test_no_false_alarm_while_a_writer_adds_steps_layouts_and_shapes(tmp_path: Path) -> None:
    """Reads racing a writer (new steps, new layouts, new shapes, raw tensors, a replaced step)
    see a consistent store every time: nothing raised, and at the end everything is there."""
    import threading

    from tensorlens.store.writer import RunStoreWriter

    folder = tmp_path / "run"
    writer = RunStoreWriter(str(folder / "tensorlens.sqlite"))
    steps = 150

    def record(step: int) -> tl.StepRecord:
        names = [f"weights/w{i}" for i in range(1 + step % 7)]  # a new layout every few steps
        return tl.StepRecord(
            step, "train", step, "worker_0", 1000.0 + step,
            scalars=[tl.ScalarEntry(n, "l2", float(step)) for n in names],
            histograms=[tl.HistogramEntry(n, np.array([step, 1]), np.array([0.0, 0.5, 1.0]), 0.0, 1.0, step + 1, 1.0, 1.0)
                        for n in names[:2]],
            tensors=[tl.TensorEntry(f"summaries/t{step % 3}", np.full(3, float(step)))],
            shapes={n: (step % 5 + 1,) for n in names},
        )

    writer.write(record(0))
    done = threading.Event()

    def write() -> None:
        try:
            for step in range(1, steps):
                writer.write(record(step))
            writer.write(record(steps - 1))  # the last step written again: replaced, not doubled
        finally:
            done.set()

    thread = threading.Thread(target=write)
    thread.start()
    reads = 0
    with tl.open_run(str(folder)) as run:
        while not done.is_set() or reads < 3:
            seen = run.steps()
            assert seen == list(range(len(seen)))
            run.tensor_names()
            run.tensor("weights/w0").reduction_values("l2")
            for r in run.records(start_step=max(0, len(seen) - 3)):
                assert r.scalar_values.tolist() == [float(r.step)] * (1 + r.step % 7)
            run.shape("weights/w0")
            reads += 1
        thread.join()
        assert run.steps() == list(range(steps))
        assert run.tensor("weights/w0").reduction_values("l2") == {s: float(s) for s in range(steps)}
        assert run.read_tensor("summaries/t1", step=steps - 2).tensor.tolist() == [float(steps - 2)] * 3
        assert run.shape("weights/w0") == ((steps - 1) % 5 + 1,)
    writer.close()
    print(f"{reads} complete reads while {steps} steps were written")
