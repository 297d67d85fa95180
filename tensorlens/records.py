"""Backend-neutral records: what one saved step produced. Adapters only translate these."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

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


@dataclasses.dataclass
class StepRecord:
    """Everything recorded for one (mode, mode step) of one worker."""

    step: int  # optimizer steps taken before this record
    mode: ModeKeys
    mode_step: int
    worker: str
    wall_time: float
    scalars: list[ScalarEntry] = dataclasses.field(default_factory=list)
    histograms: list[HistogramEntry] = dataclasses.field(default_factory=list)
    tensors: list[TensorEntry] = dataclasses.field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def scalar_dict(self) -> dict[str, float]:
        """``{key: value}`` for every scalar, keys as in :attr:`ScalarEntry.key`."""
        return {entry.key: entry.value for entry in self.scalars}

    def histogram_dict(self) -> dict[str, HistogramEntry]:
        return {entry.tensor: entry for entry in self.histograms}


#: Columns of a packed histogram's ``info`` row (float64; NaN where absent): fields of
#: :class:`HistogramEntry`, in the order the run store keeps them.
HISTOGRAM_INFO = (
    "min", "max", "count", "sum", "sum_squares", "nan_count", "inf_count", "rejected", "underflow", "overflow", "sampled",
)
#: The :data:`HISTOGRAM_INFO` columns that hold counts (integers stored as float64).
HISTOGRAM_INTEGER_INFO = frozenset({"count", "nan_count", "inf_count", "rejected", "underflow", "overflow"})


def histogram_entry(tensor: str, counts: np.ndarray, edges: np.ndarray, info: tuple[float, ...]) -> HistogramEntry:
    """The :class:`HistogramEntry` of one packed histogram (``info`` in :data:`HISTOGRAM_INFO` order)."""
    fields = {
        key: int(value) if key in HISTOGRAM_INTEGER_INFO else bool(value) if key == "sampled" else float(value)
        for key, value in zip(HISTOGRAM_INFO, info, strict=True)
    }
    return HistogramEntry(tensor, counts, edges, **fields)


@dataclasses.dataclass
class PackedRecord:
    """One step as arrays: what the local store writes, built without an object per number.

    The same content as a :class:`StepRecord` (:meth:`from_record` converts one): scalars are
    ``scalar_names`` (``(tensor, stat or "")`` pairs) with their ``scalar_values``; histograms
    are ``histogram_names`` (``(tensor, bins)``) with their counts and edges one after another and
    one ``histogram_info`` row each (:data:`HISTOGRAM_INFO`). A step of the Transformer benchmark
    holds 1596 scalars and 194 histograms: objects for each cost the training process ~2 ms per
    step, on a thread that shares the GIL and the cores with training.
    """

    step: int
    mode: ModeKeys
    mode_step: int
    worker: str
    wall_time: float
    scalar_names: tuple[tuple[str, str], ...]
    scalar_values: np.ndarray  # float64 [len(scalar_names)]
    histogram_names: tuple[tuple[str, int], ...]
    counts: np.ndarray  # int64, every histogram's counts in order
    edges: np.ndarray  # float64, every histogram's bins + 1 edges in order
    histogram_info: np.ndarray  # float64 [len(histogram_names), len(HISTOGRAM_INFO)]
    tensors: list[TensorEntry] = dataclasses.field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_record(cls, record: StepRecord) -> PackedRecord:
        histograms = record.histograms
        return cls(
            record.step, record.mode, record.mode_step, record.worker, record.wall_time,
            scalar_names=tuple((e.tensor, e.stat or "") for e in record.scalars),
            scalar_values=np.fromiter((e.value for e in record.scalars), dtype=np.float64, count=len(record.scalars)),
            histogram_names=tuple((h.tensor, len(h.counts)) for h in histograms),
            counts=np.concatenate([np.asarray(h.counts, dtype=np.int64) for h in histograms]) if histograms else _NO_COUNTS,
            edges=np.concatenate([np.asarray(h.edges, dtype=np.float64) for h in histograms]) if histograms else _NO_EDGES,
            histogram_info=np.array(
                [[float(getattr(h, key)) for key in HISTOGRAM_INFO] for h in histograms], dtype=np.float64
            ).reshape(len(histograms), len(HISTOGRAM_INFO)),
            tensors=list(record.tensors),
            shapes=dict(record.shapes),
        )


_NO_COUNTS = np.zeros(0, dtype=np.int64)
_NO_EDGES = np.zeros(0, dtype=np.float64)


def collection_of(tensor_name: str) -> str:
    """The collection part of a tensor name: ``"gradients/fc1.weight"`` -> ``"gradients"``."""
    return tensor_name.split("/", 1)[0]
