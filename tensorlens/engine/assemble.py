"""One record per saved step, built once: the host side of the statistics laid out as the arrays
of a :class:`~tensorlens.records.StepRecord`, with exact histogram edges and finalized statistics.

The training thread hands a :class:`PendingStep` to the dispatcher; its thread calls
:func:`build_record` once and sends the same record to every backend.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np

from tensorlens.config import HistogramConfig
from tensorlens.modes import ModeKeys
from tensorlens.records import HISTOGRAM_INFO, ScalarEntry, StepRecord, TensorEntry
from tensorlens.stats.edges import exact_edges
from tensorlens.stats.moments import COL, PARTIALS, finalize_rows
from tensorlens.stats.views import histogram_quantile_rows, quantile_name

if TYPE_CHECKING:
    from tensorlens.engine.step import _DeviceHistograms


@dataclasses.dataclass
class _JobMeta:
    """What the host needs of a job once the device tensors are gone."""

    name: str
    stats: tuple[str, ...]
    histogram: HistogramConfig | None
    plain_scalar: bool
    shape: tuple[int, ...] | None
    period: int  # the last dimension: histogram samples stride across it (see sample_stride)
    numel: int  # of the whole tensor (a reduced job's values are only its sample)


@dataclasses.dataclass
class _HostHistogram:
    counts: np.ndarray
    low: float
    high: float
    scale: float
    dtype: np.dtype
    data_low: float  # the binned values' own range, reported as min/max
    data_high: float
    binned: int
    rejected: int
    underflow: int
    overflow: int
    sampled: bool


@dataclasses.dataclass
class HostStatistics:
    """The host copy of one step's statistics (:class:`~tensorlens.engine.step.StepStatistics` makes
    it on the training thread); :meth:`pack` lays it out as a record's arrays."""

    jobs: list[_JobMeta]
    rows: np.ndarray  # [N, len(PARTIALS)] float64
    histograms: dict[int, _HostHistogram]
    raw: dict[int, np.ndarray]
    # named values derived on the device (training dynamics), copied with the rows
    derived_names: tuple[tuple[str, str], ...] = ()
    derived_values: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))

    def without(self, indices: set[int]) -> HostStatistics:
        """These statistics without the jobs at ``indices`` (tensors that could not be summarised)."""
        keep = [i for i in range(len(self.jobs)) if i not in indices]
        new = {old: new for new, old in enumerate(keep)}
        return HostStatistics(
            [self.jobs[i] for i in keep], self.rows[keep],
            {new[i]: h for i, h in self.histograms.items() if i in new}, {new[i]: r for i, r in self.raw.items() if i in new},
            self.derived_names, self.derived_values,
        )

    @staticmethod
    def concat(parts: list[HostStatistics]) -> HostStatistics:
        """One :class:`HostStatistics` of several computed separately, in order."""
        jobs, rows, histograms, raw = [], [], {}, {}
        for part in parts:
            offset = len(jobs)
            jobs += part.jobs
            rows.append(part.rows)
            histograms.update({offset + i: h for i, h in part.histograms.items()})
            raw.update({offset + i: r for i, r in part.raw.items()})
        return HostStatistics(
            jobs, np.concatenate(rows) if rows else np.zeros((0, len(PARTIALS))), histograms, raw,
            tuple(n for p in parts for n in p.derived_names),
            np.concatenate([p.derived_values for p in parts]) if parts else np.zeros(0),
        )

    def _edges(self) -> dict[int, np.ndarray]:
        """Exact edges of every histogram, found together per (bins, dtype)."""
        groups: dict[tuple[int, np.dtype], list[int]] = {}
        for i, hist in self.histograms.items():
            groups.setdefault((len(hist.counts), hist.dtype), []).append(i)
        out = {}
        for (bins, dtype), members in groups.items():
            hists = [self.histograms[i] for i in members]
            edges = exact_edges(
                np.array([h.low for h in hists]), np.array([h.high for h in hists]), np.array([h.scale for h in hists]),
                bins, dtype,
            )
            out.update(zip(members, edges, strict=True))
        return out

    def _plain_values(self) -> np.ndarray:
        """A plain scalar's value: the mean of its calls in the step (NaN without any)."""
        count, total = self.rows[:, COL["count"]], self.rows[:, COL["sum"]]
        with np.errstate(all="ignore"):
            return np.where(count > 0, total / np.where(count > 0, count, 1.0), math.nan)

    def pack(self) -> _PackedPart:
        """The step's scalars (names and values) and histograms as arrays, in record order."""
        if isinstance(self.histograms, HostHistograms):  # kept as arrays by the engine: made once, here
            self.histograms = self.histograms.as_dict()
        names, stat_index, job_index = _scalar_layout(tuple((j.name, j.stats, j.plain_scalar) for j in self.jobs))
        table = finalize_rows(self.rows)
        matrix = np.stack([table[stat] for stat in _STAT_ORDER] + [self._plain_values()])
        order = sorted(self.histograms)
        edges = self._edges()
        sums, sumsq = table["sum"], self.rows[:, COL["sumsq"]]
        nan_counts, inf_counts = table["nan_count"], table["inf_count"]
        info = [
            (h.data_low, h.data_high, h.binned, sums[i], sumsq[i], nan_counts[i], inf_counts[i], h.rejected,
             h.underflow, h.overflow, h.sampled)
            for i, h in ((i, self.histograms[i]) for i in order)
        ]
        values = matrix[stat_index, job_index]
        quantile_names, quantile_values = self._quantiles(order, edges)
        if quantile_names:
            names, values = names + quantile_names, np.concatenate([values, quantile_values])
        if self.derived_names:
            names, values = names + self.derived_names, np.concatenate([values, self.derived_values])
        return _PackedPart(
            names, values,
            tuple((self.jobs[i].name, len(self.histograms[i].counts)) for i in order),
            [self.histograms[i].counts for i in order], [edges[i] for i in order], info,
        )

    def _quantiles(self, order: list[int], edges: dict[int, np.ndarray]) -> tuple[tuple[tuple[str, str], ...], np.ndarray]:
        """The quantiles of every histogram (its config's levels) as scalars of its tensor: recorded
        statistics that the store and every backend receive alike. One vectorised pass per group
        of histograms with the same bins and levels."""
        wanted = [i for i in order if self.jobs[i].histogram is not None and self.jobs[i].histogram.quantiles]
        if not wanted:
            return (), np.zeros(0)
        groups: dict[tuple[int, tuple[float, ...]], list[int]] = {}
        for i in wanted:
            groups.setdefault((len(self.histograms[i].counts), self.jobs[i].histogram.quantiles), []).append(i)
        found: dict[int, np.ndarray] = {}
        for (_, levels), members in groups.items():
            rows = histogram_quantile_rows(
                np.stack([self.histograms[i].counts for i in members]), np.stack([edges[i] for i in members]), levels
            )
            found.update(zip(members, rows, strict=True))
        names = _quantile_names(tuple((self.jobs[i].name, self.jobs[i].histogram.quantiles) for i in wanted))
        return names, np.concatenate([found[i] for i in wanted])

    def tensors_and_shapes(self) -> tuple[list[TensorEntry], dict[str, tuple[int, ...]]]:
        """The raw tensors saved and the shapes recorded in this step."""
        tensors = [TensorEntry(self.jobs[i].name, value) for i, value in self.raw.items()]
        return tensors, {job.name: job.shape for job in self.jobs if job.shape is not None}


