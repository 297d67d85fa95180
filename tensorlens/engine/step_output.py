"""A saved step's way off the training thread: the statistics of its jobs, merged across ranks
under ``include_workers="reduce"``, handed to the dispatcher as a
:class:`~tensorlens.dispatch.assemble.PendingStep` (and the end of an epoch, as an
:class:`~tensorlens.dispatch.epochs.EpochEnd`).

Held by the :class:`~tensorlens.engine.recorder.Recorder`, which decides when a step is closed;
this decides where its numbers go and which rank records them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from tensorlens.backends.base import Backend, RunInfo
from tensorlens.compute.host_statistics import HostStatistics
from tensorlens.compute.jobs import DerivedScalars, TensorJob
from tensorlens.compute.step import StepStatistics
from tensorlens.dispatch import Dispatcher
from tensorlens.dispatch.assemble import PendingStep, build_record
from tensorlens.dispatch.epochs import EpochAggregator, EpochEnd
from tensorlens.modes import ModeKeys
from tensorlens.records import ScalarEntry


class StepOutput:
    """The batched statistics of a recorder's steps and their hand-over to its dispatcher.

    It makes the run's :class:`~tensorlens.dispatch.Dispatcher` for ``backends``. ``reducer``: the
    cross-rank reducer (``include_workers="reduce"`` with several ranks), else ``None``.
    """

    def __init__(
        self, backends: list[Backend], run: RunInfo, max_pending: int, epoch_statistics: tuple[str, ...], reducer: Any,
        rank: int, world_size: int, include_workers: str, worker: str, warn: Callable[[str], None],
    ) -> None:
        # epoch aggregates are taken from the records on the dispatcher thread (see dispatch/epochs.py)
        self.epochs = EpochAggregator(epoch_statistics, build_record, worker)
        self.dispatcher = Dispatcher(backends, run, max_pending=max_pending, build=self.epochs.build)
        self.reducer = reducer
        self.statistics = StepStatistics()
        self.worker = worker
        self._warn = warn
        # "reduce": every rank holds the same merged statistics, rank 0 records them; "one": only rank 0 computes
        self.records = not (world_size > 1 and include_workers != "all" and rank != 0)

    def live_reducer(self, saving: frozenset[str]) -> Any:
        """The cross-rank reducer on a saved step while the process group lives, else ``None``."""
        reducer = self.reducer
        return reducer if reducer is not None and saving and getattr(reducer, "active", True) else None

    def compute(self, jobs: list[TensorJob], saving: frozenset[str], derived: DerivedScalars | None = None) -> HostStatistics:
        """Statistics of one step's jobs; under ``include_workers="reduce"`` merged across ranks.

        Collectives are made only on steps that save something: ``saving`` is the same on every
        rank (all ranks count the same steps), so an unsaved step costs no communication. The
        ranks first agree on the union of their jobs, so a module called on one rank only, or a
        different number of times, cannot hang them.
        """
        reducer = self.live_reducer(saving)
        if reducer is None:
            return self.statistics.compute(jobs, None, warn=self._warn, derived=derived)
        return self.statistics.compute(reducer.agree_jobs(jobs), reducer, warn=self._warn, derived=derived)

    def compute_here(self, jobs: list[TensorJob]) -> HostStatistics:
        """Statistics of this rank's own values, with no collective (at close, which may run on
        one rank only, or after the process group is gone)."""
        return self.statistics.compute(jobs, None, warn=self._warn)

    def to_host(self, tensor: torch.Tensor) -> Any:
        self.statistics.host_copies += 1  # a second, small copy: counted like the engine's NaN pass
        return tensor.cpu().numpy()

    def submit(
        self, step: int, mode: ModeKeys, mode_step: int, parts: list[HostStatistics], host_scalars: list[ScalarEntry]
    ) -> None:
        if not any(p.jobs or p.derived_names for p in parts) and not host_scalars:
            return
        if self.records:
            self.dispatcher.submit(PendingStep(step, mode, mode_step, self.worker, time.time(), list(host_scalars), parts))

    def end_epoch(self, step: int, epoch: int) -> None:
        if self.records:  # as for steps: rank 0 records (the statistics it aggregates are the merged ones)
            self.dispatcher.submit(EpochEnd(step, epoch, self.worker, time.time()))

    def close(self) -> None:
        self.dispatcher.close()
        self.statistics.release()
