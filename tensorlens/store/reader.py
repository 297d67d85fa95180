"""Reading a run back: ``tl.open_run(path)``, usable while the run is still being written.

Nothing read is trusted: files, tables, rows, layouts and blobs are checked as they are read
(:mod:`tensorlens.store.validate`, :mod:`tensorlens.store.files`), and anything wrong raises
:class:`CorruptRunError` naming the file, table and step: never a hang, never garbage returned
as data.

>>> run = open_run("tensorlens_runs/my-run")                       # doctest: +SKIP
>>> run.tensor("gradients/fc1.weight").reduction_value(step=100, name="l2")  # doctest: +SKIP
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from tensorlens.findings import Finding
from tensorlens.modes import ModeKeys
from tensorlens.records import StepRecord, TensorEntry
from tensorlens.store import jsontext
from tensorlens.store.files import StepRow, StoreFile
from tensorlens.store.schema import METADATA_KEY, histogram_info, store_files
from tensorlens.store.validate import (
    CorruptRunError,
    histogram_arrays,
    scalar_values,
    tensor_array,
)

__all__ = ["CorruptRunError", "Run", "StepKey", "TensorDescriptor", "TensorNotFound", "TensorView", "open_run"]

_MODE_ORDER = {mode.value: i for i, mode in enumerate(ModeKeys)}


class TensorDescriptor(NamedTuple):
    """A raw tensor as saved: ``(step, tensor, utctime)`` (Cerebras' ``SummaryReader`` shape)."""

    step: int
    tensor: np.ndarray
    utctime: float


class StepKey(NamedTuple):
    """Which record: its mode, mode step, worker and (global) step."""

    mode: ModeKeys
    mode_step: int
    worker: str
    step: int


class TensorNotFound(KeyError):
    """The requested tensor, statistic or step is not in the run."""


class Run:
    """A run folder opened for reading. Cheap to create; every query reads the current files."""

    def __init__(self, path: str) -> None:
        files = store_files(path)
        if not files:
            raise FileNotFoundError(f"no tensorlens run store (tensorlens*.sqlite) in {path!r}")
        self.path = path
        self._files: list[StoreFile] = []
        try:
            for f in files:
                self._files.append(StoreFile(f))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- selecting steps (from checked rows only) and their rows

    def _all_steps(self) -> Iterator[tuple[StoreFile, StepRow]]:
        for f in self._files:
            for step in f.steps().values():
                yield f, step

    def _selected(self, step: int | None, mode: ModeKeys | str | None, worker: str | None) -> list[tuple[StoreFile, list[StepRow]]]:
        """Per file, its steps matching: ``mode=None`` selects train and global records by global
        step, a mode selects its records by mode step; ``None`` for ``step`` selects them all."""
        wanted = ("train", "global") if mode is None else (str(ModeKeys.coerce(mode)),)
        out = []
        for f in self._files:
            steps = [
                s for s in f.steps().values()
                if s.mode in wanted and (worker is None or s.worker == worker)
                and (step is None or (s.step if mode is None else s.mode_step) == step)
            ]
            out.append((f, sorted(steps, key=lambda s: (_MODE_ORDER[s.mode], s.mode_step, s.worker))))
        return out

    def _rows(self, table: str, step: int | None, mode: ModeKeys | str | None, worker: str | None) -> Iterator[tuple[StoreFile, StepRow, tuple[Any, ...]]]:
        for f, steps in self._selected(step, mode, worker):
            for s, row in f.rows(table, steps):
                yield f, s, row

    # -- the run

    @property
    def meta(self) -> dict[str, str]:
        """The ``meta`` entries of the run's files, as stored texts. Those holding JSON
        (``metadata``, ``config``, ``modules``) are read checked with :meth:`meta_json`."""
        return {key: value for f in self._files for key, value in f.checked("meta")}

    def meta_json(self, key: str, default: Any = None) -> Any:
        """The value of the JSON ``meta`` entry ``key`` (one of ``metadata``, ``config``,
        ``modules``) of the first file that holds it (the primary one first); ``default`` when
        none does. Read as untrusted (:mod:`tensorlens.store.jsontext`): nesting deeper than any
        writer nests, and ``NaN``/``Infinity`` in ``modules``, raise :class:`CorruptRunError`
        naming the file and the entry; in ``metadata`` and ``config`` (a user's values) non-finite
        numbers read as the texts ``"NaN"``, ``"Infinity"``, ``"-Infinity"``, as the writer stores them.

        >>> run.meta_json("modules")[0]["name"]   # doctest: +SKIP
        ''
        """
        if key not in jsontext.JSON_META_KEYS:
            raise KeyError(f"{key!r} is not a JSON entry of a run's meta (those are {sorted(jsontext.JSON_META_KEYS)})")
        for f in self._files:
            for _, value in f.checked("meta", "WHERE key = ?", (key,)):
                return jsontext.load_meta(f.path, key, value)
        return default

    @property
    def ended(self) -> bool:
        """Whether every store file of the run was closed by its writer (``meta.ended_at``): no more
        steps will come. ``False`` while training writes, and forever for a run that crashed."""
        return all(f.refresh() and f.checked("meta", "WHERE key = 'ended_at'") for f in self._files)

    def findings(self, rule: str | None = None) -> list[Finding]:
        """The rule findings stored in the run (see :mod:`tensorlens.rules`), in the order they were
        found, optionally of one rule.

        >>> run.findings("ExplodingTensor")[0].step   # doctest: +SKIP
        """
        where, args = ("WHERE rule = ? ORDER BY rowid", (rule,)) if rule else ("ORDER BY rowid", ())
        return [
            Finding(r, step, ModeKeys(m), t, msg, value, mode_step, w)
            for f in self._files for r, step, m, mode_step, w, t, msg, value, _ in f.checked("findings", where, args)
        ]

    def step_keys(self) -> list[StepKey]:
        """Every stored record's ``(mode, mode_step, worker, step)``, sorted by step, mode, mode step
        and worker: what the run holds, without reading any statistic."""
        keys = {StepKey(ModeKeys(s.mode), s.mode_step, s.worker, s.step) for _, s in self._all_steps()}
        return sorted(keys, key=lambda k: (k.step, _MODE_ORDER[k.mode.value], k.mode_step, k.worker))

    def metadata(self) -> dict[str, Any]:
        """The run's metadata as recorded when it started (configuration, model, versions, git
        commit; see :mod:`tensorlens.engine.metadata`): the primary worker's, ``{}`` if none.

        >>> run.metadata()["model"]["parameters"]   # doctest: +SKIP
        1234
        """
        for f in self._files:
            for _, value in f.checked("meta", "WHERE key = ?", (METADATA_KEY,)):
                found = jsontext.load_meta(f.path, METADATA_KEY, value)
                if not isinstance(found, dict):
                    raise CorruptRunError(f.path, f"its metadata is {type(found).__name__}, not a JSON object", "meta", f"key {METADATA_KEY!r}")
                return found
        return {}

    def workers(self) -> list[str]:
        return sorted({s.worker for _, s in self._all_steps()})

    def modes(self) -> list[ModeKeys]:
        return sorted({ModeKeys(s.mode) for _, s in self._all_steps()}, key=list(ModeKeys).index)

    def steps(self, mode: ModeKeys | str | None = None) -> list[int]:
        """Saved steps: the global steps of train (and ``GLOBAL``) records for ``mode=None``, as
        :meth:`scalars` and :meth:`TensorView.steps` read them; mode steps for a given mode."""
        return sorted({s.step if mode is None else s.mode_step for _, steps in self._selected(None, mode, None) for s in steps})

    def tensor_names(self, collection: str | None = None, regex: str | None = None) -> list[str]:
        """Names like ``"gradients/fc1.weight"``, optionally of one collection or matching ``regex``."""
        names = {t for f in self._files for layout in f.all_layouts() for t in layout.tensors}
        names |= {n for f in self._files for n in f.raw_tensor_names()}
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
        for f, s, row in self._rows("tensors", step, mode, worker):
            if row[3] == name:
                return TensorDescriptor(row[4], tensor_array(f.path, row[6], s.where), row[5])
        raise TensorNotFound(f"no raw tensor {name!r} at step {step} (is save_raw_tensor on for its collection?)")

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self._stored_shapes().get(name)

    def scalars(self, step: int, mode: ModeKeys | str | None = None, worker: str | None = None) -> dict[str, float]:
        """Every scalar of one step as ``{key: value}`` (keys ``"collection/tensor/stat"``)."""
        out = {}
        for f, s, row in self._rows("scalars", step, mode, worker):
            layout = f.row_layout("scalars", row)
            values = scalar_values(f.path, layout, row[4], s.where).tolist()
            for (tensor, stat), i in layout.scalar_index.items():
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
        wanted = None if mode is None else str(ModeKeys.coerce(mode))
        keys = sorted(
            ((s.step, _MODE_ORDER[s.mode], s.mode_step, s.worker, k), s)
            for k, f in enumerate(self._files) for s in f.steps().values()
            if (wanted is None or s.mode == wanted) and (worker is None or s.worker == worker)
            and (start_step is None or s.step >= start_step) and (end_step is None or s.step < end_step)
        )
        stored_shapes = self._stored_shapes()
        for (*_, k), s in keys:
            yield self._record(self._files[k], s, stored_shapes)

    def _record(self, f: StoreFile, s: StepRow, stored_shapes: dict[str, tuple[int, ...]]) -> StepRecord:
        arrays: dict[str, Any] = {}
        for _, row in f.rows("scalars", [s]):
            layout = f.row_layout("scalars", row)
            arrays["scalar_names"] = layout.names
            arrays["scalar_values"] = scalar_values(f.path, layout, row[4], s.where)
        for _, row in f.rows("histograms", [s]):
            layout = f.row_layout("histograms", row)
            counts, edges, info = histogram_arrays(f.path, layout, *row[4:7], s.where)
            arrays.update(histogram_names=layout.names, counts=counts, edges=edges, histogram_info=info)
        tensors = [TensorEntry(row[3], tensor_array(f.path, row[6], s.where)) for _, row in f.rows("tensors", [s])]
        try:
            record = StepRecord.from_arrays(s.step, s.mode, s.mode_step, s.worker, s.wall_time, tensors=tensors, **arrays)
        except ValueError as err:  # arrays that do not fit their names (checked above; a last guard)
            raise CorruptRunError(f.path, str(err), None, s.where) from None
        if not stored_shapes:  # the usual run (save_shape off): no scan of the record's names
            return record
        shapes = {name: stored_shapes[name] for name in record.tensor_names() if name in stored_shapes}
        if not shapes:
            return record
        return StepRecord.from_arrays(s.step, s.mode, s.mode_step, s.worker, s.wall_time, tensors=tensors, shapes=shapes, **arrays)

    def _stored_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: value for f in self._files for name, value in f.shapes().items()}


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
        found = set()
        for table in ("scalars", "histograms"):
            for f, s, row in self.run._rows(table, None, mode, None):
                if self.name in f.row_layout(table, row).tensors:
                    found.add(s.step if mode is None else s.mode_step)
        found |= {s.step if mode is None else s.mode_step for _, s, row in self.run._rows("tensors", None, mode, None) if row[3] == self.name}
        return sorted(found)

    def reduction_names(self) -> list[str]:
        return sorted({
            stat for f in self.run._files for layout in f.all_layouts()
            for (tensor, stat) in layout.scalar_index if tensor == self.name and stat
        })

    def _values(
        self, step: int | None, stat: str, mode: ModeKeys | str | None, worker: str | None, plain: bool = False
    ) -> Iterator[tuple[StepRow, float, bool]]:
        """``(step, value, is_plain)`` of ``stat``; with ``plain``, the tensor's plain value where
        it has no such statistic."""
        for f, s, row in self.run._rows("scalars", step, mode, worker):
            index = f.row_layout("scalars", row).scalar_index
            position = index.get((self.name, stat))
            if position is None and plain:
                position = index.get((self.name, ""))
                if position is not None:
                    yield s, struct.unpack_from("<d", row[4], 8 * position)[0], True
                continue
            if position is not None:
                yield s, struct.unpack_from("<d", row[4], 8 * position)[0], False

    def reduction_value(
        self, step: int, name: str, abs: bool = False, mode: ModeKeys | str | None = None, worker: str | None = None
    ) -> float:
        """One statistic at one step. ``abs=True`` reads ``abs_<name>``. With ``mode``, ``step`` is the mode step.

        A plain scalar (a loss, ``save_scalar``) answers ``mean``, ``min``, ``max``, ``sum``,
        ``median`` and ``prod`` with its value (the statistics of one number), and the norms and
        ``abs_*`` with ``|value|``. ``abs_max`` (= ``linf``) comes from ``min`` and ``max`` when it
        was not recorded itself.
        """
        stat = f"abs_{name}" if abs and not name.startswith("abs_") else name
        mode = self._mode(mode)
        base = stat.removeprefix("abs_")
        of_one_number = bool(stat) and (base in _OF_ONE_NUMBER or base in _NORMS_OF_ONE_NUMBER)
        plain = None
        for _, value, is_plain in self._values(step, stat, mode, worker, plain=of_one_number):
            if not is_plain:
                return value
            if plain is None:
                plain = value
        if plain is not None:  # `abs` is an argument here
            return math.fabs(plain) if stat.startswith("abs_") or base in _NORMS_OF_ONE_NUMBER else plain
        if stat in _FROM_MIN_AND_MAX:  # max |x| is max(|min|, |max|), and every tensor has both
            bounds = [next((v for _, v, p in self._values(step, b, mode, worker) if not p), None) for b in ("min", "max")]
            if None not in bounds:
                low, high = bounds
                return math.nan if math.isnan(low) or math.isnan(high) else max(math.fabs(low), math.fabs(high))
        raise TensorNotFound(self._missing(stat, step, mode))

    def _missing(self, stat: str, step: int, mode: ModeKeys | str | None) -> str:
        saved = self.steps(mode)
        shown = saved if len(saved) <= 12 else [*saved[:5], "...", *saved[-5:]]
        where = "at step" if mode is None else f"at {ModeKeys.coerce(mode)} step"
        if step not in saved:
            return f"{self.name!r} has no record {where} {step}; saved steps: {shown}"
        names = self.reduction_names()
        if not names:
            return f"{self.name!r} is a plain value, not statistics: read it with .value(step) / .values()"
        return f"no {stat!r} of {self.name!r} {where} {step}; its statistics: {names}"

    def reduction_values(self, name: str, abs: bool = False, mode: ModeKeys | str | None = None, worker: str | None = None) -> dict[int, float]:
        """``{step: value}`` of one statistic over the whole run."""
        stat = f"abs_{name}" if abs and not name.startswith("abs_") else name
        mode = self._mode(mode)
        out = {s.step if mode is None else s.mode_step: value for s, value, _ in self._values(None, stat, mode, worker)}
        return dict(sorted(out.items()))

    def value(self, step: int, mode: ModeKeys | str | None = None, worker: str | None = None) -> float:
        """A plain scalar (a loss, ``save_scalar``, ``summarize_scalar``) at one step."""
        return self.reduction_value(step, "", mode=mode, worker=worker)

    def values(self, mode: ModeKeys | str | None = None, worker: str | None = None) -> dict[int, float]:
        """``{step: value}`` of a plain scalar (a loss, ``save_scalar``, ``summarize_scalar``)."""
        found = self.reduction_values("", mode=mode, worker=worker)
        if not found and self.reduction_names():
            raise TensorNotFound(
                f"{self.name!r} holds statistics, not a plain value: read one with "
                f".reduction_values(name) for a name in {self.reduction_names()}"
            )
        return found

    def histogram(self, step: int, mode: ModeKeys | str | None = None, worker: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(counts, edges)`` at one step."""
        counts, edges, _ = self.histogram_with_info(step, mode, worker)
        return counts, edges

    def histogram_with_info(self, step: int, mode: ModeKeys | str | None = None, worker: str | None = None) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
        for f, s, row in self.run._rows("histograms", step, self._mode(mode), worker):
            layout = f.row_layout("histograms", row)
            found = layout.histogram_index.get(self.name)
            if found is not None:
                index, bins, counts_at, edges_at = found
                counts, edges, info = histogram_arrays(f.path, layout, *row[4:7], s.where)
                return (
                    counts[counts_at : counts_at + bins].copy(),
                    edges[edges_at : edges_at + bins + 1].copy(),
                    histogram_info(info[index]),
                )
        raise TensorNotFound(f"no histogram of {self.name!r} at step {step}")


#: The collection of epoch aggregates (:mod:`tensorlens.dispatch.epochs`), read by epoch.
EPOCHS_COLLECTION = "epochs"
#: Statistics a plain scalar answers with its own value (the statistics of one number).
_OF_ONE_NUMBER = frozenset({"mean", "min", "max", "sum", "median", "prod"})
_NORMS_OF_ONE_NUMBER = frozenset({"l1", "l2", "linf"})
#: Statistics the reader derives exactly from a tensor's min and max when they were not recorded.
_FROM_MIN_AND_MAX = frozenset({"abs_max", "linf", "abs_linf"})


def open_run(path: str) -> Run:
    """Open a run folder (or one of its ``tensorlens*.sqlite`` files) for reading.

    Raises ``FileNotFoundError`` when there is no run at ``path``, and :class:`CorruptRunError`
    when what is there is not a readable run store (saying what is wrong and where). Reading needs
    no write access; ``PermissionError`` only where steps live in a ``-wal`` log that SQLite cannot
    read without creating its ``-shm`` index (see :mod:`tensorlens.store.readonly`).

    >>> run = open_run(hook.run_dir)            # doctest: +SKIP
    >>> run.tensor_names(collection="gradients")  # doctest: +SKIP
    ['gradients/fc1.weight', ...]
    """
    return Run(path)
