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

import numpy as np

from tensorlens.config import HistogramConfig
from tensorlens.modes import ModeKeys
from tensorlens.records import HISTOGRAM_INFO, ScalarEntry, StepRecord, TensorEntry
from tensorlens.stats.edges import exact_edges
from tensorlens.stats.moments import COL, PARTIALS, finalize_rows
from tensorlens.stats.registry import STATISTICS
from tensorlens.stats.views import histogram_quantile_rows, quantile_name


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
class HistogramBlock:
    """Histograms of a step that share a bin count and a dtype, kept as the arrays they arrived
    in (one row per histogram): a step's record is made from them in a few numpy calls, with no
    Python object per histogram (where cores are few, the dispatcher thread's time comes out of
    the training step: docs/performance.md, third pass)."""

    index: np.ndarray  # intp [H]: the job of each row
    counts: np.ndarray  # int64 [H, bins]
    # float64 [H, 9]: bin low, bin high, scale, data min, data max, binned, rejected, underflow, overflow
    extra: np.ndarray
    sampled: np.ndarray  # bool [H]
    dtype: np.dtype  # the dtype values were binned in: exact edges are found in it

    @property
    def bins(self) -> int:
        return self.counts.shape[1]

    def take(self, rows: np.ndarray, index: np.ndarray) -> HistogramBlock:
        """The block's ``rows``, renumbered to jobs ``index``."""
        return HistogramBlock(index, self.counts[rows], self.extra[rows], self.sampled[rows], self.dtype)


