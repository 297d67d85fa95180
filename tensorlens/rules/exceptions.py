"""The exceptions of rules and of the Trial API, with SageMaker Debugger's names and meanings.

Code ported from ``smdebug`` catches the same names: ``from tensorlens.rules.exceptions import *``.

- :class:`TensorUnavailableForStep`: the tensor (or the statistic asked for) was not saved at that
  step; it never will be.
- :class:`TensorUnavailable`: the tensor was never saved in this run (so far).
- :class:`StepUnavailable`: the step was not saved; no tensor will be available for it.
- :class:`StepNotYetAvailable`: the step has not been written yet; training still runs, so it may come.
- :class:`NoMoreData`: the run has ended and the step asked for lies beyond its last step.
- :class:`RuleEvaluationConditionMet`: a rule fired (raised by ``invoke(..., raise_eval_cond=True)``
  and by a rule with ``action="raise"`` at the next step boundary).

:class:`RuleWarning` is the category of the warning a rule with ``action="warn"`` gives.
"""

from __future__ import annotations

from tensorlens.findings import Finding
from tensorlens.modes import ModeKeys


class TensorLensRuleError(Exception):
    """Base class of the exceptions below (SageMaker's ``SMDebugError``)."""


class RuleWarning(UserWarning):
    """The warning a rule with ``action="warn"`` gives when it fires (filter it like any warning)."""


def _mode_name(mode: ModeKeys | str | None) -> str:
    return "GLOBAL" if mode is None else ModeKeys.coerce(mode).name


class TensorUnavailableForStep(TensorLensRuleError):
    def __init__(self, tname: str, step: int, mode: ModeKeys | str | None = None, has_reductions: bool = False) -> None:
        super().__init__(tname, step, mode, has_reductions)
        self.tname, self.step, self.mode, self.has_reductions = tname, step, mode, has_reductions

    def __str__(self) -> str:
        message = f"Value for tensor {self.tname} is not available for step {self.step} with mode {_mode_name(self.mode)} as it was not saved."
        if self.has_reductions:
            message += " This tensor has reductions saved for this step: query them with reduction_value()."
        return message


class TensorUnavailable(TensorLensRuleError):
    def __init__(self, tname: str) -> None:
        super().__init__(tname)
        self.tname = tname

    def __str__(self) -> str:
        return f"Tensor {self.tname} was not saved."


class StepUnavailable(TensorLensRuleError):
    def __init__(self, step: int, mode: ModeKeys | str | None = None) -> None:
        super().__init__(step, mode)
        self.step, self.mode = step, mode

    def __str__(self) -> str:
        return f"Step {self.step} of mode {_mode_name(self.mode)} is not available as it was not saved"


class StepNotYetAvailable(TensorLensRuleError):
    def __init__(self, step: int, mode: ModeKeys | str | None = None) -> None:
        super().__init__(step, mode)
        self.step, self.mode = step, mode

    def __str__(self) -> str:
        return f"Step {self.step} of mode {_mode_name(self.mode)} not yet available"


class NoMoreData(TensorLensRuleError):
    def __init__(self, step: int, mode: ModeKeys | str | None = None, last_step: int = -1) -> None:
        super().__init__(step, mode, last_step)
        self.step, self.mode, self.last_step = step, mode, last_step

    def __str__(self) -> str:
        return (f"Looking for step {self.step} of mode {_mode_name(self.mode)} and reached end of training. "
                f"Max step available is {self.last_step}")


class RuleEvaluationConditionMet(TensorLensRuleError):
    """A rule fired. ``finding`` says where and why (``rule_name`` and ``step`` as in SageMaker)."""

    def __init__(self, rule_name: str, step: int, finding: Finding | None = None, end_of_rule: bool = False) -> None:
        super().__init__(rule_name, step)
        self.rule_name, self.step, self.finding, self.end_of_rule = rule_name, step, finding, end_of_rule

    def __str__(self) -> str:
        text = f"Evaluation of the rule {self.rule_name} at step {self.step} resulted in the condition being met"
        return f"{text}: {self.finding.message}" if self.finding is not None else text
