"""One record per saved step, built once: the host statistics of a step
(:class:`~tensorlens.compute.host_statistics.HostStatistics`) laid out as the arrays of a
:class:`~tensorlens.records.StepRecord`, with exact histogram edges and finalized statistics.

The training thread hands a :class:`PendingStep` to the dispatcher; its thread calls
:func:`build_record` once and sends the same record to every backend.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np

from tensorlens.compute.host_statistics import HistogramBlock, HostStatistics, JobMeta
from tensorlens.modes import ModeKeys
from tensorlens.records import HISTOGRAM_INFO, ScalarEntry, StepRecord, TensorEntry
from tensorlens.stats.derived import drop_undefined
from tensorlens.stats.edges import exact_edges
from tensorlens.stats.moments import COL, finalize_rows
from tensorlens.stats.registry import STATISTICS
from tensorlens.stats.views import histogram_quantile_rows, quantile_name


def _plain_values(host: HostStatistics) -> np.ndarray:
    """A plain scalar's value: the mean of its calls in the step (NaN without any)."""
    count, total = host.rows[:, COL["count"]], host.rows[:, COL["sum"]]
    with np.errstate(all="ignore"):
        return np.where(count > 0, total / np.where(count > 0, count, 1.0), math.nan)


def _pack(host: HostStatistics) -> _PackedPart:
    """The step's scalars (names and values) and histograms as arrays, in record order."""
    names, stat_index, job_index, used = _scalar_layout(tuple((j.name, j.stats, j.plain_scalar) for j in host.jobs))
    table = finalize_rows(host.rows, used)
    matrix = np.stack([table[stat] for stat in used] + [_plain_values(host)])
    values = matrix[stat_index, job_index]
    hists = _SortedHistograms(host.histograms)
    jobs = host.jobs
    index = hists.index
    histogram_names = _histogram_names(tuple(jobs[i].name for i in index.tolist()), tuple(hists.bins.tolist()))
    extra, partial = hists.extra, host.rows[index]
    info = np.column_stack([
        extra[:, 3], extra[:, 4], extra[:, 5], partial[:, COL["sum"]], partial[:, COL["sumsq"]],
        partial[:, COL["nan_count"]], partial[:, COL["inf_count"]], extra[:, 6], extra[:, 7], extra[:, 8], hists.sampled,
    ]) if len(index) else np.zeros((0, len(HISTOGRAM_INFO)))
    quantile_names, quantile_values = _quantiles(jobs, hists)
    if quantile_names:
        names, values = names + quantile_names, np.concatenate([values, quantile_values])
    if host.derived_names:
        # undefined derived statistics (0/0) are left out and counted, not recorded as NaN
        derived_names, derived_values = drop_undefined(host.derived_names, np.asarray(host.derived_values, dtype=np.float64))
        names, values = names + derived_names, np.concatenate([values, derived_values])
    return _PackedPart(names, values, histogram_names, hists.counts, hists.edges, info)


def _quantiles(jobs: list[JobMeta], hists: _SortedHistograms) -> tuple[tuple[tuple[str, str], ...], np.ndarray]:
    """The quantiles of every histogram (its config's levels) as scalars of its tensor: recorded
    statistics that the store and every backend receive alike. One vectorised pass per group
    of histograms with the same bins and levels (usually one for the whole step)."""
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
            chosen = index[rows]
            at = np.searchsorted(hists.index, chosen)  # hists.index: every histogram's job, ascending
            low, high = hists.extra[at, 3], hists.extra[at, 4]  # the binned values' own min and max
            found.append((chosen, wanted, histogram_quantile_rows(counts[rows], edges[rows], wanted, low, high)))
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


def _tensors_and_shapes(host: HostStatistics) -> tuple[list[TensorEntry], dict[str, tuple[int, ...]]]:
    """The raw tensors saved and the shapes recorded in this step."""
    tensors = [TensorEntry(host.jobs[i].name, value) for i, value in host.raw.items()]
    return tensors, {job.name: job.shape for job in host.jobs if job.shape is not None}


@dataclasses.dataclass
class _PackedPart:
    """One :class:`~tensorlens.compute.host_statistics.HostStatistics` as the arrays of a record."""

    scalar_names: tuple[tuple[str, str], ...]
    scalar_values: np.ndarray
    histogram_names: tuple[tuple[str, int], ...]
    counts: np.ndarray  # int64, every histogram's counts one after another
    edges: np.ndarray  # float64, every histogram's edges one after another
    info: np.ndarray  # [H, len(HISTOGRAM_INFO)]


class _SortedHistograms:
    """A step's :class:`~tensorlens.compute.host_statistics.HistogramBlock` s in job order, with
    their exact edges: ``index``, ``bins``, ``extra`` and ``sampled`` one row per histogram,
    ``counts`` and ``edges`` flat in that order, and ``groups``: ``(jobs, counts [h, bins], edges
    [h, bins + 1])`` per bin count, each in job order."""

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
    packed = [_pack(part) for part in pending.parts]
    tensors: list[TensorEntry] = []
    shapes: dict[str, tuple[int, ...]] = {}
    for part in pending.parts:
        part_tensors, part_shapes = _tensors_and_shapes(part)
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
