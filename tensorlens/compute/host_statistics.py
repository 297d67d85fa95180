"""What the batched statistics give back: the host copy of one step's statistics.

:class:`~tensorlens.compute.step.StepStatistics` makes a :class:`HostStatistics` on the training
thread (jobs in, host statistics out); the dispatcher thread lays it out as a record's arrays
(:mod:`tensorlens.dispatch.assemble`). Nothing here knows of records or backends.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tensorlens.config import HistogramConfig
from tensorlens.stats.moments import PARTIALS


@dataclasses.dataclass
class JobMeta:
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
    """The host copy of one step's statistics: per job its partial row, at most one histogram,
    the raw values asked for, and the named values derived on the device, copied with them."""

    jobs: list[JobMeta]
    rows: np.ndarray  # [N, len(PARTIALS)] float64
    histograms: list[HistogramBlock]  # at most one histogram per job
    raw: dict[int, np.ndarray]
    # named values derived on the device (training dynamics), copied with the rows
    derived_names: tuple[tuple[str, str], ...] = ()
    derived_values: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))

    @staticmethod
    def empty() -> HostStatistics:
        """No job at all (an unsaved step's end)."""
        return HostStatistics([], np.zeros((0, len(PARTIALS))), [], {})

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
