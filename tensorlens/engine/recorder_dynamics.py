"""The recorder's side of training dynamics and epoch aggregates: when the ``dynamics`` collection
reads parameters and module captures, clipped gradients, and the end of an epoch.

A mixin of :class:`tensorlens.engine.recorder.Recorder`; the statistics themselves live in
engine/dynamics.py (what is derived) and dispatch/epochs.py (what is aggregated).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from tensorlens._checks import expected
from tensorlens.collection import Kind
from tensorlens.dispatch.epochs import EpochEnd
from tensorlens.engine import gather
from tensorlens.modes import ModeKeys

if TYPE_CHECKING:
    from tensorlens.compute.jobs import DerivedScalars, TensorJob
    from tensorlens.compute.step import StepStatistics
    from tensorlens.dispatch import Dispatcher
    from tensorlens.engine.dynamics import Dynamics
    from tensorlens.engine.schedule import Schedule


class DynamicsSteps:
    """When the recorder feeds the ``dynamics`` collection, and ``end_epoch``."""

    schedule: Schedule
    dynamics: Dynamics
    global_step: int
    world_size: int
    rank: int
    include_workers: str
    worker: str
    _mode_steps: dict[ModeKeys, int]
    _engine: StepStatistics
    _dispatcher: Dispatcher

    if TYPE_CHECKING:  # the recorder's own
        def _check_open(self, what: str) -> None: ...
        def _parameters(self) -> list[tuple[str, torch.Tensor]]: ...
        def _live_reducer(self, saving: frozenset[str]) -> Any: ...

    def _dynamics_before_update(self, saving: frozenset[str], mode: ModeKeys) -> None:
        """Read what the ``dynamics`` collection needs before the optimizer step: on a saved step
        and on the step before one (the previous gradient and update for the cosines)."""
        next_saves = (
            self.schedule.is_enabled(Kind.DYNAMICS)
            and bool(self._saving_any_rank())
            and self.schedule.saves(Kind.DYNAMICS, mode, self._mode_steps[mode] + 1)
        )
        self.dynamics.before_update(self._parameters, self.global_step, Kind.DYNAMICS in saving, next_saves, gather.local_piece)

    def _saving_any_rank(self) -> bool:
        return not (self.world_size > 1 and self.include_workers == "one" and self.rank != 0)

    def _dynamics_of_modules(self, saving: frozenset[str], mode: ModeKeys) -> tuple[list[TensorJob], DerivedScalars | None]:
        """The module statistics of ``dynamics`` captured in ``mode`` (dead units, per-sample
        norms); under ``include_workers="reduce"`` summed across ranks (a collective)."""
        if Kind.DYNAMICS not in saving or not self.dynamics.config.module_statistics:
            self.dynamics.drop_captures(mode)
            return [], None
        return self.dynamics.module_results(mode, self._live_reducer(saving))

    def _to_host(self, tensor: torch.Tensor) -> Any:
        self._engine.host_copies += 1  # a second, small copy: counted like the engine's NaN pass
        return tensor.cpu().numpy()

    def read_clipped_gradients(self) -> None:
        """Read the gradients again after clipping, between :meth:`prepare_step` and :meth:`step`
        (the Lightning callback does it with ``record_clipped_gradients``):
        ``dynamics/global`` then also holds ``grad_norm_clipped``."""
        self._check_open("read clipped gradients")
        self.dynamics.read_clipped(self._parameters(), gather.local_piece)

    def end_epoch(self, epoch: int | None = None) -> None:
        """Close an epoch: record the mean, min, max and std of the chosen statistics
        (``epoch_statistics``) across the train steps saved since the last ``end_epoch``, under
        ``epochs/<collection>/<tensor>`` with statistics ``<stat>_mean``, ``<stat>_min``, ...,
        in a record of mode ``epoch`` whose mode step is ``epoch`` (default: one more than the
        last). Lightning's callback calls it at ``on_train_epoch_end``.

        >>> hook.end_epoch()                                                            # doctest: +SKIP
        >>> run.tensor("epochs/gradients/fc1.weight").reduction_value(step=0, name="l2_mean")  # doctest: +SKIP
        """
        self._check_open("end an epoch")
        if epoch is None:
            epoch = self._mode_steps[ModeKeys.EPOCH]
        elif isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise expected("epoch", "None or an integer >= 0", epoch)
        self._mode_steps[ModeKeys.EPOCH] = epoch + 1
        if self.world_size > 1 and self.include_workers != "all" and self.rank != 0:
            return  # as for steps: rank 0 records (the statistics it aggregates are the merged ones)
        self._dispatcher.submit(EpochEnd(self.global_step, epoch, self.worker, time.time()))
