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
Rule findings are rows of ``findings``; ``meta`` gets ``ended_at`` (a Unix time) when the writer
closes, so a reader can tell a run still being written from one that has ended (a run that
crashed never gets it). Both were added within schema 3: older files simply lack them.
Readers go through :mod:`tensorlens.store.reader`.
"""

from __future__ import annotations

import io
import os
import pathlib
import re
import sqlite3

import numpy as np

from tensorlens.modes import ModeKeys
from tensorlens.records import HISTOGRAM_INFO, HISTOGRAM_INTEGER_INFO

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
CREATE TABLE IF NOT EXISTS findings (
    rule TEXT NOT NULL, step INTEGER NOT NULL, mode TEXT NOT NULL, mode_step INTEGER, worker TEXT,
    tensor TEXT, message TEXT NOT NULL, value REAL, wall_time REAL NOT NULL);
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
        # a URI: '%', '?' and '#' in the path (escaped run names) must be percent-encoded
        uri = pathlib.Path(os.path.abspath(path)).as_uri() + "?mode=ro"
        connection = sqlite3.connect(uri, uri=True, timeout=30, check_same_thread=False)
    else:
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


def store_files(run_dir: str) -> list[str]:
    """The store files of a run folder, the primary one first."""
    if os.path.isfile(run_dir):
        return [run_dir]
    names = sorted(n for n in os.listdir(run_dir) if FILE_PATTERN.match(n))
    names.sort(key=lambda n: n != "tensorlens.sqlite")
    return [os.path.join(run_dir, n) for n in names]


def last_steps(path: str) -> dict[ModeKeys, int]:
    """The last stored step of each mode in one store file: the global step for train, the mode
    step otherwise (a resumed run goes on after them). Empty for a new or empty file."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return {}
    db = connect(path, readonly=True)
    try:
        rows = db.execute(
            "SELECT mode, MAX(CASE WHEN mode = 'train' THEN step ELSE mode_step END) FROM steps GROUP BY mode"
        ).fetchall()
    except sqlite3.DatabaseError:
        return {}
    finally:
        db.close()
    return {ModeKeys(mode): int(last) for mode, last in rows if mode in {m.value for m in ModeKeys}}
