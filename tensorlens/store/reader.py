"""Reading a run back: ``tl.open_run(path)``, usable while the run is still being written.

>>> run = open_run("tensorlens_runs/my-run")                       # doctest: +SKIP
>>> run.tensor("gradients/fc1.weight").reduction_value(step=100, name="l2")  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import struct
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from tensorlens.modes import ModeKeys
from tensorlens.records import StepRecord, TensorEntry
from tensorlens.store.schema import (
    HISTOGRAM_INFO,
    SCHEMA_VERSION,
    connect,
    decode_array,
    decode_f8,
    histogram_info,
    store_files,
)


class TensorDescriptor(NamedTuple):
    """A raw tensor as saved: ``(step, tensor, utctime)`` (Cerebras' ``SummaryReader`` shape)."""

    step: int
    tensor: np.ndarray
    utctime: float


class TensorNotFound(KeyError):
    """The requested tensor, statistic or step is not in the run."""


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The names of one packed row (see :mod:`tensorlens.store.schema`): which value is which."""

    kind: str  # "scalars" or "histograms"
    names: tuple[tuple[str, Any], ...]  # (tensor, stat) or (tensor, bins), as stored
    tensors: frozenset[str]
    scalar_index: dict[tuple[str, str], int]  # (tensor, stat) -> position (the last one if repeated)
    histogram_index: dict[str, tuple[int, int, int, int]]  # tensor -> (row, bins, counts offset, edges offset)

    @classmethod
    def parse(cls, kind: str, names: list[list[Any]]) -> _Layout:
        if kind == "scalars":
            pairs = tuple((str(tensor), str(stat)) for tensor, stat in names)
            index = {pair: i for i, pair in enumerate(pairs)}
            return cls(kind, pairs, frozenset(t for t, _ in pairs), index, {})
        hist_index, counts_at, edges_at = {}, 0, 0
        pairs = tuple((str(tensor), int(bins)) for tensor, bins in names)
        for row, (tensor, bins) in enumerate(pairs):
            hist_index[tensor] = (row, bins, counts_at, edges_at)
            counts_at += bins
            edges_at += bins + 1
        return cls(kind, pairs, frozenset(hist_index), {}, hist_index)


class Run:
    """A run folder opened for reading. Cheap to create; every query reads the current files."""

    def __init__(self, path: str) -> None:
        files = store_files(path)
        if not files:
            raise FileNotFoundError(f"no tensorlens run store (tensorlens*.sqlite) in {path!r}")
        self.path = path
        self._dbs = [connect(f, readonly=True) for f in files]
        self._layouts: dict[tuple[int, int], _Layout] = {}  # (file, layout id): immutable once written
        for f, db in zip(files, self._dbs, strict=True):
            try:
                found = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            except sqlite3.OperationalError:  # created but not yet initialised by its writer
                continue
            if found is not None and found[0] != SCHEMA_VERSION:
                self.close()
                raise ValueError(
                    f"{f!r} has run store schema {found[0]}; this tensorlens reads schema {SCHEMA_VERSION} "
                    "(open it with the tensorlens version that wrote it)"
                )

    def close(self) -> None:
        for db in self._dbs:
            db.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
        for db in self._dbs:
            try:
                yield from db.execute(sql, args)
            except sqlite3.OperationalError as err:  # a worker's file created but not yet initialised
                if "no such table" not in str(err):
                    raise

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> Iterator[tuple[int, tuple[Any, ...]]]:
        """Like :meth:`_query`, with the index of the file each row comes from."""
        for k, db in enumerate(self._dbs):
            try:
                for row in db.execute(sql, args):
                    yield k, row
            except sqlite3.OperationalError as err:
                if "no such table" not in str(err):
                    raise

    def _layout(self, file: int, layout_id: int) -> _Layout:
        found = self._layouts.get((file, layout_id))
        if found is None:
            kind, names = self._dbs[file].execute("SELECT kind, names FROM layouts WHERE id = ?", (layout_id,)).fetchone()
            found = self._layouts[(file, layout_id)] = _Layout.parse(kind, json.loads(names))
        return found

    def _all_layouts(self) -> list[_Layout]:
        return [self._layout(k, layout_id) for k, (layout_id,) in self._rows("SELECT id FROM layouts")]

    @property
    def meta(self) -> dict[str, str]:
        return dict(self._query("SELECT key, value FROM meta"))

    def workers(self) -> list[str]:
        return sorted({w for (w,) in self._query("SELECT DISTINCT worker FROM steps")})

    def modes(self) -> list[ModeKeys]:
        return sorted({ModeKeys(m) for (m,) in self._query("SELECT DISTINCT mode FROM steps")}, key=list(ModeKeys).index)

    def steps(self, mode: ModeKeys | str | None = None) -> list[int]:
        """Saved steps: the global steps of train (and ``GLOBAL``) records for ``mode=None``, as
        :meth:`scalars` and :meth:`TensorView.steps` read them; mode steps for a given mode."""
        if mode is None:
            return sorted({s for (s,) in self._query("SELECT DISTINCT step FROM steps WHERE mode IN ('train', 'global')")})
        mode = ModeKeys.coerce(mode)
        return sorted({s for (s,) in self._query("SELECT DISTINCT mode_step FROM steps WHERE mode = ?", (str(mode),))})

    def tensor_names(self, collection: str | None = None, regex: str | None = None) -> list[str]:
        """Names like ``"gradients/fc1.weight"``, optionally of one collection or matching ``regex``."""
        import re

        names = {t for layout in self._all_layouts() for t in layout.tensors}
        names |= {t for (t,) in self._query("SELECT DISTINCT tensor FROM tensors")}
        if collection is not None:
            names = {n for n in names if n.split("/", 1)[0] == collection}
        if regex is not None:
            pattern = re.compile(regex)
            names = {n for n in names if pattern.search(n)}
        return sorted(names)

    def collections(self) -> list[str]:
        return sorted({n.split("/", 1)[0] for n in self.tensor_names()})

    def tensor(self, name: str) -> TensorView:
        if name not in self.tensor_names():
            raise TensorNotFound(f"no tensor {name!r} in run {self.path!r}; see run.tensor_names()")
        return TensorView(self, name)

    def read_tensor(self, name: str, step: int, mode: ModeKeys | str | None = None, worker: str | None = None) -> TensorDescriptor:
        """The raw tensor saved for ``name`` at ``step`` (needs ``save_raw_tensor=True``)."""
        where, args = _where(step, mode, worker)
        rows = list(self._query(f"SELECT t.step, t.wall_time, t.data {_JOIN.format(table='tensors')} WHERE t.tensor = ? AND {where}", (name, *args)))
        if not rows:
            raise TensorNotFound(f"no raw tensor {name!r} at step {step} (is save_raw_tensor on for its collection?)")
        step_, wall_time, data = rows[0]
        return TensorDescriptor(step_, decode_array(data), wall_time)

    def shape(self, name: str) -> tuple[int, ...] | None:
        rows = list(self._query("SELECT shape FROM shapes WHERE tensor = ?", (name,)))
        return tuple(json.loads(rows[0][0])) if rows else None

    def scalars(self, step: int, mode: ModeKeys | str | None = None, worker: str | None = None) -> dict[str, float]:
        """Every scalar of one step as ``{key: value}`` (keys ``"collection/tensor/stat"``)."""
        where, args = _where(step, mode, worker)
        out = {}
        for k, (layout_id, data) in self._rows(f"SELECT t.layout, t.data {_JOIN.format(table='scalars')} WHERE {where}", args):
            values = decode_f8(data).tolist()
            for (tensor, stat), i in self._layout(k, layout_id).scalar_index.items():
                out[f"{tensor}/{stat}" if stat else tensor] = values[i]
        return out

    def records(
        self,
        mode: ModeKeys | str | None = None,
        start_step: int | None = None,
        end_step: int | None = None,
        worker: str | None = None,
    ) -> Iterator[StepRecord]:
        """Every stored step as a :class:`~tensorlens.records.StepRecord`, the type live backends
        receive, in order of (step, mode, mode step, worker).

        ``mode=None`` yields the records of every mode; ``start_step`` (inclusive) and ``end_step``
        (exclusive) bound the global step. Reads step by step, so a long run never sits in memory.

        >>> for record in run.records(mode="train", start_step=100):   # doctest: +SKIP
        ...     record.scalar("gradients/fc1.weight", "l2")
        """
        clauses, args = [], []
        if mode is not None:
            clauses.append("mode = ?")
            args.append(str(ModeKeys.coerce(mode)))
        if start_step is not None:
            clauses.append("step >= ?")
            args.append(int(start_step))
        if end_step is not None:
            clauses.append("step < ?")
            args.append(int(end_step))
        if worker is not None:
            clauses.append("worker = ?")
            args.append(worker)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        keys = sorted(
            (step, list(ModeKeys).index(ModeKeys(m)), mode_step, w, k, wall_time)
            for k, (m, mode_step, w, step, wall_time) in self._rows(
                f"SELECT mode, mode_step, worker, step, wall_time FROM steps {where}", tuple(args)
            )
        )
        stored_shapes = self._stored_shapes()
        for step, mode_index, mode_step, w, k, wall_time in keys:
            yield self._record(k, list(ModeKeys)[mode_index], mode_step, w, step, wall_time, stored_shapes)

    def _record(
        self, k: int, mode: ModeKeys, mode_step: int, worker: str, step: int, wall_time: float,
        stored_shapes: dict[str, tuple[int, ...]],
    ) -> StepRecord:
        db, key = self._dbs[k], (str(mode), mode_step, worker)
        where = "WHERE mode = ? AND mode_step = ? AND worker = ?"
        arrays: dict[str, Any] = {}
        found = db.execute(f"SELECT layout, data FROM scalars {where}", key).fetchone()
        if found is not None:
            layout = self._layout(k, found[0])
            arrays["scalar_names"] = layout.names
            arrays["scalar_values"] = decode_f8(found[1])
        found = db.execute(f"SELECT layout, counts, edges, info FROM histograms {where}", key).fetchone()
        if found is not None:
            layout = self._layout(k, found[0])
            arrays["histogram_names"] = layout.names
            arrays["counts"] = np.frombuffer(found[1], dtype="<i8").astype(np.int64)
            arrays["edges"] = decode_f8(found[2])
            arrays["histogram_info"] = decode_f8(found[3])
        tensors = [
            TensorEntry(name, decode_array(data))
            for name, data in db.execute(f"SELECT tensor, data FROM tensors {where} ORDER BY rowid", key)
        ]
        record = StepRecord.from_arrays(step, mode, mode_step, worker, wall_time, tensors=tensors, **arrays)
        shapes = {name: stored_shapes[name] for name in record.tensor_names() if name in stored_shapes}
        if not shapes:
            return record
        return StepRecord.from_arrays(step, mode, mode_step, worker, wall_time, tensors=tensors, shapes=shapes, **arrays)

    def _stored_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(json.loads(shape)) for name, shape in self._query("SELECT tensor, shape FROM shapes")}


#: Rows of ``table`` (as ``t``) for the steps (``st``) selected by :func:`_where`. The data tables
#: are keyed step-first, so the steps table is scanned (one row per step) and each step's rows
#: are found by key; CROSS JOIN makes SQLite keep that order.
_JOIN = (
    "FROM steps AS st CROSS JOIN {table} AS t "
    "ON t.mode = st.mode AND t.mode_step = st.mode_step AND t.worker = st.worker"
)


#: The collection of epoch aggregates (:mod:`tensorlens.engine.epochs`), read by epoch.
EPOCHS_COLLECTION = "epochs"


def _where(step: int | None, mode: ModeKeys | str | None, worker: str | None) -> tuple[str, tuple[Any, ...]]:
    """A condition on the steps table ``st``: one step (or every step when ``step`` is None)."""
    if mode is None:
        clause, args = "st.mode IN ('train', 'global')", []
        if step is not None:
            clause, args = "st.step = ? AND " + clause, [step]
    else:
        clause, args = "st.mode = ?", [str(ModeKeys.coerce(mode))]
        if step is not None:
            clause, args = "st.mode_step = ? AND " + clause, [step, *args]
    if worker is not None:
        clause += " AND st.worker = ?"
        args.append(worker)
    return clause, tuple(args)


def _scalar(data: bytes, position: int) -> float:
    return struct.unpack_from("<d", data, 8 * position)[0]


class TensorView:
    """One tensor's series of statistics, histograms and raw values.

    Epoch aggregates (``epochs/...``, recorded by ``hook.end_epoch()``) are read by epoch:
    ``run.tensor("epochs/gradients/fc1.weight").reduction_value(step=3, name="l2_mean")`` is
    epoch 3 (their records have mode ``epoch`` and the epoch as mode step).
    """

    def __init__(self, run: Run, name: str) -> None:
        self.run = run
        self.name = name
        self._default_mode = ModeKeys.EPOCH if name.startswith(f"{EPOCHS_COLLECTION}/") else None

    def _mode(self, mode: ModeKeys | str | None) -> ModeKeys | str | None:
        return self._default_mode if mode is None else mode

    def __repr__(self) -> str:
        return f"TensorView({self.name!r})"

    def steps(self, mode: ModeKeys | str | None = None) -> list[int]:
        mode = self._mode(mode)
        column = "step" if mode is None else "mode_step"
        clause, args = _where(None, mode, None)
        found = set()
        for table in ("scalars", "histograms"):
            query = f"SELECT st.{column}, t.layout {_JOIN.format(table=table)} WHERE {clause}"
            found |= {s for k, (s, layout_id) in self.run._rows(query, args) if self.name in self.run._layout(k, layout_id).tensors}
        query = f"SELECT DISTINCT st.{column} {_JOIN.format(table='tensors')} WHERE t.tensor = ? AND {clause}"
        found |= {s for (s,) in self.run._query(query, (self.name, *args))}
        return sorted(found)

    def reduction_names(self) -> list[str]:
        return sorted({
            stat for layout in self.run._all_layouts() for (tensor, stat) in layout.scalar_index if tensor == self.name and stat
        })

    def reduction_value(
        self, step: int, name: str, abs: bool = False, mode: ModeKeys | str | None = None, worker: str | None = None
    ) -> float:
        """One statistic at one step. ``abs=True`` reads ``abs_<name>``. With ``mode``, ``step`` is the mode step."""
        stat = f"abs_{name}" if abs and not name.startswith("abs_") else name
        mode = self._mode(mode)
        where, args = _where(step, mode, worker)
        query = f"SELECT t.layout, t.data {_JOIN.format(table='scalars')} WHERE {where}"
        for k, (layout_id, data) in self.run._rows(query, args):
            position = self.run._layout(k, layout_id).scalar_index.get((self.name, stat))
            if position is not None:
                return _scalar(data, position)
        raise TensorNotFound(f"no {stat!r} of {self.name!r} at step {step}; recorded: {self.reduction_names()}")

    def reduction_values(self, name: str, abs: bool = False, mode: ModeKeys | str | None = None, worker: str | None = None) -> dict[int, float]:
        """``{step: value}`` of one statistic over the whole run."""
        stat = f"abs_{name}" if abs and not name.startswith("abs_") else name
        mode = self._mode(mode)
        column = "step" if mode is None else "mode_step"
        clause, args = _where(None, mode, worker)
        query = f"SELECT st.{column}, t.layout, t.data {_JOIN.format(table='scalars')} WHERE {clause}"
        out = {}
        for k, (s, layout_id, data) in self.run._rows(query, args):
            position = self.run._layout(k, layout_id).scalar_index.get((self.name, stat))
            if position is not None:
                out[s] = _scalar(data, position)
        return dict(sorted(out.items()))

    def value(self, step: int, mode: ModeKeys | str | None = None, worker: str | None = None) -> float:
        """A plain scalar (a loss, ``save_scalar``, ``summarize_scalar``) at one step."""
        return self.reduction_value(step, "", mode=mode, worker=worker)

    def values(self, mode: ModeKeys | str | None = None, worker: str | None = None) -> dict[int, float]:
        return self.reduction_values("", mode=mode, worker=worker)

    def histogram(self, step: int, mode: ModeKeys | str | None = None, worker: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(counts, edges)`` at one step."""
        counts, edges, _ = self.histogram_with_info(step, mode, worker)
        return counts, edges

    def histogram_with_info(self, step: int, mode: ModeKeys | str | None = None, worker: str | None = None) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
        where, args = _where(step, self._mode(mode), worker)
        query = f"SELECT t.layout, t.counts, t.edges, t.info {_JOIN.format(table='histograms')} WHERE {where}"
        for k, (layout_id, counts, edges, info) in self.run._rows(query, args):
            found = self.run._layout(k, layout_id).histogram_index.get(self.name)
            if found is not None:
                row, bins, counts_at, edges_at = found
                width = len(HISTOGRAM_INFO)
                return (
                    np.frombuffer(counts, dtype="<i8", count=bins, offset=8 * counts_at).astype(np.int64),
                    np.frombuffer(edges, dtype="<f8", count=bins + 1, offset=8 * edges_at).astype(np.float64),
                    histogram_info(np.frombuffer(info, dtype="<f8", count=width, offset=8 * width * row)),
                )
        raise TensorNotFound(f"no histogram of {self.name!r} at step {step}")


def open_run(path: str) -> Run:
    """Open a run folder (or one of its ``tensorlens*.sqlite`` files) for reading.

    >>> run = open_run(hook.run_dir)            # doctest: +SKIP
    >>> run.tensor_names(collection="gradients")  # doctest: +SKIP
    ['gradients/fc1.weight', ...]
    """
    return Run(path)