@dataclasses.dataclass
class _PackedPart:
    """One :class:`HostStatistics` as the arrays of a record."""

    scalar_names: tuple[tuple[str, str], ...]
    scalar_values: np.ndarray
    histogram_names: tuple[tuple[str, int], ...]
    counts: list[np.ndarray]
    edges: list[np.ndarray]
    info: list[tuple[float, ...]]


@functools.lru_cache(maxsize=16)  # a step's jobs are almost always the previous step's
def _scalar_layout(jobs: tuple[tuple[str, tuple[str, ...], bool], ...]) -> tuple[tuple[tuple[str, str], ...], np.ndarray, np.ndarray]:
    """``(names, statistic index, job index)`` of every scalar of jobs ``(name, stats,
    plain_scalar)``, job by job in its statistics' order; statistic index
    ``len(_STAT_ORDER)`` is a plain scalar's own value."""
    names, stat_index, job_index = [], [], []
    for i, (name, stats, plain) in enumerate(jobs):
        for stat in ((None,) if plain else stats):
            names.append((name, stat or ""))
            stat_index.append(len(_STAT_ORDER) if stat is None else _STAT_ORDER.index(stat))
            job_index.append(i)
    return tuple(names), np.array(stat_index, dtype=np.intp), np.array(job_index, dtype=np.intp)


