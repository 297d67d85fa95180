"""Run stores written by the previous release (schema 3, before per-row checksums) still read.

``data/schema3_run`` was written by tensorlens at commit c3f22d1 and ``data/schema3_expected.json``
holds what that release's own reader read back (``data/make_schema3_run.py`` made both). Every
test works on a copy in ``tmp_path``: SQLite may create files beside a database it opens.
"""

from __future__ import annotations

import gc
import glob
import hashlib
import json
import logging
import math
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import tensorlens as tl
from tensorlens.store.files import last_steps

DATA = Path(__file__).parent / "data"


@pytest.fixture
def old_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where converted copies go
    os.makedirs(tmp_path / "tmp")
    return Path(shutil.copytree(DATA / "schema3_run", tmp_path / "schema3_run"))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def copies(old_run: Path) -> list[str]:
    return glob.glob(str(old_run.parent / "tmp" / "tensorlens-schema3-*"))


def test_a_schema3_run_reads_as_its_own_release_read_it(old_run: Path) -> None:
    expected = json.loads((DATA / "schema3_expected.json").read_text())
    before = digest(old_run / "tensorlens.sqlite")
    run = tl.open_run(str(old_run))
    assert run.steps() == expected["steps"]
    assert sorted(run.tensor_names()) == expected["tensors"]
    assert len(expected["values"]) > 100
    for key, value in expected["values"].items():
        name, step, stat = key.split("|")
        found = run.tensor(name).reduction_value(int(step), stat)
        assert found == value or (math.isnan(found) and math.isnan(value)), key  # the same bits
    for key, histogram in expected["histograms"].items():
        name, step = key.split("|")
        counts, edges, info = run.tensor(name).histogram_with_info(int(step))
        assert counts.tolist() == histogram["counts"] and edges.tolist() == histogram["edges"]
        assert info == histogram["info"]  # the info columns mean what they meant
    # raw tensors (np.save blobs) and shapes, as the release read them
    assert len(expected["raw"]) == 6
    for key, values in expected["raw"].items():
        name, step = key.split("|")
        assert run.read_tensor(name, int(step)).tensor.tolist() == values, key
    for name, shape in expected["shapes"].items():
        assert run.shape(name) == tuple(shape)
    assert run.meta["run_name"] and json.loads(run.meta["config"]) == {"include_workers": "reduce"}
    # the one record type, as for a new store: three train steps and the eval step
    records = list(run.records())
    assert [(str(r.mode), r.mode_step) for r in records] == [("train", 0), ("train", 1), ("train", 2), ("eval", 0)]
    assert records[1].scalar("scalars/lr", "") == pytest.approx(0.05)
    assert {t.tensor for t in records[2].tensors} == {"biases/0.bias", "biases/2.bias"}
    run.close()
    assert digest(old_run / "tensorlens.sqlite") == before  # read only: the user's file is unchanged
    assert os.listdir(old_run) == ["tensorlens.sqlite"]  # and nothing was written beside it


def test_the_converted_copy_lives_while_the_run_is_open(old_run: Path) -> None:
    run = tl.open_run(str(old_run))
    run.steps()
    assert len(copies(old_run)) == 1
    run.close()
    assert copies(old_run) == []


def test_a_schema3_run_has_ended_so_following_it_returns(old_run: Path, caplog: pytest.LogCaptureFixture) -> None:
    # the copy is a snapshot that never grows: a reader that follows a run until it ends must stop
    # (were it not marked ended, invoke would give up only at the timeout, and log that it did)
    caplog.set_level(logging.INFO)
    with tl.open_run(str(old_run)) as run:
        assert run.ended
        findings = tl.rules.invoke(run, tl.rules.create_rule("LossNotDecreasing"), wait=True, timeout=60, poll=60)
    assert findings == [] and "stopped following" not in caplog.text