@dataclasses.dataclass
class HostStatistics:
    """The host copy of one step's statistics (:class:`~tensorlens.engine.step.StepStatistics` makes
    it on the training thread); :meth:`pack` lays it out as a record's arrays."""

    jobs: list[_JobMeta]
    rows: np.ndarray  # [N, len(PARTIALS)] float64
    histograms: list[HistogramBlock]  # at most one histogram per job
    raw: dict[int, np.ndarray]
    # named values derived on the device (training dynamics), copied with the rows
    derived_names: tuple[tuple[str, str], ...] = ()
    derived_values: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))

    def without(self, indices: set[int]) -> HostStatistics:
        """These statistics without the jobs at ``indices`` (tensors that could not be summarised)."""
        keep = [i for i in range(len(self.jobs)) if i not in indices]
        new = np.full(len(self.jobs), -1, dtype=np.intp)
        new[keep] = np.arange(len(keep))
        blocks = []
        for block in self.histograms:
            renumbered = new[block.index]
            rows = np.flatnonzero(renumbered >= 0)
            blocks.append(block.take(rows, renumbered[rows]))
        return HostStatistics(
            [self.jobs[i] for i in keep], self.rows[keep], blocks, {int(new[i]): r for i, r in self.raw.items() if new[i] >= 0},
            self.derived_names, self.derived_values,
        )

    @staticmethod
    def concat(parts: list[HostStatistics]) -> HostStatistics:
        """One :class:`HostStatistics` of several computed separately, in order."""
        jobs, rows, histograms, raw = [], [], [], {}
        for part in parts:
            offset = len(jobs)
            jobs += part.jobs
            rows.append(part.rows)
            histograms += [dataclasses.replace(b, index=b.index + offset) for b in part.histograms]
            raw.update({offset + i: r for i, r in part.raw.items()})
        return HostStatistics(
            jobs, np.concatenate(rows) if rows else np.zeros((0, len(PARTIALS))), histograms, raw,
            tuple(n for p in parts for n in p.derived_names),
            np.concatenate([p.derived_values for p in parts]) if parts else np.zeros(0),
        )

    def _plain_values(self) -> np.ndarray:
        """A plain scalar's value: the mean of its calls in the step (NaN without any)."""
        count, total = self.rows[:, COL["count"]], self.rows[:, COL["sum"]]
        with np.errstate(all="ignore"):
            return np.where(count > 0, total / np.where(count > 0, count, 1.0), math.nan)

    def pack(self) -> _PackedPart:
        """The step's scalars (names and values) and histograms as arrays, in record order."""
        names, stat_index, job_index, used = _scalar_layout(tuple((j.name, j.stats, j.plain_scalar) for j in self.jobs))
        table = finalize_rows(self.rows, used)
        matrix = np.stack([table[stat] for stat in used] + [self._plain_values()])
        values = matrix[stat_index, job_index]
        hists = _SortedHistograms(self.histograms)
        jobs = self.jobs
        index = hists.index
        histogram_names = _histogram_names(tuple(jobs[i].name for i in index.tolist()), tuple(hists.bins.tolist()))
        extra, partial = hists.extra, self.rows[index]
        info = np.column_stack([
            extra[:, 3], extra[:, 4], extra[:, 5], partial[:, COL["sum"]], partial[:, COL["sumsq"]],
            partial[:, COL["nan_count"]], partial[:, COL["inf_count"]], extra[:, 6], extra[:, 7], extra[:, 8], hists.sampled,
        ]) if len(index) else np.zeros((0, len(HISTOGRAM_INFO)))
        quantile_names, quantile_values = self._quantiles(hists)
        if quantile_names:
            names, values = names + quantile_names, np.concatenate([values, quantile_values])
        if self.derived_names:
            names, values = names + self.derived_names, np.concatenate([values, self.derived_values])
        return _PackedPart(names, values, histogram_names, hists.counts, hists.edges, info)

    def _quantiles(self, hists: _SortedHistograms) -> tuple[tuple[tuple[str, str], ...], np.ndarray]:
        """The quantiles of every histogram (its config's levels) as scalars of its tensor: recorded
        statistics that the store and every backend receive alike. One vectorised pass per group
        of histograms with the same bins and levels (usually one for the whole step)."""
        jobs = self.jobs
        found: list[tuple[np.ndarray, tuple[float, ...], np.ndarray]] = []  # (jobs, levels, values [h, L])
        for index, counts, edges in hists.groups:
            levels = [jobs[i].histogram.quantiles if jobs[i].histogram is not None else () for i in index.tolist()]
            distinct = set(levels)
            for wanted in distinct:
                if not wanted:
                    continue
                rows = (
                    slice(None) if len(distinct) == 1
                    else np.array([k for k, level in enumerate(levels) if level == wanted], dtype=np.intp)
                )
                found.append((index[rows], wanted, histogram_quantile_rows(counts[rows], edges[rows], wanted)))
        if not found:
            return (), np.zeros(0)
        if len(found) == 1:  # the usual step: one set of levels, rows in job order already
            index, levels, values = found[0]
            return _quantile_names(tuple(jobs[i].name for i in index.tolist()), levels), values.reshape(-1)
        by_job = sorted(
            ((i, levels, row) for index, levels, values in found for i, row in zip(index.tolist(), values, strict=True)),
            key=lambda item: item[0],
        )
        names = tuple(itertools.chain.from_iterable(_quantile_names((jobs[i].name,), levels) for i, levels, _ in by_job))
        return names, np.concatenate([row for _, _, row in by_job])

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
    counts: np.ndarray  # int64, every histogram's counts one after another
    edges: np.ndarray  # float64, every histogram's edges one after another
    info: np.ndarray  # [H, len(HISTOGRAM_INFO)]


