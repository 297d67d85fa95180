"""Checking a run store before trusting it: every file, table, row, layout and blob the reader uses.

A run folder may hold anything: a FIFO or a socket named like a store (opening it would block
forever), a file of another program, a truncated copy, a store edited by hand or damaged on disk.
The reader therefore checks, in this order, and raises :class:`CorruptRunError` naming the file,
and where it applies the table and step, instead of hanging or returning garbage:

- the path: a folder or a regular file (not a FIFO, socket or device; a symlink loop is refused);
- the file: the SQLite header, then our tables with our columns and our schema version;
- every row read: its checksum (``crc``, see :func:`tensorlens.store.schema.row_checksum`) and the
  type of every column (SQLite stores any type in any column);
- layouts: valid JSON of ``[tensor, stat]`` or ``[tensor, bins]`` pairs of the kind the row needs,
  and present at all;
- blobs: a size that matches the layout; counts that are non-negative integers, NaN only where a
  value may be absent; raw tensors that decode as numpy arrays of a plain dtype.

A file that exists but holds no table yet (a worker's store being created) is read as empty.

>>> raise CorruptRunError("/runs/a/tensorlens.sqlite", "the row's checksum does not match", "scalars", "train step 3")
Traceback (most recent call last):
tensorlens.store.errors.CorruptRunError: corrupt run store /runs/a/tensorlens.sqlite (table scalars, train step 3): the row's checksum does not match
"""

from __future__ import annotations

import dataclasses
import io
import math
import sqlite3
import stat
from typing import Any

import numpy as np

from tensorlens.modes import ModeKeys
from tensorlens.records import HISTOGRAM_INFO, HISTOGRAM_INTEGER_INFO
from tensorlens.store import jsontext
from tensorlens.store.errors import CorruptRunError
from tensorlens.store.schema import COLUMNS, SCHEMA_VERSION, file_kind, row_checksum, stat_path

__all__ = ["CorruptRunError", "Layout", "SchemaVersionError", "check_file", "check_row", "check_tables"]

_SQLITE_MAGIC = b"SQLite format 3\x00"
_MODES = frozenset(m.value for m in ModeKeys)
_INFO_WIDTH = len(HISTOGRAM_INFO)
_INTEGER_COLUMNS = [i for i, key in enumerate(HISTOGRAM_INFO) if key in HISTOGRAM_INTEGER_INFO]
_SAMPLED = HISTOGRAM_INFO.index("sampled")
_MAX_BINS = 1 << 24  # far above any histogram config; a larger count is damage, not data


class SchemaVersionError(CorruptRunError):
    """A store of another schema version: written by another tensorlens, not damaged."""

    def __init__(self, path: str, found: str) -> None:
        super().__init__(path, f"schema {found}", "meta")
        self.found = found
        ValueError.__init__(
            self, f"{path!r} has run store schema {found}; this tensorlens reads schema {SCHEMA_VERSION} "
            "(open it with the tensorlens version that wrote it)",
        )


# ------------------------------------------------------------------------------------- files


def check_file(path: str) -> bool:
    """Check a store file before SQLite opens it; ``False`` when it is empty (being created)."""
    info = stat_path(path)
    if not stat.S_ISREG(info.st_mode):
        raise CorruptRunError(path, f"it is {file_kind(info.st_mode)}, not a store file")
    if info.st_size == 0:
        return False
    try:
        with open(path, "rb") as file:
            header = file.read(100)
    except OSError as err:
        raise CorruptRunError(path, f"it cannot be read: {err.strerror or err}") from None
    if not header.startswith(_SQLITE_MAGIC):
        raise CorruptRunError(path, f"it is not an SQLite database (it starts with {header[:16]!r})")
    if len(header) < 100:
        raise CorruptRunError(path, f"it is truncated ({info.st_size} bytes, less than an SQLite header)")
    return True


def check_tables(db: sqlite3.Connection, path: str) -> bool:
    """Our tables, columns and schema version; ``False`` while the file holds no table yet."""
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not tables:
        return False
    if "meta" in tables:  # first: a store of another version has other columns, and a clearer message
        try:
            found = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        except sqlite3.OperationalError:  # no key/value columns: reported below
            found = None
        if found is not None and found[0] != SCHEMA_VERSION:
            raise SchemaVersionError(path, str(found[0])[:40])  # a hostile value may be megabytes
    missing = sorted(set(COLUMNS) - tables)
    if missing == sorted(COLUMNS):
        raise CorruptRunError(path, f"it is an SQLite database of another program (its tables: {sorted(tables)[:10]})")
    if missing:
        raise CorruptRunError(path, f"tables {missing} are missing")
    for table, columns in COLUMNS.items():
        found_columns = [row[1] for row in db.execute(f"PRAGMA table_info({table})")]
        wanted = [name for name, _ in columns] + ["crc"]
        if found_columns != wanted:
            raise CorruptRunError(path, f"its columns are {found_columns}, not {wanted}", table)
    version = db.execute("SELECT key, value, crc FROM meta WHERE key = 'schema_version'").fetchone()
    if version is None:
        raise CorruptRunError(path, "it has tables but no schema version", "meta")
    check_row(path, "meta", version)
    return True


