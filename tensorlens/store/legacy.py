"""Run stores of schema 3 (tensorlens before per-row checksums), read through a converted copy.

Schema 3 has the tables of schema 4 without their ``crc`` column, without the row counts of
``steps`` and without ``findings``; its blobs and histogram info columns are the same. Rather than
teach the reader a second, unchecked layout, :func:`converted_copy` copies a schema-3 file into a
private schema-4 file (rows written with the same checksum helpers the writer uses, row counts
taken from the rows found), which the reader then opens and checks like any other store: every
type, blob length and layout of the old file is still verified, only the checksums cannot vouch
for bytes written before they existed. Before a row is copied, the old file's tables must match
:data:`LEGACY_SCHEMA` column for column, declared types and keys included (so SQLite neither
converts nor merges a value on the way). The copy is a snapshot, so it is marked ended; a
temporary folder without room for it is refused up front. The user's file is opened read-only
and never changed; the reader removes the copy when the run is closed, collected, or at exit.

A process killed does none of that: a copy is as large as the store. So a copy is named
``tensorlens-schema3-<pid>-<random>.sqlite`` after the process that made it, and every conversion
first removes the copies of processes no longer alive (:func:`sweep`; a copy whose PID a new
process has taken waits for that one to end). A ``SIGTERM`` during the conversion itself removes
the half-written copy at once, then ends the process as ``SIGTERM`` would have (see
:func:`_removed_on_sigterm`).

>>> run = tl.open_run("runs/written-by-0.1.0")     # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import sqlite3
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from tensorlens.store.errors import CorruptRunError
from tensorlens.store.schema import _SCHEMA, SCHEMA_VERSION, connect, insert, with_checksum

#: The schema version this module converts.
LEGACY_VERSION = "3"
#: Schema 3 as tensorlens 0.1.0 (commit c3f22d1) created it, verbatim: a file must match it column
#: for column (name, declared type, NOT NULL, primary key) before a row of it is copied.
LEGACY_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS steps (
    mode TEXT NOT NULL, mode_step INTEGER NOT NULL, worker TEXT NOT NULL,
    step INTEGER NOT NULL, wall_time REAL NOT NULL,
    PRIMARY KEY (mode, mode_step, worker));
CREATE TABLE IF NOT EXISTS layouts (id INTEGER PRIMARY KEY, kind TEXT NOT NULL, names TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS scalars (
    mode TEXT NOT NULL, mode_step INTEGER NOT NULL, worker TEXT NOT NULL,
    layout INTEGER NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (mode, mode_step, worker));
CREATE TABLE IF NOT EXISTS histograms (
    mode TEXT NOT NULL, mode_step INTEGER NOT NULL, worker TEXT NOT NULL,
    layout INTEGER NOT NULL, counts BLOB NOT NULL, edges BLOB NOT NULL, info BLOB NOT NULL,
    PRIMARY KEY (mode, mode_step, worker));
CREATE TABLE IF NOT EXISTS tensors (
    mode TEXT NOT NULL, mode_step INTEGER NOT NULL, worker TEXT NOT NULL, tensor TEXT NOT NULL,
    step INTEGER NOT NULL, wall_time REAL NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (mode, mode_step, worker, tensor));
CREATE TABLE IF NOT EXISTS shapes (tensor TEXT PRIMARY KEY, shape TEXT NOT NULL);
"""


def _declared(db: sqlite3.Connection, table: str) -> tuple[tuple[str, str, int, int], ...]:
    """Each column of ``table``: (name, declared type, NOT NULL, position in the primary key)."""
    return tuple((row[1], row[2].upper(), row[3], row[5]) for row in db.execute(f"PRAGMA table_info({table})"))


def _legacy_declared() -> dict[str, tuple[tuple[str, str, int, int], ...]]:
    db = sqlite3.connect(":memory:")
    try:
        db.executescript(LEGACY_SCHEMA)
        tables = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY rowid")]
        return {table: _declared(db, table) for table in tables}
    finally:
        db.close()


#: Schema 3's tables and their columns as SQLite declares them; the names, in order.
LEGACY_DECLARED = _legacy_declared()
LEGACY_COLUMNS: dict[str, tuple[str, ...]] = {t: tuple(c[0] for c in cols) for t, cols in LEGACY_DECLARED.items()}
_STEP_KEY = ("mode", "mode_step", "worker")


def converted_copy(path: str) -> str:
    """A private schema-4 copy of the schema-3 store ``path``: its file name; the caller removes it.

    Raises :class:`CorruptRunError` when ``path`` is not a readable schema-3 store, and
    :class:`OSError` (``ENOSPC``) when the temporary folder has no room for the copy.
    """
    directory = tempfile.gettempdir()
    sweep(directory)
    _check_space(path, directory)
    source = None
    copy = None
    try:
        with _removed_on_sigterm(directory):
            handle, copy = tempfile.mkstemp(prefix=f"{COPY_PREFIX}{os.getpid()}-", suffix=".sqlite", dir=directory)  # mode 0600
            os.close(handle)
            source = connect(path, readonly=True)
            source.execute("PRAGMA cell_size_check = ON")  # SQLite's own extra checks of each page read
            _check_tables(source, path)
            target = sqlite3.connect(copy)
            try:
                _copy(source, target, os.path.getmtime(path))
            finally:
                target.close()
    except sqlite3.Error as err:
        _discard(copy)
        raise CorruptRunError(path, f"SQLite cannot read it: {err}") from None
    except UnicodeDecodeError as err:
        _discard(copy)
        raise CorruptRunError(path, f"a text is not UTF-8 ({err.reason})") from None
    except BaseException:
        _discard(copy)
        raise
    finally:
        if source is not None:
            source.close()
    assert copy is not None
    return copy


