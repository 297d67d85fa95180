"""The record: everything one saved step produced, in one backend-neutral type.

A :class:`StepRecord` holds a step's statistics as arrays (one float64 array of scalar values
named by ``(tensor, stat)`` pairs; histogram counts, edges and info rows concatenated), built once
per step by :mod:`tensorlens.dispatch.assemble` and shared by every backend, and yielded again by
:meth:`tensorlens.Run.records` when a stored run is read back. Rules, reports, run comparison and
replay into trackers therefore take one input, live or stored.

Backends that iterate entries (``record.scalars``, ``record.histograms``) get lazy views built on
first use and cached; the local store writes the arrays directly, so a step of a few thousand
statistics never becomes a few thousand Python objects unless a tracker asks for them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from tensorlens.modes import ModeKeys


class ScalarEntry(NamedTuple):
    """One number: a statistic of a tensor (``stat`` set) or a plain scalar such as a loss.

    A named tuple rather than a dataclass: a step makes hundreds, on the dispatcher thread,
    and a frozen dataclass costs several times more to build.
    """

    tensor: str  # "{collection}/{name}", e.g. "gradients/fc1.weight"
    stat: str | None  # "l2", "abs_max", ...; None for a plain scalar
    value: float

    @property
    def key(self) -> str:
        """``"{collection}/{tensor}/{stat}"``, e.g. ``"gradients/fc1.weight/l2"``."""
        return f"{self.tensor}/{self.stat}" if self.stat else self.tensor


@dataclasses.dataclass(frozen=True)
class HistogramEntry:
    """Counts over ``edges`` (``len(edges) == len(counts) + 1``; numpy's bin semantics).

    ``count`` is the number of binned values. ``sum`` and ``sum_squares`` are over the whole
    tensor (all values, exact). NaN and Inf are never binned: they are counted here.
    ``sampled`` says the bins hold a strided sample (see ``HistogramConfig.sample``).
    """

    tensor: str
    counts: np.ndarray  # int64, shape [bins]
    edges: np.ndarray  # float64, shape [bins + 1]
    min: float
    max: float
    count: int
    sum: float
    sum_squares: float
    nan_count: int = 0
    inf_count: int = 0
    rejected: int = 0
    underflow: int = 0
    overflow: int = 0
    sampled: bool = False


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """A raw tensor saved as a numpy array (``ReductionConfig.save_raw_tensor``)."""

    tensor: str
    value: np.ndarray


#: Columns of a histogram's ``info`` row (float64; NaN where absent): fields of
#: :class:`HistogramEntry`, in the order the run store keeps them.
HISTOGRAM_INFO = (
    "min", "max", "count", "sum", "sum_squares", "nan_count", "inf_count", "rejected", "underflow", "overflow", "sampled",
)
#: The :data:`HISTOGRAM_INFO` columns that hold counts (integers stored as float64).
HISTOGRAM_INTEGER_INFO = frozenset({"count", "nan_count", "inf_count", "rejected", "underflow", "overflow"})

_NO_COUNTS = np.zeros(0, dtype=np.int64)
_NO_EDGES = np.zeros(0, dtype=np.float64)
_NO_VALUES = np.zeros(0, dtype=np.float64)


def histogram_entry(tensor: str, counts: np.ndarray, edges: np.ndarray, info: Iterable[float]) -> HistogramEntry:
    """The :class:`HistogramEntry` of one histogram of a record (``info`` in :data:`HISTOGRAM_INFO` order)."""
    # unpacked by position (the order of HISTOGRAM_INFO): every tracker builds ~100 of these per
    # record on a thread that shares the GIL with training, and a dict of fields cost twice this
    low, high, count, total, squares, nan, inf, rejected, under, over, sampled = (
        info.tolist() if isinstance(info, np.ndarray) else info
    )
    return HistogramEntry(
        tensor, counts, edges, float(low), float(high), int(count), float(total), float(squares),
        int(nan), int(inf), int(rejected), int(under), int(over), bool(sampled),
    )


#: What makes a record: the arguments of :meth:`StepRecord.from_arrays` (and :meth:`StepRecord.replace`).
_RECORD_FIELDS = (
    "step", "mode", "mode_step", "worker", "wall_time", "scalar_names", "scalar_values", "histogram_names", "counts",
    "edges", "histogram_info", "tensors", "shapes",
)


class StepRecord:
    """Everything recorded for one (mode, mode step) of one worker.

    Build one from entries (``StepRecord(step, mode, mode_step, worker, wall_time,
    scalars=[...], histograms=[...])``), or from arrays with :meth:`from_arrays` (the engine and
    the reader do). Either way it holds arrays; :attr:`scalars` and :attr:`histograms` are views
    made on first use. A record is immutable: backends on several threads share one.

    >>> r = StepRecord(3, ModeKeys.TRAIN, 3, "worker_0", 0.0, scalars=[ScalarEntry("gradients/w", "l2", 2.0)])
    >>> r.scalar("gradients/w", "l2"), r.scalar_dict()
    (2.0, {'gradients/w/l2': 2.0})
    """

    __slots__ = (
        "step", "mode", "mode_step", "worker", "wall_time", "scalar_names", "scalar_values", "histogram_names",
        "counts", "edges", "histogram_info", "tensors", "shapes", "__dict__",
    )

    def __init__(
        self,
        step: int,
        mode: ModeKeys | str,
        mode_step: int,
        worker: str,
        wall_time: float,
        scalars: Iterable[ScalarEntry] = (),
        histograms: Iterable[HistogramEntry] = (),
        tensors: Iterable[TensorEntry] = (),
        shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        scalars = list(scalars)
        histograms = list(histograms)
        self._init(
            step, mode, mode_step, worker, wall_time,
            scalar_names=tuple((e.tensor, e.stat or "") for e in scalars),
            scalar_values=np.fromiter((e.value for e in scalars), dtype=np.float64, count=len(scalars)),
            histogram_names=tuple((h.tensor, len(h.counts)) for h in histograms),
            counts=np.concatenate([np.asarray(h.counts, dtype=np.int64) for h in histograms]) if histograms else _NO_COUNTS,
            edges=np.concatenate([np.asarray(h.edges, dtype=np.float64) for h in histograms]) if histograms else _NO_EDGES,
            histogram_info=np.array(
                [[float(getattr(h, key)) for key in HISTOGRAM_INFO] for h in histograms], dtype=np.float64
            ).reshape(len(histograms), len(HISTOGRAM_INFO)),
            tensors=tensors,
            shapes=shapes,
        )
        # the entries given are the views: no need to rebuild them from the arrays
        self.__dict__["scalars"] = tuple(ScalarEntry(e.tensor, e.stat or None, float(e.value)) for e in scalars)
        self.__dict__["histograms"] = tuple(histograms)

    @classmethod
    def from_arrays(
        cls,
        step: int,
        mode: ModeKeys | str,
        mode_step: int,
        worker: str,
        wall_time: float,
        *,
        scalar_names: tuple[tuple[str, str], ...] = (),
        scalar_values: np.ndarray = _NO_VALUES,
        histogram_names: tuple[tuple[str, int], ...] = (),
        counts: np.ndarray = _NO_COUNTS,
        edges: np.ndarray = _NO_EDGES,
        histogram_info: np.ndarray | None = None,
        tensors: Iterable[TensorEntry] = (),
        shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> StepRecord:
        """A record from its arrays: ``scalar_names`` are ``(tensor, stat or "")`` pairs with their
        ``scalar_values``; ``histogram_names`` are ``(tensor, bins)`` pairs whose counts and edges
        follow one another in ``counts`` and ``edges``, with one :data:`HISTOGRAM_INFO` row each."""
        record = cls.__new__(cls)
        record._init(
            step, mode, mode_step, worker, wall_time, scalar_names=tuple(scalar_names),
            scalar_values=np.asarray(scalar_values, dtype=np.float64), histogram_names=tuple(histogram_names),
            counts=np.asarray(counts, dtype=np.int64), edges=np.asarray(edges, dtype=np.float64),
            histogram_info=(
                np.asarray(histogram_info, dtype=np.float64) if histogram_info is not None
                else np.zeros((0, len(HISTOGRAM_INFO)))
            ).reshape(len(histogram_names), len(HISTOGRAM_INFO)),
            tensors=tensors, shapes=shapes,
        )
        return record

    def _init(self, step: int, mode: ModeKeys | str, mode_step: int, worker: str, wall_time: float, *,
              scalar_names: tuple[tuple[str, str], ...], scalar_values: np.ndarray,
              histogram_names: tuple[tuple[str, int], ...], counts: np.ndarray, edges: np.ndarray,
              histogram_info: np.ndarray, tensors: Iterable[TensorEntry],
              shapes: Mapping[str, tuple[int, ...]] | None) -> None:
        if len(scalar_names) != len(scalar_values):
            raise ValueError(f"{len(scalar_names)} scalar names for {len(scalar_values)} values")
        bins = sum(b for _, b in histogram_names)
        if len(counts) != bins or len(edges) != bins + len(histogram_names):
            raise ValueError(f"histogram arrays do not match their names ({len(counts)} counts for {bins} bins)")
        set_ = object.__setattr__
        set_(self, "step", int(step))
        set_(self, "mode", ModeKeys.coerce(mode))
        set_(self, "mode_step", int(mode_step))
        set_(self, "worker", str(worker))
        set_(self, "wall_time", float(wall_time))
        set_(self, "scalar_names", scalar_names)
        set_(self, "scalar_values", scalar_values)
        set_(self, "histogram_names", histogram_names)
        set_(self, "counts", counts)
        set_(self, "edges", edges)
        set_(self, "histogram_info", histogram_info)
        set_(self, "tensors", tuple(tensors))
        set_(self, "shapes", MappingProxyType(dict(shapes or {})))
        for array in (scalar_values, counts, edges, histogram_info):
            array.flags.writeable = False  # shared by every backend's thread

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a StepRecord is immutable (shared by every backend); cannot set {name!r}")

    # ------------------------------------------------------------------ lazy views

    @functools.cached_property
    def scalars(self) -> tuple[ScalarEntry, ...]:
        """Every scalar as a :class:`ScalarEntry`, in record order (built on first use)."""
        return tuple(
            ScalarEntry(tensor, stat or None, value)
            for (tensor, stat), value in zip(self.scalar_names, self.scalar_values.tolist(), strict=True)
        )

    @functools.cached_property
    def histograms(self) -> tuple[HistogramEntry, ...]:
        """Every histogram as a :class:`HistogramEntry`, in record order (built on first use)."""
        out = []
        for tensor, (row, counts_at, edges_at, bins) in self._histogram_offsets.items():
            out.append(histogram_entry(
                tensor, self.counts[counts_at: counts_at + bins], self.edges[edges_at: edges_at + bins + 1],
                self.histogram_info[row],
            ))
        return tuple(out)

    @functools.cached_property
    def _scalar_index(self) -> dict[tuple[str, str], int]:
        return {name: i for i, name in enumerate(self.scalar_names)}

    @functools.cached_property
    def _histogram_offsets(self) -> dict[str, tuple[int, int, int, int]]:
        """``tensor -> (info row, counts offset, edges offset, bins)``."""
        out, counts_at, edges_at = {}, 0, 0
        for row, (tensor, bins) in enumerate(self.histogram_names):
            out[tensor] = (row, counts_at, edges_at, bins)
            counts_at += bins
            edges_at += bins + 1
        return out

    def scalar(self, tensor: str, stat: str | None = None, default: float | None = None) -> float | None:
        """One value: ``stat`` of ``tensor`` (``None`` or ``""``: a plain scalar), else ``default``."""
        position = self._scalar_index.get((tensor, stat or ""))
        return default if position is None else float(self.scalar_values[position])

    def histogram(self, tensor: str) -> HistogramEntry | None:
        """The histogram of ``tensor`` in this record, or ``None``."""
        found = self._histogram_offsets.get(tensor)
        if found is None:
            return None
        row, counts_at, edges_at, bins = found
        return histogram_entry(
            tensor, self.counts[counts_at: counts_at + bins], self.edges[edges_at: edges_at + bins + 1], self.histogram_info[row]
        )

    def tensor_names(self) -> list[str]:
        """Every tensor with a scalar, a histogram or a raw value in this record, in record order."""
        names = dict.fromkeys(t for t, _ in self.scalar_names)
        names.update(dict.fromkeys(t for t, _ in self.histogram_names))
        names.update(dict.fromkeys(t.tensor for t in self.tensors))
        return list(names)

    def scalar_dict(self) -> dict[str, float]:
        """``{key: value}`` for every scalar, keys as in :attr:`ScalarEntry.key`."""
        return {
            f"{tensor}/{stat}" if stat else tensor: value
            for (tensor, stat), value in zip(self.scalar_names, self.scalar_values.tolist(), strict=True)
        }

    def histogram_dict(self) -> dict[str, HistogramEntry]:
        return {entry.tensor: entry for entry in self.histograms}

    def replace(self, **changes: Any) -> StepRecord:
        """A new record like this one with ``changes`` (any argument of :meth:`from_arrays`:
        ``step``, ``wall_time``, ``scalar_values``, ...), sharing every array not changed: a record
        is immutable, this is how one is changed.

        >>> r = StepRecord(3, ModeKeys.TRAIN, 3, "worker_0", 0.0, scalars=[ScalarEntry("gradients/w", "l2", 2.0)])
        >>> later = r.replace(step=4, mode_step=4, wall_time=1.5)
        >>> later.step, later.wall_time, later.scalar_dict()
        (4, 1.5, {'gradients/w/l2': 2.0})
        """
        unknown = set(changes) - set(_RECORD_FIELDS)
        if unknown:
            raise TypeError(f"StepRecord.replace: no field {sorted(unknown)[0]!r} (fields: {', '.join(_RECORD_FIELDS)})")
        return StepRecord.from_arrays(**{name: changes.get(name, getattr(self, name)) for name in _RECORD_FIELDS})

    def without(self, histograms: bool = False, tensors: bool = False) -> StepRecord:
        """This record without its histograms and/or raw tensors (sharing every other array), for a
        backend that takes neither."""
        if not (histograms and self.histogram_names) and not (tensors and self.tensors):
            return self
        changes: dict[str, Any] = {}
        if histograms:
            changes.update(histogram_names=(), counts=_NO_COUNTS, edges=_NO_EDGES, histogram_info=None)
        if tensors:
            changes["tensors"] = ()
        record = self.replace(**changes)
        if "scalars" in self.__dict__:
            record.__dict__["scalars"] = self.__dict__["scalars"]
        return record

    def __repr__(self) -> str:
        return (
            f"StepRecord(step={self.step}, mode={self.mode.value!r}, mode_step={self.mode_step}, worker={self.worker!r}, "
            f"{len(self.scalar_names)} scalars, {len(self.histogram_names)} histograms, {len(self.tensors)} tensors)"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepRecord):
            return NotImplemented
        return (
            (self.step, self.mode, self.mode_step, self.worker, self.wall_time, self.scalar_names, self.histogram_names)
            == (other.step, other.mode, other.mode_step, other.worker, other.wall_time, other.scalar_names, other.histogram_names)
            and np.array_equal(self.scalar_values, other.scalar_values, equal_nan=True)
            and np.array_equal(self.counts, other.counts)
            and np.array_equal(self.edges, other.edges, equal_nan=True)
            and np.array_equal(self.histogram_info, other.histogram_info, equal_nan=True)
            and dict(self.shapes) == dict(other.shapes)
            and len(self.tensors) == len(other.tensors)
            and all(a.tensor == b.tensor and np.array_equal(a.value, b.value, equal_nan=True)
                    for a, b in zip(self.tensors, other.tensors, strict=True))
        )

    __hash__ = None  # type: ignore[assignment]


def collection_of(tensor_name: str) -> str:
    """The collection part of a tensor name: ``"gradients/fc1.weight"`` -> ``"gradients"``."""
    return tensor_name.split("/", 1)[0]
