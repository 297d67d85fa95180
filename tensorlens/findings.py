"""A finding: what a rule reports when its condition holds at a step.

Its own module (not in :mod:`tensorlens.rules`) because the run store, the dispatcher and every
backend handle findings, and none of them should depend on the rules that produce them.
"""

from __future__ import annotations

import dataclasses

from tensorlens.modes import ModeKeys


@dataclasses.dataclass(frozen=True)
class Finding:
    """One firing of a rule: which rule, at which step and mode, on which tensor, and why.

    ``tensor`` is ``None`` for a finding about the whole step (a stalled run, a global norm).
    ``value`` is the number that crossed the threshold, when there is one.

    >>> Finding("VanishingGradient", 3, ModeKeys.TRAIN, "gradients/fc1.weight", "abs mean 1e-09 < 1e-07")
    Finding(rule='VanishingGradient', step=3, mode=<ModeKeys.TRAIN: 'train'>, tensor='gradients/fc1.weight', message='abs mean 1e-09 < 1e-07', value=None, mode_step=None, worker=None)
    """

    rule: str
    step: int
    mode: ModeKeys
    tensor: str | None
    message: str
    value: float | None = None
    mode_step: int | None = None
    worker: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", ModeKeys.coerce(self.mode))

    def __str__(self) -> str:
        where = f" {self.tensor}" if self.tensor else ""
        return f"[{self.rule}] step {self.step} ({self.mode.value}){where}: {self.message}"
