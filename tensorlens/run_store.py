"""The local run store: one folder per run, SQLite files inside (standard library only).

Each worker that writes gets its own file, ``tensorlens.sqlite`` (or
``tensorlens-<worker>.sqlite`` for extra workers), so processes never contend for a lock.
WAL mode lets readers open the run while training writes it; each step is one transaction, so
after a crash (even ``kill -9``) the run holds every step up to the last one committed.
Tensor names are only ever stored as text, never turned into paths.

Layout (schema 3): every table is keyed by ``(mode, mode_step, worker)`` first, so a step is
appended in one place. All scalars of a step are one row, a float64 array whose names
(``[tensor, stat]`` pairs) are a row of ``layouts``; all histograms of a step are one row too
(counts, edges and an info matrix, concatenated, named by ``[tensor, bins]``). A layout is
written once and reused by every step with the same tensors. Raw tensors keep a row each.
Readers go through :mod:`tensorlens.reader`.
"""

from __future__ import annotations

import io
import json
import os
import re
import sqlite3

import numpy as np

from tensorlens.records import HISTOGRAM_INFO, HISTOGRAM_INTEGER_INFO, PackedRecord, StepRecord

# 3: one row per step for all scalars and one for all histograms, packed as arrays, with the
#    names in a ``layouts`` table (a step's layout is almost always the previous step's).
#    Schema 2 stored a row per statistic keyed tensor-first, which scattered every step over
#    hundreds of B-tree pages: 5-8 ms per step of background CPU on the reference MLP, ~0.5 ms now.
SCHEMA_VERSION = "3"
FILE_PATTERN = re.compile(r"^tensorlens(-[\w.\-]+)?\.sqlite$")

_SCHEMA = """
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


def decode_array(blob: bytes) -> np.ndarray:
    return np.load(io.BytesIO(blob), allow_pickle=False)


# Packed blobs (scalars, histogram counts, edges and info) are raw little-endian arrays: their
# dtypes are fixed, and np.save's header cost a third of a step's write time.
def decode_f8(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype="<f8").astype(np.float64)


def connect(path: str, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30, check_same_thread=False)
    else:
        connection = sqlite3.connect(path, timeout=30, check_same_thread=False)
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes; WAL keeps it consistent
    return connection


class RunStoreWriter:
    """Writes records into one SQLite file, one transaction per record."""

    def __init__(self, path: str, meta: dict[str, str] | None = None) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._db = connect(path)
        with self._db:
            self._db.executescript(_SCHEMA)
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
            for key, value in (meta or {}).items():
                self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
        self._layouts: dict[tuple[str, tuple[object, ...]], int] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}  # written already: rewriting dirties pages

    def _layout(self, kind: str, names: tuple[object, ...]) -> int:
        """The id of a layout (written in the current transaction when new)."""
        key = (kind, names)
        found = self._layouts.get(key)
        if found is None:
            cursor = self._db.execute("INSERT INTO layouts (kind, names) VALUES (?, ?)", (kind, json.dumps(list(names))))
            found = int(cursor.lastrowid)
        return found

    def write(self, record: StepRecord | PackedRecord) -> None:
        packed = record if isinstance(record, PackedRecord) else PackedRecord.from_record(record)
        where = (str(packed.mode), packed.mode_step, packed.worker)
        new_layouts: dict[tuple[str, tuple[object, ...]], int] = {}
        with self._db:  # one transaction: a step is stored whole or not at all
            self._db.execute("INSERT OR REPLACE INTO steps VALUES (?, ?, ?, ?, ?)", (*where, packed.step, packed.wall_time))
            if packed.scalar_names:
                layout = self._layout("scalars", packed.scalar_names)
                new_layouts[("scalars", packed.scalar_names)] = layout
                data = packed.scalar_values.astype("<f8", copy=False).tobytes()
                self._db.execute("INSERT OR REPLACE INTO scalars VALUES (?, ?, ?, ?, ?)", (*where, layout, data))
            if packed.histogram_names:
                layout = self._layout("histograms", packed.histogram_names)
                new_layouts[("histograms", packed.histogram_names)] = layout
                self._db.execute(
                    "INSERT OR REPLACE INTO histograms VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        *where, layout, packed.counts.astype("<i8", copy=False).tobytes(),
                        packed.edges.astype("<f8", copy=False).tobytes(), packed.histogram_info.astype("<f8", copy=False).tobytes(),
                    ),
                )
            self._db.executemany(
                "INSERT OR REPLACE INTO tensors VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(*where, t.tensor, packed.step, packed.wall_time, encode_array(t.value)) for t in packed.tensors],
            )
            shapes = {name: shape for name, shape in packed.shapes.items() if self._shapes.get(name) != shape}
            self._db.executemany(
                "INSERT OR REPLACE INTO shapes VALUES (?, ?)",
                [(name, json.dumps(list(shape))) for name, shape in shapes.items()],
            )
        # only once committed: after a failed transaction they must be written again
        self._layouts.update(new_layouts)
        self._shapes.update(shapes)

    def close(self) -> None:
        self._db.close()


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


def store_files(run_dir: str) -> list[str]:
    """The store files of a run folder, the primary one first."""
    if os.path.isfile(run_dir):
        return [run_dir]
    names = sorted(n for n in os.listdir(run_dir) if FILE_PATTERN.match(n))
    names.sort(key=lambda n: n != "tensorlens.sqlite")
    return [os.path.join(run_dir, n) for n in names]
