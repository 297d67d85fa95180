"""What ``tensorlens sync`` has sent where, kept in a file of its own beside the run store.

A source is read-only to sync: the run store (``tensorlens.sqlite``) is only ever opened through
the reader, so syncing never changes it, never writes through a symlinked store into another
folder, and works on a run folder the user may only read. The state lives in
:func:`locate`'s place:

- ``RUN/sync/state.sqlite`` (``state-<worker>.sqlite`` when ``RUN`` is a worker's store file),
  where ``RUN`` is the folder that holds the store's name (a symlinked store is never followed:
  its target's folder belongs to another run);
- where that folder cannot be written (a read-only copy, another user's run):
  ``$XDG_STATE_HOME/tensorlens/sync/<hash of the run folder's real path>/`` (default
  ``~/.local/state``), private to the user.

Three tables: ``sync_targets`` (one row per destination, ``"wandb:<entity>/<project>"``,
``"mlflow:<tracking uri>#<experiment>"``, ``"tensorboard:<log dir>"``, whatever a backend's
``replay_destination`` names: the tracker run it was replayed into, the rule findings sent so far,
and what the backend needs to continue, its ``ReplayRun.info``, JSON),
``sync_progress`` (per destination, mode and worker: the last mode step and its global step that
reached the tracker) and ``sync_meta``. Each row of the first two ends with a CRC-32 of its values
(:func:`tensorlens.store.schema.row_checksum`), and each value is checked when read: a damaged row
is an error that says so, never a reason to send steps again or to skip them.

The previous release kept the same two tables inside the store itself. They are read (read-only)
when the state file is first created, and copied into it, so a run synced before continues.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tensorlens.store import jsontext
from tensorlens.store.errors import CorruptRunError
from tensorlens.store.schema import row_checksum, with_checksum

STATE_FOLDER = "sync"
STATE_VERSION = "1"

SYNC_SCHEMA = """
CREATE TABLE IF NOT EXISTS sync_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sync_targets (
    target TEXT PRIMARY KEY, run_id TEXT NOT NULL, findings_sent INTEGER NOT NULL,
    info TEXT NOT NULL, created REAL NOT NULL, crc INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS sync_progress (
    target TEXT NOT NULL, mode TEXT NOT NULL, worker TEXT NOT NULL,
    mode_step INTEGER NOT NULL, step INTEGER NOT NULL, crc INTEGER NOT NULL,
    PRIMARY KEY (target, mode, worker));
"""
_TABLES = ("sync_targets", "sync_progress")
# the Python type of each column (but the checksum): SQLite keeps whatever a row was given
_TYPES = {"sync_targets": (str, str, int, str, float), "sync_progress": (str, str, str, int, int)}

#: ``(mode, worker)`` -> ``(last mode step sent, its global step)``
Progress = dict[tuple[str, str], tuple[int, int]]


@dataclasses.dataclass
class TargetState:
    """One destination's row of ``sync_targets``."""

    target: str
    run_id: str
    findings_sent: int = 0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StateLocation:
    """Where the sync state of one store file lives, and what to copy into it when it is new."""

    folder: str  # the state file and the destinations' lock files
    name: str  # the state file's name
    seeds: tuple[str, ...]  # read first time only, read-only: a state the user cannot write, the store's own tables
    private: bool = False  # the user's own state folder (the run folder is not writable)

    @property
    def path(self) -> str:
        return os.path.join(self.folder, self.name)


def locate(store_file: str) -> StateLocation:
    """The state of ``store_file`` (the run's primary store, or the store file given to sync):
    ``<its folder>/sync/`` when that can be written, else the user's state folder.

    >>> locate("runs/exp1/tensorlens.sqlite").path   # doctest: +SKIP
    'runs/exp1/sync/state.sqlite'
    """
    run_folder = os.path.dirname(os.path.abspath(store_file))  # abspath: a symlinked store is not resolved
    base = os.path.basename(store_file)
    rest = base[len("tensorlens"):] if base.startswith("tensorlens") else "-" + base
    name = "state" + re.sub(r"[^\w.\-]", "_", rest)
    local = os.path.join(run_folder, STATE_FOLDER)
    if os.path.islink(local):
        raise PermissionError(
            f"{local} is a symbolic link: tensorlens sync keeps what it sent in a folder of the run itself; "
            "remove the link (or sync a copy of the run)"
        )
    if _writable(local) or (not os.path.lexists(local) and _writable(run_folder)):
        return StateLocation(local, name, (store_file,))
    own = os.path.join(local, name)
    seeds = ((own,) if os.path.isfile(own) else ()) + (store_file,)
    return StateLocation(user_state_folder(run_folder), name, seeds, private=True)


def user_state_folder(run_folder: str) -> str:
    """``$XDG_STATE_HOME/tensorlens/sync/<hash>``: the state of a run whose folder is not writable."""
    home = os.environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(home):  # the XDG rule: a relative value is ignored
        home = os.path.join(os.path.expanduser("~"), ".local", "state")
    digest = hashlib.sha256(os.path.realpath(run_folder).encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return os.path.join(home, "tensorlens", "sync", digest)


def _writable(folder: str) -> bool:
    return os.path.isdir(folder) and not os.path.islink(folder) and os.access(folder, os.W_OK | os.X_OK)


def make_folder(location: StateLocation, run: str) -> None:
    """Create the state folder (private to the user when it is not in the run), or say why not."""
    try:
        os.makedirs(location.folder, mode=0o700 if location.private else 0o777, exist_ok=True)
    except OSError as err:
        where = "the run folder is not writable, and " if location.private else ""
        raise PermissionError(
            f"tensorlens sync keeps what it sent of {run} in {location.folder}, but {where}it cannot be created "
            f"({err.strerror or err}); set XDG_STATE_HOME to a folder you can write"
        ) from None


class SyncState:
    """Reads and writes one sync state file (``locate(...).path``). A new file gets the rows of
    the first of ``seeds`` that holds sync tables (read-only), in the same transaction that marks
    it initialized. Its own connection, rollback journal (not WAL: a user who cannot write the
    folder can still read it); one sync per destination at a time (:mod:`tensorlens.sync.lock`).

    >>> with SyncState("tensorlens_runs/exp1/sync/state.sqlite") as state:   # doctest: +SKIP
    ...     state.progress("tensorboard:/tmp/tb")
    {('train', 'worker_0'): (90, 90)}
    """

    def __init__(self, path: str, seeds: Sequence[str] = ()) -> None:
        self.path = path
        if os.path.islink(path):
            raise PermissionError(f"{path} is a symbolic link: tensorlens sync does not write through it; remove it")
        try:
            self._db = sqlite3.connect(path, timeout=30)
        except sqlite3.Error as err:
            raise PermissionError(f"tensorlens sync cannot open its state {path!r} ({err})") from None
        try:
            self._db.executescript(SYNC_SCHEMA)
            self._initialize(seeds)
        except sqlite3.DatabaseError as err:
            self._db.close()
            raise CorruptRunError(path, f"SQLite cannot use it ({err}); remove it to sync into new tracker runs") from None
        except BaseException:
            self._db.close()
            raise

    def _initialize(self, seeds: Sequence[str]) -> None:
        self._db.execute("BEGIN IMMEDIATE")  # two first syncs at once: one copies, the other sees it done
        try:
            if self._db.execute("SELECT value FROM sync_meta WHERE key = 'version'").fetchone() is None:
                for seed in seeds:
                    rows = _read_seed(seed)
                    if rows is not None:
                        for table in _TABLES:
                            self._db.executemany(
                                f"INSERT OR REPLACE INTO {table} VALUES ({', '.join('?' * (len(_TYPES[table]) + 1))})",
                                rows[table],
                            )
                        self._db.execute("INSERT INTO sync_meta VALUES ('copied_from', ?)", (os.path.abspath(seed),))
                        break
                self._db.execute("INSERT INTO sync_meta VALUES ('version', ?)", (STATE_VERSION,))
            self._db.commit()
        except BaseException:
            self._db.rollback()
            raise

    def target(self, target: str) -> TargetState | None:
        row = self._db.execute("SELECT * FROM sync_targets WHERE target = ?", (target,)).fetchone()
        return self._target(row) if row is not None else None

    def targets(self) -> list[TargetState]:
        return [self._target(row) for row in self._db.execute("SELECT * FROM sync_targets ORDER BY created")]

    def _target(self, row: tuple[object, ...]) -> TargetState:
        target, run_id, findings_sent, info_text, _ = _checked(self.path, "sync_targets", row)
        info = jsontext.load(self.path, str(info_text), "sync_targets", f"target {target!r}")
        if not isinstance(info, dict) or not run_id or int(findings_sent) < 0:  # type: ignore[call-overload]
            raise _damaged(self.path, "sync_targets")
        return TargetState(str(target), str(run_id), int(findings_sent), info)  # type: ignore[call-overload]

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
            _, mode, worker, mode_step, step = _checked(self.path, "sync_progress", row)
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


def _damaged(path: str, table: str) -> CorruptRunError:
    return CorruptRunError(
        path, "a row of what tensorlens sync sent is damaged; sync with --new-run to start that destination over", table,
    )


def _checked(path: str, table: str, row: tuple[object, ...]) -> tuple[object, ...]:
    """A row's values, once its checksum and the types of its values are right."""
    values, crc = tuple(row[:-1]), row[-1]
    types = _TYPES[table]
    if (
        len(values) != len(types) or row_checksum(values) != crc
        or not all(type(v) is t or (t is float and type(v) is int) for v, t in zip(values, types, strict=True))
    ):
        raise _damaged(path, table)
    return values


def _read_seed(path: str) -> dict[str, list[tuple[object, ...]]] | None:
    """The sync rows of ``path`` (a store of the previous release, or a state file), read-only and
    checked; ``None`` when it holds no sync tables."""
    db = _open_read_only(path)
    if db is None:
        return None
    try:
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not set(_TABLES) <= tables:
            return None
        rows = {table: db.execute(f"SELECT * FROM {table}").fetchall() for table in _TABLES}
    except sqlite3.Error as err:
        raise CorruptRunError(path, f"its sync tables cannot be read ({err})") from None
    finally:
        db.close()
    for table, found in rows.items():
        for row in found:
            _checked(path, table, row)
    return rows


def _open_read_only(path: str) -> sqlite3.Connection | None:
    """A read-only connection that writes nothing, not even beside the file. ``mode=ro`` first:
    it sees a writer's latest commits; ``immutable=1`` where the folder cannot be written (SQLite
    cannot open the write-ahead log's index there) and no writer can be adding to it."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return None
    uri = Path(path).absolute().as_uri()
    for flags in ("?mode=ro", "?mode=ro&immutable=1"):
        db = None
        try:
            db = sqlite3.connect(uri + flags, uri=True, timeout=10)
            db.execute("SELECT count(*) FROM sqlite_master").fetchall()
            return db
        except sqlite3.OperationalError:
            if db is not None:
                db.close()
        except sqlite3.DatabaseError as err:
            if db is not None:
                db.close()
            raise CorruptRunError(path, f"SQLite cannot read it ({err})") from None
    raise CorruptRunError(path, "SQLite cannot open it read-only to look for what an earlier tensorlens sync sent")
