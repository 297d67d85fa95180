"""Run stores of schema 3 (tensorlens before per-row checksums), read through a converted copy.

Schema 3 has the tables of schema 4 without their ``crc`` column, without the row counts of
``steps`` and without ``findings``; its blobs and histogram info columns are the same. Rather than
teach the reader a second, unchecked layout, :func:`converted_copy` copies a schema-3 file into a
private schema-4 file (rows written with the same checksum helpers the writer uses, row counts
taken from the rows found), which the reader then opens and checks like any other store: every
type, blob length and layout of the old file is still verified, only the checksums cannot vouch
for bytes written before they existed. The user's file is opened read-only and never changed.

>>> run = tl.open_run("runs/written-by-0.1.0")     # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import tempfile
from collections import Counter

from tensorlens.store.errors import CorruptRunError
from tensorlens.store.schema import _SCHEMA, SCHEMA_VERSION, connect, insert, with_checksum

#: The schema version this module converts.
LEGACY_VERSION = "3"
#: Schema 3's tables and their columns, in order.
LEGACY_COLUMNS: dict[str, tuple[str, ...]] = {
    "meta": ("key", "value"),
    "steps": ("mode", "mode_step", "worker", "step", "wall_time"),
    "layouts": ("id", "kind", "names"),
    "scalars": ("mode", "mode_step", "worker", "layout", "data"),
    "histograms": ("mode", "mode_step", "worker", "layout", "counts", "edges", "info"),
    "tensors": ("mode", "mode_step", "worker", "tensor", "step", "wall_time", "data"),
    "shapes": ("tensor", "shape"),
}
_STEP_KEY = ("mode", "mode_step", "worker")


def converted_copy(path: str) -> str:
    """A private schema-4 copy of the schema-3 store ``path``: its file name; the caller removes it.

    Raises :class:`CorruptRunError` when ``path`` is not a readable schema-3 store.
    """
    source = connect(path, readonly=True)
    handle, copy = tempfile.mkstemp(prefix="tensorlens-schema3-", suffix=".sqlite")  # mode 0600
    os.close(handle)
    try:
        _check_tables(source, path)
        target = sqlite3.connect(copy)
        try:
            _copy(source, target)
        finally:
            target.close()
    except sqlite3.Error as err:
        _remove(copy)
        raise CorruptRunError(path, f"SQLite cannot read it: {err}") from None
    except UnicodeDecodeError as err:
        _remove(copy)
        raise CorruptRunError(path, f"a text is not UTF-8 ({err.reason})") from None
    except BaseException:
        _remove(copy)
        raise
    finally:
        source.close()
    return copy


def remove_copy(copy: str) -> None:
    """Remove a copy made by :func:`converted_copy` (and SQLite's files beside it), if still there."""
    for suffix in ("", "-journal", "-wal", "-shm"):
        _remove(copy + suffix)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _check_tables(db: sqlite3.Connection, path: str) -> None:
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    missing = sorted(set(LEGACY_COLUMNS) - tables)
    if missing:
        raise CorruptRunError(path, f"it says schema {LEGACY_VERSION} but tables {missing} are missing")
    for table, wanted in LEGACY_COLUMNS.items():
        found = tuple(row[1] for row in db.execute(f"PRAGMA table_info({table})"))
        if found != wanted:
            raise CorruptRunError(path, f"its columns are {list(found)}, not those of schema {LEGACY_VERSION} {list(wanted)}", table)


def _copy(source: sqlite3.Connection, target: sqlite3.Connection) -> None:
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
    meta = {key: value for key, value in rows("meta")}
    (layouts,), = source.execute("SELECT count(*) FROM layouts").fetchall()
    (shapes,), = source.execute("SELECT count(*) FROM shapes").fetchall()
    # the counts schema 4 keeps in meta, from the rows found; the version the copy is written in
    meta.update({"schema_version": SCHEMA_VERSION, "layout_rows": str(layouts), "shape_rows": str(shapes)})
    target.executemany(insert("meta"), (with_checksum(key, value) for key, value in meta.items()))
    target.execute("COMMIT")

