"""The local run store: one folder per run, SQLite files inside (standard library only).

Each worker that writes gets its own file, ``tensorlens.sqlite`` (or
``tensorlens-<worker>.sqlite`` for extra workers), so processes never contend for a lock.
WAL mode lets readers open the run while training writes it; each step is one transaction, so
after a crash (even ``kill -9``) the run holds every step up to the last one committed.
Tensor names are only ever stored as text, never turned into paths.

Layout (schema 4): every table is keyed by ``(mode, mode_step, worker)`` first, so a step is
appended in one place. All scalars of a step are one row, a float64 array whose names
(``[tensor, stat]`` pairs) are a row of ``layouts``; all histograms of a step are one row too
(counts, edges and an info matrix, concatenated, named by ``[tensor, bins]``). A layout is
written once and reused by every step with the same tensors. Raw tensors keep a row each.
Rule findings are rows of ``findings``; ``meta`` gets ``ended_at`` (a Unix time) when the writer
closes, so a reader can tell a run still being written from one that has ended (a run that
crashed never gets it).
Every row ends with ``crc``, a CRC-32 of its other columns (:func:`row_checksum`), so a reader
tells a damaged row from data (SQLite keeps no checksums of its own), and a step's row in
``steps`` counts its rows in ``scalars``, ``histograms`` and ``tensors``, so a missing row is
noticed too. Readers go through
:mod:`tensorlens.store.reader`, which checks every row (:mod:`tensorlens.store.validate`).
``tensorlens sync`` only reads the store: what it sent where lives in ``RUN/sync/`` (see
:mod:`tensorlens.sync.state`); the run metadata is the ``meta`` key ``metadata`` (JSON).
"""

from __future__ import annotations

import io
import os
import re
import sqlite3
import stat
import zlib

import numpy as np

from tensorlens.records import HISTOGRAM_INFO, HISTOGRAM_INTEGER_INFO
from tensorlens.store.errors import CorruptRunError
from tensorlens.store.readonly import connect_readonly

# 3: one row per step for all scalars and one for all histograms, packed as arrays, with the
#    names in a ``layouts`` table (a step's layout is almost always the previous step's).
#    Schema 2 stored a row per statistic keyed tensor-first, which scattered every step over
#    hundreds of B-tree pages: 5-8 ms per step of background CPU on the reference MLP, ~0.5 ms now.
# 4: a ``crc`` column on every table and row counts in ``steps``, so that damaged or missing rows
#    are refused instead of read as data.
SCHEMA_VERSION = "4"
#: The ``meta`` key holding the run's metadata as JSON (see :mod:`tensorlens.engine.metadata`).
METADATA_KEY = "metadata"
FILE_PATTERN = re.compile(r"^tensorlens(-[\w.\-]+)?\.sqlite$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL, crc INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS steps (
    mode TEXT NOT NULL, mode_step INTEGER NOT NULL, worker TEXT NOT NULL,
    step INTEGER NOT NULL, wall_time REAL NOT NULL,
    scalar_rows INTEGER NOT NULL, histogram_rows INTEGER NOT NULL, tensor_rows INTEGER NOT NULL, crc INTEGER NOT NULL,
    PRIMARY KEY (mode, mode_step, worker));
