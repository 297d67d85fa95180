"""One store file opened for reading: opened only once it is known to be safe, its steps checked
and indexed, every other row fetched with its checks (see :mod:`tensorlens.store.validate`).

The steps table is the index of a file: one small row per stored step, saying which rows the
other tables hold for it. The reader checks it whole (and again only for rows committed since),
selects steps in Python from checked values, and fetches their rows by key, so a damaged value
can never hide a row from a query, and a row that should be there but is not is an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sqlite3
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from tensorlens.store import legacy
from tensorlens.store.schema import connect, select
from tensorlens.store.validate import (
    CorruptRunError,
    Layout,
    SchemaVersionError,
    check_file,
    check_kind,
    check_row,
    check_sizes,
    check_tables,
    shape,
    step_where,
)

__all__ = ["StepRow", "StoreFile"]

_T = TypeVar("_T")
Key = tuple[str, int, str]  # (mode, mode step, worker): the primary key of every per-step table
_POINT_LOOKUPS = 16  # up to this many steps, rows are fetched by key; more, by one scan of the table


@dataclasses.dataclass(frozen=True)
class StepRow:
    """A checked row of the steps table."""

    mode: str
    mode_step: int
    worker: str
    step: int
    wall_time: float
    scalar_rows: int  # rows the scalars table holds for this step (0 or 1)
    histogram_rows: int  # rows of the histograms table (0 or 1)
    tensor_rows: int  # rows of the tensors table (raw tensors)

    @property
    def key(self) -> Key:
        return self.mode, self.mode_step, self.worker

    @property
    def where(self) -> str:
        return step_where(*self.key)

    def expected(self, table: str) -> int:
        return {"scalars": self.scalar_rows, "histograms": self.histogram_rows, "tensors": self.tensor_rows}[table]


class StoreFile:
    """One ``tensorlens*.sqlite`` of a run, read only after :func:`check_file` and :func:`check_tables`."""

    def __init__(self, path: str, read_legacy: bool = True) -> None:
        self.path = path
        # a schema-3 store is read through a converted copy (store/legacy.py); never for resuming
        self._read_legacy = read_legacy
        self._legacy_copy: weakref.finalize | None = None
        self.ready = False  # holds our tables (checked); until then it is read as empty
        self.db: sqlite3.Connection | None = None
        self._steps: dict[Key, StepRow] = {}
        self._watermark = 0  # the largest rowid of the steps table already checked
        self._version: int | None = None  # PRAGMA data_version when the index was last refreshed
        self._layouts: dict[int, Layout] = {}  # immutable once written
        self._in_snapshot = False
        self.refresh()

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
        if self._legacy_copy is not None:
            self._legacy_copy()  # removes the converted copy (also done when collected, or at exit)

    def guard(self, fn: Callable[[], _T], table: str | None = None) -> _T:
        """``fn()``, with SQLite's errors (a malformed file, a dropped table) as :class:`CorruptRunError`."""
        try:
            return fn()
        except sqlite3.Error as err:
            raise CorruptRunError(self.path, f"SQLite cannot read it: {err}", table) from None
        except UnicodeDecodeError as err:  # a text column holding bytes that are not UTF-8
            raise CorruptRunError(self.path, f"a text is not UTF-8 ({err.reason})", table) from None

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[None]:
        """Queries inside see one state of the file (a writer's commits in between are not mixed in)."""
        if self._in_snapshot or self.db is None:
            yield
            return
        db = self.db
        self.guard(lambda: db.execute("BEGIN"))
        self.guard(lambda: db.execute("SELECT count(*) FROM sqlite_master").fetchall())  # the read starts here
        self._in_snapshot = True
        try:
            yield
        finally:
            self._in_snapshot = False
            self.guard(lambda: db.execute("COMMIT"))

    def refresh(self) -> bool:
        """Whether the file holds a store (its tables checked the first time it does)."""
        if self.ready:
            return True
        if not check_file(self.path):  # empty: a worker's store being created
            return False
        if self.db is None:
            self.db = self.guard(lambda: connect(self.path, readonly=True))
            self.db.execute("PRAGMA cell_size_check = ON")  # SQLite's own extra checks of each page read
        db = self.db
        try:
            self.ready = self.guard(lambda: check_tables(db, self.path))
        except SchemaVersionError as err:
            if err.found != legacy.LEGACY_VERSION or not self._read_legacy:
                raise
            self._open_legacy()
        return self.ready

    def _open_legacy(self) -> None:
        """Read a schema-3 store through a schema-4 copy, checked like any store (errors name ``path``)."""
        copy = legacy.converted_copy(self.path)
        self._legacy_copy = weakref.finalize(self, legacy.remove_copy, copy)
        assert self.db is not None
        self.db.close()
        db = self.db = self.guard(lambda: connect(copy, readonly=True))
        db.execute("PRAGMA cell_size_check = ON")
        self.ready = self.guard(lambda: check_tables(db, self.path))

    def _execute(self, sql: str, args: Iterable[Any] = (), table: str | None = None) -> list[tuple[Any, ...]]:
        assert self.db is not None
        db = self.db
        return self.guard(lambda: db.execute(sql, tuple(args)).fetchall(), table)

    # -- the steps index

    def steps(self) -> dict[Key, StepRow]:
        """Every step of the file, checked; rows committed since the last call are checked now."""
        if not self.refresh():
            return {}
        (version,), = self._execute("PRAGMA data_version")
        if version == self._version:
            return self._steps
        if self._in_snapshot:  # the snapshot may be older than this version: refresh again next time
            self._refresh_steps(None)
            return self._steps
        with self.snapshot():
            return self._refresh_steps(version)

    def _refresh_steps(self, version: int | None) -> dict[Key, StepRow]:
        (count,), = self._execute("SELECT count(*) FROM steps", (), "steps")
        for start_again in (False, True):  # rows only ever get added or replaced; else read all again
            if start_again:
                self._steps, self._watermark = {}, 0
            # ">=": a replaced last row may get its rowid back
            rows = self._execute(f"SELECT rowid, {select('steps')} FROM steps WHERE rowid >= ?", (self._watermark,), "steps")
            for rowid, *row in rows:
                step = StepRow(*check_row(self.path, "steps", tuple(row)))
                self._steps[step.key] = step
                self._watermark = max(self._watermark, rowid)
            if len(self._steps) == count:
                self._version = version
                return self._steps
        raise CorruptRunError(self.path, f"{count} rows but {len(self._steps)} distinct steps", "steps")

    # -- rows of one table for some steps

    def rows(self, table: str, steps: list[StepRow]) -> Iterator[tuple[StepRow, tuple[Any, ...]]]:
        """``(step, checked row)`` of ``table`` for ``steps``, in their order; a row a step says it
        has but that is missing, or a row no step of the file owns, is an error."""
        wanted = [s for s in steps if s.expected(table)]
        if not wanted:
            return
        if len(wanted) <= _POINT_LOOKUPS:
            by_key = {}
            for step in wanted:
                found = self._execute(
                    f"SELECT {select(table)} FROM {table} WHERE mode = ? AND mode_step = ? AND worker = ?"
                    + (" ORDER BY rowid" if table == "tensors" else ""), step.key, table,
                )
                by_key[step.key] = [check_row(self.path, table, row) for row in found]
        else:
            by_key = self._scan(table)
        for step in wanted:
            found = by_key.get(step.key, [])
            if len(found) != step.expected(table):
                raise CorruptRunError(
                    self.path, f"the step has {len(found)} rows here where its steps row says {step.expected(table)}",
                    table, step.where,
                )
            for row in found:
                yield step, row

    def _scan(self, table: str) -> dict[Key, list[tuple[Any, ...]]]:
        """Every row of ``table``, checked, by step; a row of a step the index does not know
        (its key damaged, or its steps row gone) is an error."""
        order = " ORDER BY rowid" if table == "tensors" else ""
        by_key: dict[Key, list[tuple[Any, ...]]] = {}
        for row in self._execute(f"SELECT {select(table)} FROM {table}{order}", (), table):
            checked = check_row(self.path, table, row)
            key = checked[:3]
            if key not in self._steps and key not in self.steps():  # committed after the index was read?
                raise CorruptRunError(self.path, "a row of a step that the steps table does not hold", table, step_where(*key))
            by_key.setdefault(key, []).append(checked)
        return by_key

    # -- layouts

    def layout(self, layout_id: int, table: str, where: str) -> Layout:
        found = self._layouts.get(layout_id)
        if found is None:
            rows = self._execute(f"SELECT {select('layouts')} FROM layouts WHERE id = ?", (layout_id,), "layouts")
            if not rows:
                raise CorruptRunError(self.path, f"it names layout {layout_id}, which is missing", table, where)
            _, kind, names = check_row(self.path, "layouts", rows[0])
            found = self._layouts[layout_id] = Layout.parse(self.path, layout_id, kind, names)
        return check_kind(self.path, found, layout_id, table, where)

    def row_layout(self, table: str, row: tuple[Any, ...]) -> Layout:
        """The layout of a checked scalars or histograms row, its blobs' sizes checked against it."""
        where = step_where(*row[:3])
        return check_sizes(self.path, table, self.layout(row[3], table, where), row, where)

    def all_layouts(self) -> list[Layout]:
        """Every layout, checked, and as many as the store says it holds (a listing of names must
        not silently leave out the tensors of a layout gone missing)."""
        if not self.refresh():
            return []
        out = []
        with self.snapshot():
            for row in self._execute(f"SELECT {select('layouts')} FROM layouts", (), "layouts"):
                layout_id, kind, names = check_row(self.path, "layouts", row)
                if layout_id not in self._layouts:
                    self._layouts[layout_id] = Layout.parse(self.path, layout_id, kind, names)
                out.append(self._layouts[layout_id])
            self._expect_rows("layouts", len(out))
        return out

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every stored shape, checked, and as many as the store counts."""
        if not self.refresh():
            return {}
        with self.snapshot():
            rows = self.checked("shapes")
            self._expect_rows("shapes", len(rows))
        return {tensor: shape(self.path, tensor, text) for tensor, text in rows}

    def _expect_rows(self, table: str, found: int) -> None:
        """``table`` holds as many rows as the ``<table>_rows`` entry of ``meta`` says (read in the
        same snapshot as the rows)."""
        key = f"{table.removesuffix('s')}_rows"
        rows = [value for _, value in self.checked("meta", "WHERE key = ?", (key,))]
        if not rows or not re.fullmatch(r"[0-9]{1,18}", rows[0]):  # str.isdigit() admits "²", int() refuses it
            raise CorruptRunError(self.path, f"its {key!r} entry is missing or not a count", "meta")
        if found != int(rows[0]):
            raise CorruptRunError(self.path, f"{found} rows where the store counts {rows[0]}", table)

    def raw_tensor_names(self) -> set[str]:
        """Names of the raw tensors. A name is only as good as a row holding it: the first row of
        each name is checked (a damaged name's only rows are damaged), not every blob of the run;
        and the table must hold as many rows as the steps say, so that no name is left out."""
        if not self.refresh():
            return set()
        names = set()
        with self.snapshot():
            steps = self.steps()
            (rows,), = self._execute("SELECT count(*) FROM tensors", (), "tensors")
            if rows != sum(s.tensor_rows for s in steps.values()):
                raise CorruptRunError(self.path, f"{rows} rows where the steps count {sum(s.tensor_rows for s in steps.values())}", "tensors")
            for (name,) in self._execute("SELECT DISTINCT tensor FROM tensors", (), "tensors"):
                for row in self._execute(f"SELECT {select('tensors')} FROM tensors WHERE tensor = ? LIMIT 1", (name,), "tensors"):
                    names.add(check_row(self.path, "tensors", row)[3])
        return names

    # -- small tables

    def checked(self, table: str, where: str = "", args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Checked rows of a small table (``meta``, ``shapes``) or of a query on it."""
        if not self.refresh():
            return []
        return [check_row(self.path, table, row) for row in self._execute(f"SELECT {select(table)} FROM {table} {where}", args, table)]


def last_steps(path: str) -> dict[str, int]:
    """The last stored step of each mode in one store file (checked: a damaged store raises
    :class:`CorruptRunError` rather than restart a resumed run at step 0 over its steps): the
    global step for train, the mode step otherwise. Empty for a new or empty file."""
    store = StoreFile(path, read_legacy=False)  # resuming writes: a schema-3 file gets the clear version error
    try:
        out: dict[str, int] = {}
        for row in store.steps().values():
            last = row.step if row.mode == "train" else row.mode_step
            out[row.mode] = max(out.get(row.mode, last), last)
        return out
    finally:
        store.close()