def test_the_copy_is_removed_at_exit_of_a_run_never_closed(old_run: Path) -> None:
    # a process that reads an old run and exits without closing it (held by a global) leaves no copy
    program = "import sys, tensorlens as tl; RUN = tl.open_run(sys.argv[1]); print(len(RUN.steps()))"
    env = {**os.environ, "TMPDIR": str(old_run.parent / "tmp")}
    done = subprocess.run([sys.executable, "-c", program, str(old_run)], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "3"
    assert copies(old_run) == []


def damage(old_run: Path, *statements: str) -> None:
    db = sqlite3.connect(old_run / "tensorlens.sqlite")
    with db:
        for statement in statements:
            db.execute(statement)
    db.close()


def read_everything(path: Path) -> None:
    with tl.open_run(str(path)) as run:
        for record in run.records():  # every row read and checked
            record.scalar_dict()
            list(record.histograms)


@pytest.mark.parametrize(
    "statements, problem",
    [
        (["DROP TABLE shapes"], "missing"),
        (["ALTER TABLE scalars RENAME COLUMN data TO values_"], "columns"),
        (["ALTER TABLE shapes DROP COLUMN shape"], r"columns are \['tensor'\]"),
        # same names, another declared type: SQLite would turn the text '7' into 7 on the copy
        ([
            "CREATE TABLE steps2 (mode TEXT NOT NULL, mode_step INTEGER NOT NULL, worker TEXT NOT NULL, step TEXT NOT NULL,"
            " wall_time REAL NOT NULL, PRIMARY KEY (mode, mode_step, worker))",
            "INSERT INTO steps2 SELECT * FROM steps", "DROP TABLE steps", "ALTER TABLE steps2 RENAME TO steps",
        ], "step TEXT NOT NULL"),
        # no primary key: duplicate rows would be merged silently on the copy
        ([
            "CREATE TABLE layouts2 (id INTEGER, kind TEXT NOT NULL, names TEXT NOT NULL)",
            "INSERT INTO layouts2 SELECT * FROM layouts", "DROP TABLE layouts", "ALTER TABLE layouts2 RENAME TO layouts",
        ], "not declared as schema 3"),
        (["UPDATE steps SET step = 'three' WHERE mode_step = 1"], "train step 1 of worker_0.*column step holds str"),
        (["UPDATE scalars SET data = X'0102' WHERE mode_step = 2"], "train step 2 of worker_0.*2 bytes of data"),
        (["UPDATE layouts SET names = '[[\"a\", ' WHERE id = 1"], "layout 1.*not JSON"),
        (["UPDATE histograms SET counts = X'00' WHERE mode_step = 0"], "bytes of counts"),
        (["UPDATE tensors SET data = X'93' WHERE mode_step = 1"], "raw tensor"),
        (["UPDATE shapes SET shape = '[3, -1]'"], "shape"),
        (["UPDATE histograms SET counts = CAST(X'FFFFFFFFFFFFFFFF' || substr(counts, 9) AS BLOB) WHERE mode_step = 2"], "negative"),
    ],
)
def test_a_damaged_schema3_file_is_refused(old_run: Path, statements: list[str], problem: str) -> None:
    damage(old_run, *statements)
    with pytest.raises(tl.CorruptRunError, match=problem):
        read_everything(old_run)
    gc.collect()  # the run, held by the exception's frames until now
    assert copies(old_run) == []  # no copy outlives the run it was made for


def test_no_room_for_the_copy_is_said_up_front(old_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a full temporary folder is not a damaged store: an OSError that says what to do, and no copy
    full = shutil.disk_usage(tempfile.gettempdir())._replace(free=1000)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: full)
    with pytest.raises(OSError, match="set TMPDIR") as raised:
        tl.open_run(str(old_run)).steps()
    assert not isinstance(raised.value, tl.CorruptRunError)
    assert copies(old_run) == []


def test_another_schema_keeps_its_clear_error(old_run: Path) -> None:
    damage(old_run, "UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    with pytest.raises(tl.CorruptRunError, match="schema 2"):
        tl.open_run(str(old_run)).steps()
    assert copies(old_run) == []


def test_resuming_a_schema3_run_is_refused_with_the_version(old_run: Path) -> None:
    # a run is resumed by writing into its file: a schema-3 file is read-only history
    with pytest.raises(tl.CorruptRunError, match="schema 3"):
        last_steps(str(old_run / "tensorlens.sqlite"))