CREATE TABLE IF NOT EXISTS layouts (id INTEGER PRIMARY KEY, kind TEXT NOT NULL, names TEXT NOT NULL, crc INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS scalars (
    mode TEXT NOT NULL, mode_step INTEGER NOT NULL, worker TEXT NOT NULL,
    layout INTEGER NOT NULL, data BLOB NOT NULL, crc INTEGER NOT NULL,
    PRIMARY KEY (mode, mode_step, worker));
CREATE TABLE IF NOT EXISTS histograms (
    mode TEXT NOT NULL, mode_step INTEGER NOT NULL, worker TEXT NOT NULL,
    layout INTEGER NOT NULL, counts BLOB NOT NULL, edges BLOB NOT NULL, info BLOB NOT NULL, crc INTEGER NOT NULL,
    PRIMARY KEY (mode, mode_step, worker));
CREATE TABLE IF NOT EXISTS tensors (
    mode TEXT NOT NULL, mode_step INTEGER NOT NULL, worker TEXT NOT NULL, tensor TEXT NOT NULL,
    step INTEGER NOT NULL, wall_time REAL NOT NULL, data BLOB NOT NULL, crc INTEGER NOT NULL,
    PRIMARY KEY (mode, mode_step, worker, tensor));
CREATE TABLE IF NOT EXISTS shapes (tensor TEXT PRIMARY KEY, shape TEXT NOT NULL, crc INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS findings (
    rule TEXT NOT NULL, step INTEGER NOT NULL, mode TEXT NOT NULL, mode_step INTEGER, worker TEXT,
    tensor TEXT, message TEXT NOT NULL, value REAL, wall_time REAL NOT NULL, crc INTEGER NOT NULL);
"""

_NULL = type(None)
#: The columns of each table before ``crc``, in order, with the Python type SQLite gives back
#: (a tuple of types for a column that may be NULL).
COLUMNS: dict[str, tuple[tuple[str, type | tuple[type, ...]], ...]] = {
    "meta": (("key", str), ("value", str)),
    "steps": (
        ("mode", str), ("mode_step", int), ("worker", str), ("step", int), ("wall_time", float),
        ("scalar_rows", int), ("histogram_rows", int), ("tensor_rows", int),
    ),
    "layouts": (("id", int), ("kind", str), ("names", str)),
    "scalars": (("mode", str), ("mode_step", int), ("worker", str), ("layout", int), ("data", bytes)),
    "histograms": (
        ("mode", str), ("mode_step", int), ("worker", str), ("layout", int), ("counts", bytes), ("edges", bytes),
        ("info", bytes),
    ),
    "tensors": (
        ("mode", str), ("mode_step", int), ("worker", str), ("tensor", str), ("step", int), ("wall_time", float),
        ("data", bytes),
    ),
    "shapes": (("tensor", str), ("shape", str)),
    "findings": (
        ("rule", str), ("step", int), ("mode", str), ("mode_step", (int, _NULL)), ("worker", (str, _NULL)),
        ("tensor", (str, _NULL)), ("message", str), ("value", (float, _NULL)), ("wall_time", float),
    ),
}


def select(table: str, alias: str = "") -> str:
    """Every column of ``table`` and its ``crc``, for ``SELECT`` (a row :func:`row_checksum` can check)."""
    prefix = f"{alias}." if alias else ""
    return ", ".join(f"{prefix}{name}" for name, _ in (*COLUMNS[table], ("crc", int)))


def insert(table: str) -> str:
    """``INSERT OR REPLACE`` of a whole row of ``table`` (its columns, then ``crc``)."""
    return f"INSERT OR REPLACE INTO {table} VALUES ({', '.join('?' * (len(COLUMNS[table]) + 1))})"


def row_checksum(values: tuple[object, ...]) -> int:
    """CRC-32 of a row's values, typed and length-prefixed so that two rows never share an encoding.

    A header names every value's type and size (integers and floats in full, floats as exact hex),
    then the bytes of the texts (UTF-8) and blobs follow, so each row costs two or three C calls.

    >>> row_checksum(("train", 3)) == row_checksum(("train", 3)) != row_checksum(("train3", ""))
    True
    """
    header, payload = [], []
    for value in values:
        kind = type(value)
        if kind is bytes:
            header.append(f"b{len(value)}")  # type: ignore[arg-type]
            payload.append(value)
        elif kind is str:
            data = value.encode("utf-8", "surrogatepass")  # type: ignore[union-attr]
            header.append(f"s{len(data)}")
            payload.append(data)
        elif kind is int:
            header.append(f"i{value}")
        elif kind is float:
            header.append(f"f{value.hex()}")  # type: ignore[union-attr]
        elif value is None:
            header.append("n")
        else:
            header.append(f"?{value!r}")
    crc = zlib.crc32(",".join(header).encode())
    for data in payload:
        crc = zlib.crc32(data, crc)
    return crc


def with_checksum(*values: object) -> tuple[object, ...]:
    """A row ready for :func:`insert`: its values and their checksum."""
    return (*values, row_checksum(values))



def store_filename(worker: str, primary: bool) -> str:
    safe = re.sub(r"[^\w.\-]", "_", worker)
    return "tensorlens.sqlite" if primary else f"tensorlens-{safe}.sqlite"


def safe_run_name(name: str) -> str:
    """A run name usable as one folder name: no separators, no ``..``."""
    cleaned = re.sub(r"\.{2,}", ".", re.sub(r"[^\w.\-]", "_", str(name))).strip(".") or "run"
    return cleaned[:200]


def encode_array(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def connect(path: str, readonly: bool = False) -> sqlite3.Connection:
    """A connection for writing (WAL mode), or with ``readonly`` one for reading that needs no write
    access to the file or its folder (see :mod:`tensorlens.store.readonly`)."""
    if readonly:
        return connect_readonly(path)
    connection = sqlite3.connect(path, timeout=30, check_same_thread=False)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes; WAL keeps it consistent
    return connection


def histogram_info(row: np.ndarray) -> dict[str, object]:
    """A packed ``info`` row as the dict the reader returns (NaN -> None, counts as int)."""
    info: dict[str, object] = {}
    for key, value in zip(HISTOGRAM_INFO, row.tolist(), strict=True):
        if value != value:
            info[key] = None
        elif key in HISTOGRAM_INTEGER_INFO:
            info[key] = int(value)
        elif key == "sampled":
            info[key] = bool(value)
        else:
            info[key] = value
    return info


def file_kind(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def stat_path(path: str) -> os.stat_result:
    """``os.stat(path)``; a path that cannot be opened (a symlink loop) is a :class:`CorruptRunError`."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):  # there, but pointing nowhere: a damaged run, not a missing one
            raise CorruptRunError(path, f"it is a symbolic link to {os.readlink(path)!r}, which does not exist") from None
        raise FileNotFoundError(f"no tensorlens run at {path!r}") from None
    except OSError as err:  # a symlink loop (ELOOP), a name too long, no permission
        raise CorruptRunError(path, f"it cannot be opened: {err.strerror or err}") from None


def store_files(path: str) -> list[str]:
    """The store files of a run folder (the primary one first), or ``[path]`` for a store file.

    Never opens anything that is not a regular file or a folder: reading a FIFO blocks forever.
    """
    info = stat_path(path)
    if stat.S_ISREG(info.st_mode):
        return [path]
    if not stat.S_ISDIR(info.st_mode):
        raise CorruptRunError(path, f"it is {file_kind(info.st_mode)}, not a run folder or a store file")
    try:
        names = sorted(n for n in os.listdir(path) if FILE_PATTERN.match(n))
    except OSError as err:
        raise CorruptRunError(path, f"the folder cannot be listed: {err.strerror or err}") from None
    names.sort(key=lambda n: n != "tensorlens.sqlite")
    return [os.path.join(path, n) for n in names]