@functools.lru_cache(maxsize=16)
def _quantile_names(histograms: tuple[tuple[str, tuple[float, ...]], ...]) -> tuple[tuple[str, str], ...]:
    return tuple((name, quantile_name(level)) for name, levels in histograms for level in levels)


_STAT_ORDER = tuple(finalize_rows(np.zeros((1, len(PARTIALS)))))


@dataclasses.dataclass
class PendingStep:
    """A saved step as the training thread hands it over: its identity, the numbers known on the
    host already (optimizer settings) and the host statistics of its tensors, in parts (read
    before the optimizer step, and the updates after it)."""

    step: int
    mode: ModeKeys
    mode_step: int
    worker: str
    wall_time: float
    host_scalars: list[ScalarEntry]
    parts: list[HostStatistics]


def build_record(pending: PendingStep) -> StepRecord:
    """The :class:`~tensorlens.records.StepRecord` of a step, built once (on the dispatcher
    thread) and shared by every backend: ``host_scalars``, then each part's statistics."""
    packed = [part.pack() for part in pending.parts]
    tensors: list[TensorEntry] = []
    shapes: dict[str, tuple[int, ...]] = {}
    for part in pending.parts:
        part_tensors, part_shapes = part.tensors_and_shapes()
        tensors += part_tensors
        shapes.update(part_shapes)
    host_names = tuple((e.tensor, e.stat or "") for e in pending.host_scalars)
    host_values = np.array([e.value for e in pending.host_scalars], dtype=np.float64)
    counts = [c for p in packed for c in p.counts]
    edges = [e for p in packed for e in p.edges]
    info = [row for p in packed for row in p.info]
    return StepRecord.from_arrays(
        pending.step, pending.mode, pending.mode_step, pending.worker, pending.wall_time,
        scalar_names=tuple(itertools.chain(host_names, *(p.scalar_names for p in packed))),
        scalar_values=np.concatenate([host_values, *(p.scalar_values for p in packed)]),
        histogram_names=tuple(itertools.chain.from_iterable(p.histogram_names for p in packed)),
        counts=np.concatenate(counts).astype(np.int64, copy=False) if counts else np.zeros(0, dtype=np.int64),
        edges=np.concatenate(edges).astype(np.float64, copy=False) if edges else np.zeros(0, dtype=np.float64),
        histogram_info=np.array(info, dtype=np.float64).reshape(len(info), len(HISTOGRAM_INFO)),
        tensors=tensors,
        shapes=shapes,
    )


def host_record(host: HostStatistics, step: int = 0, mode: ModeKeys = ModeKeys.TRAIN) -> StepRecord:
    """The record of one :class:`HostStatistics` alone (tests, benchmarks, tools)."""
    return build_record(PendingStep(step, mode, step, "worker_0", 0.0, [], [host]))


class HostHistograms(Mapping[int, _HostHistogram]):
    """The histograms of a step by job index, kept as the arrays they arrived in: the
    :class:`_HostHistogram` objects are made at the first look (on the dispatcher thread), all at
    once, not one per tensor on the training thread."""

    def __init__(self, groups: list[tuple[_DeviceHistograms, np.ndarray, np.ndarray]]) -> None:
        self._groups = groups
        self._made: dict[int, _HostHistogram] | None = None

    def _all(self) -> dict[int, _HostHistogram]:
        if self._made is None:
            made = {}
            for h, counts, extra in self._groups:
                dtype = np.dtype(str(h.dtype).removeprefix("torch."))
                for g, (i, row, sampled) in enumerate(zip(h.index, extra.tolist(), h.sampled, strict=True)):
                    low, high, scale, data_low, data_high, binned, rejected, underflow, overflow = row
                    made[i] = _HostHistogram(
                        counts[g], low, high, scale, dtype, data_low, data_high,
                        int(binned), int(rejected), int(underflow), int(overflow), sampled,
                    )
            self._made = made
        return self._made

    def __getitem__(self, i: int) -> _HostHistogram:
        return self._all()[i]

    def as_dict(self) -> dict[int, _HostHistogram]:
        """Every histogram by job index (``dict(self)`` would look each one up through the mapping)."""
        return self._all()

    def __iter__(self) -> Iterator[int]:
        return iter(self._all())

    def __len__(self) -> int:
        return sum(len(h.index) for h, _, _ in self._groups)

    def keys(self):  # type: ignore[override]  # dict(self) and sorted(self) read the built dict directly
        return self._all().keys()

    def items(self):  # type: ignore[override]
        return self._all().items()