# ------------------------------------------------------------------------------------- rows


_KINDS = {table: tuple(kind if isinstance(kind, tuple) else (kind,) for _, kind in columns) for table, columns in COLUMNS.items()}
_EXACT = {table: tuple(k[0] for k in kinds) for table, kinds in _KINDS.items() if all(len(k) == 1 for k in kinds)}
_INTS = {table: [i for i, kinds in enumerate(_KINDS[table]) if int in kinds] for table in COLUMNS}
_FINITE = {table: [i for i, (name, _) in enumerate(columns) if name == "wall_time"] for table, columns in COLUMNS.items()}
_MODE_COLUMN = {"steps": 0, "scalars": 0, "histograms": 0, "tensors": 0, "findings": 2}


def check_row(path: str, table: str, row: tuple[Any, ...]) -> tuple[Any, ...]:
    """``row`` (its columns, then ``crc``) without ``crc``, once its checksum and types are right."""
    values, crc = tuple(row[:-1]), row[-1]
    if crc != row_checksum(values) or len(values) != len(_KINDS[table]):
        raise CorruptRunError(path, "the row's checksum does not match its contents", table, _where(table, values))
    if tuple(map(type, values)) != _EXACT.get(table):  # the fast check fails on NULLs too: then one by one
        for (name, _), kinds, value in zip(COLUMNS[table], _KINDS[table], values, strict=True):
            if type(value) not in kinds:
                raise CorruptRunError(
                    path, f"column {name} holds {type(value).__name__}, not {' or '.join(k.__name__ for k in kinds)}",
                    table, _where(table, values),
                )
    for i in _INTS[table]:
        if values[i] is not None and values[i] < 0:
            raise CorruptRunError(path, f"column {COLUMNS[table][i][0]} is negative ({values[i]})", table, _where(table, values))
    for i in _FINITE[table]:
        if not math.isfinite(values[i]):
            raise CorruptRunError(path, f"column {COLUMNS[table][i][0]} is {values[i]}", table, _where(table, values))
    column = _MODE_COLUMN.get(table)
    if column is not None and values[column] not in _MODES:
        raise CorruptRunError(path, f"mode {values[column]!r} is not one of {sorted(_MODES)}", table, _where(table, values))
    return values


def _where(table: str, values: tuple[Any, ...]) -> str | None:
    """The step a row belongs to, as an error message names it."""
    if table in ("steps", "scalars", "histograms", "tensors") and len(values) >= 3:
        return f"{values[0]} step {values[1]} of {values[2]}"
    if table == "layouts" and values:
        return f"layout {values[0]}"
    if table in ("meta", "shapes") and values:
        return f"{'key' if table == 'meta' else 'tensor'} {values[0]!r}"
    if table == "findings" and len(values) > 1:
        return f"rule {values[0]!r} at step {values[1]}"
    return None


def step_where(mode: str, mode_step: int, worker: str) -> str:
    return f"{mode} step {mode_step} of {worker}"


# ------------------------------------------------------------------------------------- layouts


@dataclasses.dataclass(frozen=True)
class Layout:
    """The names of one packed row (see :mod:`tensorlens.store.schema`): which value is which."""

    kind: str  # "scalars" or "histograms"
    names: tuple[tuple[str, Any], ...]  # (tensor, stat) or (tensor, bins), as stored
    tensors: frozenset[str]
    scalar_index: dict[tuple[str, str], int]  # (tensor, stat) -> position (the last one if repeated)
    histogram_index: dict[str, tuple[int, int, int, int]]  # tensor -> (row, bins, counts offset, edges offset)
    bins: int  # all histograms' bins together

    @classmethod
    def parse(cls, path: str, layout_id: int, kind: str, names_json: str) -> Layout:
        """A checked layout: JSON of ``[tensor, stat]`` (scalars) or ``[tensor, bins]`` (histograms) pairs."""
        where = f"layout {layout_id}"
        names = jsontext.load(path, names_json, "layouts", where)
        if kind not in ("scalars", "histograms"):
            raise CorruptRunError(path, f"kind {kind!r} is neither 'scalars' nor 'histograms'", "layouts", where)
        second = str if kind == "scalars" else int
        if not isinstance(names, list) or not all(
            isinstance(n, list) and len(n) == 2 and isinstance(n[0], str) and type(n[1]) is second for n in names
        ):
            raise CorruptRunError(path, f"its names are not a list of [tensor, {second.__name__}] pairs", "layouts", where)
        if kind == "scalars":
            pairs = tuple((tensor, stat) for tensor, stat in names)
            index = {pair: i for i, pair in enumerate(pairs)}
            return cls(kind, pairs, frozenset(t for t, _ in pairs), index, {}, 0)
        hist_index, counts_at, edges_at = {}, 0, 0
        pairs = tuple((tensor, bins) for tensor, bins in names)
        for row, (tensor, bins) in enumerate(pairs):
            if not 0 < bins <= _MAX_BINS:
                raise CorruptRunError(path, f"{tensor!r} has {bins} bins", "layouts", where)
            hist_index[tensor] = (row, bins, counts_at, edges_at)
            counts_at += bins
            edges_at += bins + 1
        return cls(kind, pairs, frozenset(hist_index), {}, hist_index, counts_at)