def _discard(copy: str | None) -> None:
    if copy is not None:
        remove_copy(copy)


def remove_copy(copy: str) -> None:
    """Remove a copy made by :func:`converted_copy` (and SQLite's files beside it), if still there."""
    for suffix in ("", "-journal", "-wal", "-shm"):
        _remove(copy + suffix)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


#: How a converted copy's name starts; the owner's PID follows.
COPY_PREFIX = "tensorlens-schema3-"
_COPY_NAME = re.compile(rf"{re.escape(COPY_PREFIX)}([0-9]{{1,10}})-[^/]*\.sqlite(?:-journal|-wal|-shm)?")


def sweep(directory: str, own: bool = False) -> list[str]:
    """Remove the converted copies in ``directory`` whose process is no longer alive (killed before
    it could remove them), and with ``own`` this process's too; return their names. Only this
    user's files are touched; nothing on Windows, where probing a PID would end that process."""
    if sys.platform == "win32":
        return []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        found = _COPY_NAME.fullmatch(name)
        if found is None or not (own and int(found.group(1)) == os.getpid()) and _alive(int(found.group(1))):
            continue
        full = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            if os.lstat(full).st_uid == os.geteuid():
                os.remove(full)
                removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):  # another user's process, or not a PID to probe
        return True
    return True


@contextlib.contextmanager
def _removed_on_sigterm(directory: str) -> Iterator[None]:
    """While converting: a ``SIGTERM`` whose action is the default (end the process) first removes
    this process's copies in ``directory`` (it is ending: none of them will be read again), then
    ends the process by that default. A handler of the program's own is left in place (whatever
    it raises, ``SystemExit`` included, removes the copy on its way out); so is an ignored
    ``SIGTERM``. Only the main thread can set handlers; the previous one is restored."""
    if not hasattr(signal, "SIGTERM") or threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        sweep(directory, own=True)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # ended as SIGTERM ends it, status included

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _check_tables(db: sqlite3.Connection, path: str) -> None:
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    missing = sorted(set(LEGACY_DECLARED) - tables)
    if missing:
        raise CorruptRunError(path, f"it says schema {LEGACY_VERSION} but tables {missing} are missing")
    for table, wanted in LEGACY_DECLARED.items():
        found = _declared(db, table)
        if found == wanted:
            continue
        names = [column[0] for column in found]
        if names != list(LEGACY_COLUMNS[table]):
            raise CorruptRunError(path, f"its columns are {names}, not those of schema {LEGACY_VERSION} {list(LEGACY_COLUMNS[table])}", table)
        # same names, other types or keys: SQLite would convert or merge values on the copy
        differ = [_describe(f) for f, w in zip(found, wanted, strict=True) if f != w]
        raise CorruptRunError(path, f"its columns {differ} are not declared as schema {LEGACY_VERSION} declares them", table)


def _describe(column: tuple[str, str, int, int]) -> str:
    name, kind, not_null, key = column
    return " ".join(filter(None, (name, kind or "(no type)", "NOT NULL" if not_null else "", "PRIMARY KEY" if key else "")))


def _check_space(path: str, directory: str) -> None:
    """Refuse before copying when the temporary folder cannot hold a copy of ``path`` (and its WAL)."""
    needed = sum(os.path.getsize(p) for p in (path, path + "-wal") if os.path.isfile(p))
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise OSError(
            errno.ENOSPC,
            f"reading the schema-{LEGACY_VERSION} store {path!r} needs a converted copy of about {needed} bytes "
            f"in {directory!r}, which has {free} free; set TMPDIR to a folder with room",
        )


def _copy(source: sqlite3.Connection, target: sqlite3.Connection, ended_at: float) -> None:
    def rows(table: str) -> sqlite3.Cursor:
        return source.execute(f"SELECT {', '.join(LEGACY_COLUMNS[table])} FROM {table}")

    # one transaction: the copy is whole or the error above removes it
    target.execute("BEGIN")
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            target.execute(statement)
    counts: dict[str, Counter[tuple[object, ...]]] = {}
    for table in ("scalars", "histograms", "tensors"):
        counts[table] = Counter(tuple(key) for key in source.execute(f"SELECT {', '.join(_STEP_KEY)} FROM {table}"))
        target.executemany(insert(table), (with_checksum(*row) for row in rows(table)))
    target.executemany(
        insert("steps"),
        (
            with_checksum(*row, *(counts[table][tuple(row[:3])] for table in ("scalars", "histograms", "tensors")))
            for row in rows("steps")
        ),
    )
    for table in ("layouts", "shapes"):
        target.executemany(insert(table), (with_checksum(*row) for row in rows(table)))
    meta = dict(rows("meta").fetchall())
    (layouts,), = source.execute("SELECT count(*) FROM layouts").fetchall()
    (shapes,), = source.execute("SELECT count(*) FROM shapes").fetchall()
    # the counts schema 4 keeps in meta, from the rows found; the version the copy is written in
    meta.update({"schema_version": SCHEMA_VERSION, "layout_rows": str(layouts), "shape_rows": str(shapes)})
    # the copy never grows: it has ended (schema 3 did not record it), else a reader that follows
    # the run until it ends (``Run.ended``, ``tl.rules.invoke(..., wait=True)``) would wait forever
    meta["ended_at"] = repr(ended_at)
    target.executemany(insert("meta"), (with_checksum(key, value) for key, value in meta.items()))
    target.execute("COMMIT")

