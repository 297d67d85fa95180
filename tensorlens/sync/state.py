"""What ``tensorlens sync`` has sent where, kept in the run store itself.

Two tables in the run's primary store file (``tensorlens.sqlite``), created by the first sync
with ``CREATE TABLE IF NOT EXISTS``; no existing table changes, so every reader of the store
(which checks only its own tables) is unaffected, and a run that was never synced has neither:

- ``sync_targets``: one row per destination (``"wandb:<entity>/<project>"``,
  ``"mlflow:<tracking uri>#<experiment id>"``, ``"tensorboard:<log dir>"``): the tracker run it
  was replayed into, the rule findings sent so far, and what the destination needs to continue
  (JSON: the W&B offline folders written so far);
- ``sync_progress``: per destination, mode and worker, the last mode step (and its global
  step) that reached the tracker.

A sync continues after those steps, so a second sync sends only what is new. Like every row of
the store, each row ends with a CRC-32 of its values (:func:`tensorlens.store.schema.row_checksum`):
a damaged row is an error that says so, never a reason to send steps again or to skip them.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from typing import Any

from tensorlens.store.errors import CorruptRunError
from tensorlens.store.schema import connect, row_checksum, with_checksum

SYNC_SCHEMA = """
CREATE TABLE IF NOT EXISTS sync_targets (
    target TEXT PRIMARY KEY, run_id TEXT NOT NULL, findings_sent INTEGER NOT NULL,
    info TEXT NOT NULL, created REAL NOT NULL, crc INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS sync_progress (
    target TEXT NOT NULL, mode TEXT NOT NULL, worker TEXT NOT NULL,
    mode_step INTEGER NOT NULL, step INTEGER NOT NULL, crc INTEGER NOT NULL,
    PRIMARY KEY (target, mode, worker));
"""

#: ``(mode, worker)`` -> ``(last mode step sent, its global step)``
Progress = dict[tuple[str, str], tuple[int, int]]


@dataclasses.dataclass
class TargetState:
    """One destination's row of ``sync_targets``."""

    target: str
    run_id: str
    findings_sent: int = 0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class SyncState:
    """Reads and writes the sync tables of one store file (its own connection: the reader's is
    read-only, and training may still be writing the file: WAL lets all three work at once).

    >>> with SyncState("tensorlens_runs/exp1/tensorlens.sqlite") as state:   # doctest: +SKIP
    ...     state.progress("tensorboard:/tmp/tb")
    {('train', 'worker_0'): (90, 90)}
    """

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._db = connect(path)
            with self._db:
                self._db.executescript(SYNC_SCHEMA)
        except sqlite3.Error as err:
            raise PermissionError(
                f"tensorlens sync keeps what it sent in the run store, but cannot write to {path!r} ({err}); "
                "sync a copy of the run folder, or run it where the folder is writable"
            ) from err

    def target(self, target: str) -> TargetState | None:
        row = self._db.execute("SELECT * FROM sync_targets WHERE target = ?", (target,)).fetchone()
        return self._target(row) if row is not None else None

    def targets(self) -> list[TargetState]:
        return [self._target(row) for row in self._db.execute("SELECT * FROM sync_targets ORDER BY created")]

    def _target(self, row: tuple[object, ...]) -> TargetState:
        target, run_id, findings_sent, info, _ = self._checked("sync_targets", row)
        return TargetState(str(target), str(run_id), int(findings_sent), json.loads(str(info)))  # type: ignore[call-overload]

    def save_target(self, state: TargetState) -> None:
        found = self._db.execute("SELECT created FROM sync_targets WHERE target = ?", (state.target,)).fetchone()
        with self._db:
            self._db.execute("INSERT OR REPLACE INTO sync_targets VALUES (?, ?, ?, ?, ?, ?)", self._row(state, found))

    def _row(self, state: TargetState, found: tuple[object, ...] | None) -> tuple[object, ...]:
        created = float(found[0]) if found is not None else time.time()  # type: ignore[arg-type]
        info = json.dumps(state.info, sort_keys=True)
        return with_checksum(state.target, state.run_id, int(state.findings_sent), info, created)

    def progress(self, target: str) -> Progress:
        rows = self._db.execute("SELECT * FROM sync_progress WHERE target = ?", (target,))
        out: Progress = {}
        for row in rows:
            _, mode, worker, mode_step, step = self._checked("sync_progress", row)
            out[(str(mode), str(worker))] = (int(mode_step), int(step))  # type: ignore[call-overload]
        return out

    def save(self, state: TargetState, progress: Progress) -> None:
        """Record what reached the destination, in one transaction (progress and findings agree)."""
        found = self._db.execute("SELECT created FROM sync_targets WHERE target = ?", (state.target,)).fetchone()
        with self._db:
            self._db.executemany(
                "INSERT OR REPLACE INTO sync_progress VALUES (?, ?, ?, ?, ?, ?)",
                [with_checksum(state.target, mode, worker, ms, step) for (mode, worker), (ms, step) in progress.items()],
            )
            self._db.execute("INSERT OR REPLACE INTO sync_targets VALUES (?, ?, ?, ?, ?, ?)", self._row(state, found))

    def _checked(self, table: str, row: tuple[object, ...]) -> tuple[object, ...]:
        values, crc = tuple(row[:-1]), row[-1]
        if row_checksum(values) != crc:
            raise CorruptRunError(
                self.path, "a row of what tensorlens sync sent is damaged; sync with --new-run to start that "
                "destination over", table,
            )
        return values

    def forget(self, target: str) -> None:
        """Drop what is known about ``target``: the next sync starts a new tracker run."""
        with self._db:
            self._db.execute("DELETE FROM sync_progress WHERE target = ?", (target,))
            self._db.execute("DELETE FROM sync_targets WHERE target = ?", (target,))

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> SyncState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
