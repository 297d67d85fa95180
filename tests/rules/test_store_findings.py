"""The run store keeps findings and says when a run has ended."""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest

import tensorlens as tl
from tensorlens.findings import Finding
from tensorlens.store.writer import RunStoreWriter


def test_findings_round_trip_and_the_end_mark(tmp_path: Any) -> None:
    writer = RunStoreWriter(str(tmp_path / "tensorlens.sqlite"))
    record = tl.StepRecord(3, "train", 3, "worker_0", 1.0, scalars=[tl.ScalarEntry("losses/x", None, 2.0)])
    writer.write(record)
    found = [Finding("R1", 3, "train", "losses/x", "first", 2.0, 3, "worker_0"),
             Finding("R2", 3, "eval", None, "second")]
    for finding in found:
        writer.write_finding(finding)
    with tl.open_run(str(tmp_path)) as run:
        assert run.findings() == found and run.findings("R2") == found[1:]
        assert not run.ended  # still being written
    writer.close()
    with tl.open_run(str(tmp_path)) as run:
        assert run.ended and float(run.meta["ended_at"]) > 0
        resumed = RunStoreWriter(str(tmp_path / "tensorlens.sqlite"))  # a resumed run: written again
        assert not run.ended and run.findings() == found
        resumed.close()
        assert run.ended


def test_a_run_without_end_mark_reads_as_not_ended_and_a_missing_findings_table_is_damage(tmp_path: Any) -> None:
    # schema 4 stores have the findings table from the start (older schemas are refused as a
    # whole): a store without it was damaged; one without the end mark crashed or is being written
    writer = RunStoreWriter(str(tmp_path / "tensorlens.sqlite"))
    writer.write(tl.StepRecord(0, "train", 0, "worker_0", 1.0, scalars=[tl.ScalarEntry("losses/x", None, 2.0)]))
    writer.close()
    db = sqlite3.connect(str(tmp_path / "tensorlens.sqlite"))
    with db:
        db.execute("DELETE FROM meta WHERE key = 'ended_at'")
    db.close()
    with tl.open_run(str(tmp_path)) as run:
        assert run.findings() == [] and not run.ended and run.steps() == [0]
    db = sqlite3.connect(str(tmp_path / "tensorlens.sqlite"))
    with db:
        db.execute("DROP TABLE findings")
    db.close()
    with pytest.raises(tl.CorruptRunError, match=r"tables \['findings'\] are missing"):
        tl.open_run(str(tmp_path))
