"""A finding: what a rule reports when its condition holds at a step, or that it had nothing to read.

Its own module (not in :mod:`tensorlens.rules`) because the run store, the dispatcher and every
backend handle findings, and none of them should depend on the rules that produce them.
"""

from __future__ import annotations

import dataclasses

from tensorlens.modes import ModeKeys

#: :attr:`Finding.kind` of a rule's condition holding: something about the run's health.
HEALTH = "health"
#: :attr:`Finding.kind` of a rule that had nothing to read in the whole run (no loss recorded, no
#: gradient): said once, at the end, so that silence is not read as health. Not a problem found.
NOT_EVALUATED = "not_evaluated"
KINDS = (HEALTH, NOT_EVALUATED)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One firing of a rule: which rule, at which step and mode, on which tensor, and why.

    ``tensor`` is ``None`` for a finding about the whole step (a stalled run, a global norm).
    ``value`` is the number that crossed the threshold, when there is one. ``kind`` is
    :data:`HEALTH` for a rule that fired, :data:`NOT_EVALUATED` for a rule that had nothing to
    read (its ``message`` says what was missing and how to record it; ``step`` is the last one seen).

    >>> Finding("VanishingGradient", 3, ModeKeys.TRAIN, "gradients/fc1.weight", "abs mean 1e-09 < 1e-07")
    Finding(rule='VanishingGradient', step=3, mode=<ModeKeys.TRAIN: 'train'>, tensor='gradients/fc1.weight', message='abs mean 1e-09 < 1e-07', value=None, mode_step=None, worker=None, kind='health')
    >>> str(Finding("LossSpike", 9, "train", None, "no loss was recorded", kind=NOT_EVALUATED))
    '[LossSpike] not evaluated: no loss was recorded'
    """

    rule: str
    step: int
    mode: ModeKeys
    tensor: str | None
    message: str
    value: float | None = None
    mode_step: int | None = None
    worker: str | None = None
    kind: str = HEALTH

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", ModeKeys.coerce(self.mode))
        if self.kind not in KINDS:
            raise ValueError(f"Expected `kind` to be one of {list(KINDS)}, but got {self.kind!r}")

    @property
    def evaluated(self) -> bool:
        """False for a :data:`NOT_EVALUATED` note: the rule had nothing to read."""
        return self.kind != NOT_EVALUATED

    def __str__(self) -> str:
        if self.kind == NOT_EVALUATED:
            return f"[{self.rule}] not evaluated: {self.message}"
        where = f" {self.tensor}" if self.tensor else ""
        return f"[{self.rule}] step {self.step} ({self.mode.value}){where}: {self.message}"
