"""When the recorder feeds training dynamics: what the ``dynamics`` collection reads before the
optimizer step (on a saved step and on the step before one), after it, from module captures, and
after gradient clipping.

The statistics themselves live in engine/dynamics.py (what is kept and derived) and
dispatch/epochs.py (what is aggregated across an epoch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tensorlens.collection import Kind
from tensorlens.compute.jobs import DerivedScalars, TensorJob
from tensorlens.engine import gather
from tensorlens.engine.dynamics import Dynamics
from tensorlens.engine.schedule import Schedule
from tensorlens.engine.step_output import StepOutput
from tensorlens.modes import ModeKeys


class DynamicsSteps:
    """The recorder's calls into its :class:`~tensorlens.engine.dynamics.Dynamics`, at the step
    boundaries. ``saves_here``: this rank computes statistics at all (not so for ranks other than 0
    under ``include_workers="one"``)."""

    def __init__(
        self, dynamics: Dynamics, schedule: Schedule, parameters: Callable[[], list[tuple[str, torch.Tensor]]],
        output: StepOutput, rank: int, saves_here: bool,
    ) -> None:
        self.dynamics = dynamics
        self._schedule = schedule
        self._parameters = parameters
        self._output = output
        self._rank = rank
        self._saves_here = saves_here

    def before_update(self, saving: frozenset[str], mode: ModeKeys, mode_step: int, global_step: int) -> None:
        """Read what the ``dynamics`` collection needs before the optimizer step: on a saved step
        and on the step before one (the previous gradient and update for the cosines)."""
        next_saves = (
            self._schedule.is_enabled(Kind.DYNAMICS)
            and self._saves_here
            and self._schedule.saves(Kind.DYNAMICS, mode, mode_step + 1)
        )
        self.dynamics.before_update(self._parameters, global_step, Kind.DYNAMICS in saving, next_saves, gather.local_piece)

    def after_update(self, saving: frozenset[str]) -> DerivedScalars | None:
        return self.dynamics.after_update(self._output.live_reducer(saving), self._rank)

    def of_modules(self, saving: frozenset[str], mode: ModeKeys) -> tuple[list[TensorJob], DerivedScalars | None]:
        """The module statistics of ``dynamics`` captured in ``mode`` (dead units, per-sample
        norms); under ``include_workers="reduce"`` summed across ranks (a collective)."""
        if Kind.DYNAMICS not in saving or not self.dynamics.config.module_statistics:
            self.dynamics.drop_captures(mode)
            return [], None
        return self.dynamics.module_results(mode, self._output.live_reducer(saving))

    def complete_nonfinite(self, host: Any, saving: frozenset[str]) -> None:
        self.dynamics.complete_nonfinite(host, self._output.live_reducer(saving), self._rank, self._output.to_host)

    def read_clipped(self) -> None:
        self.dynamics.read_clipped(self._parameters(), gather.local_piece)
