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
import math
import os
import shutil
import sqlite3
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
        counts, edges = run.tensor(name).histogram(int(step))[:2]
        assert counts.tolist() == histogram["counts"] and edges.tolist() == histogram["edges"]
    # the one record type, as for a new store: three train steps and the eval step
    records = list(run.records())
    assert [(str(r.mode), r.mode_step) for r in records] == [("train", 0), ("train", 1), ("train", 2), ("eval", 0)]
    assert records[1].scalar("scalars/lr", "") == pytest.approx(0.05)
    run.close()
    assert digest(old_run / "tensorlens.sqlite") == before  # read only: the user's file is unchanged


def test_the_converted_copy_lives_while_the_run_is_open(old_run: Path) -> None:
    run = tl.open_run(str(old_run))
    run.steps()
    assert len(copies(old_run)) == 1
    run.close()
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
        (["UPDATE steps SET step = 'three' WHERE mode_step = 1"], ""),
        (["UPDATE scalars SET data = X'0102' WHERE mode_step = 2"], ""),
        (["UPDATE layouts SET names = '[[\"a\", ' WHERE id = 1"], ""),
        (["UPDATE histograms SET counts = X'00' WHERE mode_step = 0"], ""),
    ],
)
def test_a_damaged_schema3_file_is_refused(old_run: Path, statements: list[str], problem: str) -> None:
    damage(old_run, *statements)
    with pytest.raises(tl.CorruptRunError, match=problem):
        read_everything(old_run)
    gc.collect()  # the run, held by the exception's frames until now
    assert copies(old_run) == []  # no copy outlives the run it was made for


def test_another_schema_keeps_its_clear_error(old_run: Path) -> None:
    damage(old_run, "UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    with pytest.raises(tl.CorruptRunError, match="schema 2"):
        tl.open_run(str(old_run)).steps()
    assert copies(old_run) == []


def test_resuming_a_schema3_run_is_refused_with_the_version(old_run: Path) -> None:
    # a run is resumed by writing into its file: a schema-3 file is read-only history
    with pytest.raises(tl.CorruptRunError, match="schema 3"):
        last_steps(str(old_run / "tensorlens.sqlite"))