def check_kind(path: str, layout: Layout, layout_id: int, table: str, where: str) -> Layout:
    if layout.kind != table:
        raise CorruptRunError(path, f"it names layout {layout_id}, a layout of {layout.kind}", table, where)
    return layout


# ------------------------------------------------------------------------------------- blobs


def check_sizes(path: str, table: str, layout: Layout, row: tuple[Any, ...], where: str) -> Layout:
    """The blobs of a checked scalars or histograms row have the sizes its layout gives them."""
    rows = len(layout.names)
    sizes = (("data", 8 * rows),) if table == "scalars" else (
        ("counts", 8 * layout.bins), ("edges", 8 * (layout.bins + rows)), ("info", 8 * rows * _INFO_WIDTH)
    )
    for (name, size), blob in zip(sizes, row[4:], strict=True):
        if len(blob) != size:
            raise CorruptRunError(path, f"{len(blob)} bytes of {name} where its layout needs {size}", table, where)
    return layout



def scalar_values(path: str, layout: Layout, data: bytes, where: str) -> np.ndarray:
    if len(data) != 8 * len(layout.names):
        raise CorruptRunError(path, f"{len(data)} bytes of values for {len(layout.names)} names", "scalars", where)
    return np.frombuffer(data, dtype="<f8").astype(np.float64)


def histogram_arrays(
    path: str, layout: Layout, counts: bytes, edges: bytes, info: bytes, where: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(counts, edges, info)`` of a histograms row, sizes and values checked against its layout."""
    rows = len(layout.names)
    for name, blob, items in (("counts", counts, layout.bins), ("edges", edges, layout.bins + rows),
                              ("info", info, rows * _INFO_WIDTH)):
        if len(blob) != 8 * items:
            raise CorruptRunError(path, f"{len(blob)} bytes of {name} where the layout needs {8 * items}", "histograms", where)
    counts_array = np.frombuffer(counts, dtype="<i8").astype(np.int64)
    if counts_array.size and counts_array.min() < 0:
        raise CorruptRunError(path, "a histogram count is negative", "histograms", where)
    info_array = np.frombuffer(info, dtype="<f8").astype(np.float64).reshape(rows, _INFO_WIDTH)
    integers = info_array[:, _INTEGER_COLUMNS]
    if not (np.isfinite(integers).all() and (integers >= 0).all() and (integers == np.floor(integers)).all()):
        raise CorruptRunError(path, "a count in the histogram info is not a non-negative integer", "histograms", where)
    if not np.isin(info_array[:, _SAMPLED], (0.0, 1.0)).all():
        raise CorruptRunError(path, "the histogram info's 'sampled' is neither 0 nor 1", "histograms", where)
    return counts_array, np.frombuffer(edges, dtype="<f8").astype(np.float64), info_array


def tensor_array(path: str, data: bytes, where: str) -> np.ndarray:
    """A raw tensor (``np.save`` format, no pickles): its dtype must be a plain number or bool, and
    the blob must hold exactly the bytes its header's shape needs, checked before anything is
    allocated (a header may claim any shape)."""
    try:
        stream = io.BytesIO(data)
        version = np.lib.format.read_magic(stream)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read_header is None:
            raise ValueError(f"format version {version} is not one np.save writes for numbers")
        shape_, fortran_order, dtype = read_header(stream)
    except Exception as err:  # numpy parses the header with ast and tokenize: any of their errors
        raise CorruptRunError(path, f"the raw tensor does not decode: {str(err)[:200]}", "tensors", where) from None
    if dtype.kind not in "biufc" or dtype.fields is not None or dtype.subdtype is not None:
        raise CorruptRunError(path, "the raw tensor is not an array of numbers", "tensors", where)
    if any(d < 0 for d in shape_):
        raise CorruptRunError(path, f"the raw tensor's shape {shape_} has a negative size", "tensors", where)
    count = math.prod(shape_)
    offset = stream.tell()
    if len(data) - offset != count * dtype.itemsize:
        raise CorruptRunError(
            path, f"the raw tensor's header says {shape_} of {dtype} ({count * dtype.itemsize} bytes), "
            f"its blob holds {len(data) - offset}", "tensors", where,
        )
    array = np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape_, order="F" if fortran_order else "C")
    return array.copy(order="K")  # writable and its own, as np.load returns it


def shape(path: str, tensor: str, text: str) -> tuple[int, ...]:
    value = jsontext.load(path, text, "shapes", f"tensor {tensor!r}")
    if not isinstance(value, list) or not all(type(d) is int and d >= 0 for d in value):
        raise CorruptRunError(path, f"the shape {text[:80]!r} is not a list of sizes", "shapes", f"tensor {tensor!r}")
    return tuple(value)