class _SortedHistograms:
    """A step's :class:`HistogramBlock` s in job order, with their exact edges: ``index``, ``bins``,
    ``extra`` and ``sampled`` one row per histogram, ``counts`` and ``edges`` flat in that order,
    and ``groups``: ``(jobs, counts [h, bins], edges [h, bins + 1])`` per bin count, each in job order."""

    def __init__(self, blocks: list[HistogramBlock]) -> None:
        by_bins: dict[int, list[HistogramBlock]] = {}
        for block in blocks:
            if len(block.index):
                by_bins.setdefault(block.bins, []).append(block)
        groups, extras, sampled = [], [], []
        for bins, members in by_bins.items():
            index = _joined([b.index for b in members])
            order = np.argsort(index, kind="stable")
            edges = _joined([
                exact_edges(b.extra[:, 0], b.extra[:, 1], b.extra[:, 2], bins, b.dtype) for b in members
            ])
            groups.append((index[order], _joined([b.counts for b in members])[order], edges[order]))
            extras.append(_joined([b.extra for b in members])[order])
            sampled.append(_joined([b.sampled for b in members])[order])
        self.groups = groups
        if not groups:
            self.index, self.bins = np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.intp)
            self.extra, self.sampled = np.zeros((0, 9)), np.zeros(0, dtype=bool)
            self.counts, self.edges = np.zeros(0, dtype=np.int64), np.zeros(0)
        elif len(groups) == 1:  # the usual step: one bin count
            self.index, counts, edges = groups[0]
            self.bins = np.full(len(self.index), counts.shape[1], dtype=np.intp)
            self.extra, self.sampled = extras[0], sampled[0]
            self.counts, self.edges = counts.reshape(-1), edges.reshape(-1)
        else:  # several bin counts: interleaved in job order, row by row
            index = np.concatenate([g[0] for g in groups])
            order = np.argsort(index, kind="stable")
            counts = [row for g in groups for row in g[1]]
            edges = [row for g in groups for row in g[2]]
            self.index = index[order]
            self.bins = np.concatenate([np.full(len(g[0]), g[1].shape[1], dtype=np.intp) for g in groups])[order]
            self.extra, self.sampled = np.concatenate(extras)[order], np.concatenate(sampled)[order]
            self.counts = np.concatenate([counts[k] for k in order.tolist()])
            self.edges = np.concatenate([edges[k] for k in order.tolist()])


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


@functools.lru_cache(maxsize=16)  # a step's jobs are almost always the previous step's
def _scalar_layout(
    jobs: tuple[tuple[str, tuple[str, ...], bool], ...],
) -> tuple[tuple[tuple[str, str], ...], np.ndarray, np.ndarray, tuple[str, ...]]:
    """``(names, statistic index, job index, statistics)`` of every scalar of jobs ``(name,
    stats, plain_scalar)``, job by job in its statistics' order: ``statistics`` are the ones any
    job asks for (in declaration order), the index is into them, and index ``len(statistics)`` is
    a plain scalar's own value."""
    asked = {stat for _, stats, plain in jobs if not plain for stat in stats}
    used = tuple(stat for stat in STATISTICS if stat in asked)
    position = {stat: k for k, stat in enumerate(used)}
    names, stat_index, job_index = [], [], []
    for i, (name, stats, plain) in enumerate(jobs):
        for stat in ((None,) if plain else stats):
            names.append((name, stat or ""))
            stat_index.append(len(used) if stat is None else position[stat])
            job_index.append(i)
    return tuple(names), np.array(stat_index, dtype=np.intp), np.array(job_index, dtype=np.intp), used


@functools.lru_cache(maxsize=16)
def _histogram_names(tensors: tuple[str, ...], bins: tuple[int, ...]) -> tuple[tuple[str, int], ...]:
    return tuple(zip(tensors, bins, strict=True))


@functools.lru_cache(maxsize=16)
def _quantile_names(tensors: tuple[str, ...], levels: tuple[float, ...]) -> tuple[tuple[str, str], ...]:
    return tuple((name, quantile_name(level)) for name in tensors for level in levels)



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
    info = np.concatenate([p.info for p in packed]) if packed else np.zeros((0, len(HISTOGRAM_INFO)))
    return StepRecord.from_arrays(
        pending.step, pending.mode, pending.mode_step, pending.worker, pending.wall_time,
        scalar_names=tuple(itertools.chain(host_names, *(p.scalar_names for p in packed))),
        scalar_values=np.concatenate([host_values, *(p.scalar_values for p in packed)]),
        histogram_names=tuple(itertools.chain.from_iterable(p.histogram_names for p in packed)),
        counts=_joined([p.counts for p in packed]) if packed else np.zeros(0, dtype=np.int64),
        edges=_joined([p.edges for p in packed]) if packed else np.zeros(0, dtype=np.float64),
        histogram_info=info,
        tensors=tensors,
        shapes=shapes,
    )


def host_record(host: HostStatistics, step: int = 0, mode: ModeKeys = ModeKeys.TRAIN) -> StepRecord:
    """The record of one :class:`HostStatistics` alone (tests, benchmarks, tools)."""
    return build_record(PendingStep(step, mode, step, "worker_0", 0.0, [], [host]))
