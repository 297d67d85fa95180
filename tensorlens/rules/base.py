"""The rule base class: a check run on every saved step's record, online or offline.

A rule reads :class:`~tensorlens.records.StepRecord` objects only: online, the rule runner hands
it each record as it is saved (:mod:`tensorlens.rules.online`); offline, :func:`tensorlens.rules.invoke`
hands it the records of a stored run (``tl.open_run(path).records()``), the same type. So one
class serves both, and a custom rule is a subclass with one method:

>>> class LossAbove(Rule):
...     def __init__(self, limit=10.0, **kwargs):
...         super().__init__(**kwargs)
...         self.limit = float(limit)
...     def invoke_at_step(self, record):
...         loss = record.scalar("losses/crossentropyloss")
...         return loss is not None and loss > self.limit      # True: the rule fires

What a rule does when it fires is its ``action``: ``"warn"`` (a warning, once per rule and
tensor), ``"raise"`` (:class:`~tensorlens.rules.exceptions.RuleEvaluationConditionMet` on the
training thread at the next step boundary), ``"stop"`` (``hook.should_stop`` becomes True), or a
callable taking the :class:`~tensorlens.findings.Finding`. Offline, actions are not taken:
``invoke`` returns the findings (and raises with ``raise_eval_cond=True``).

A rule that had nothing to read in a whole run (no loss was recorded, so LossNotDecreasing
learnt nothing) says so once instead of passing for healthy: a rule that sets :attr:`Rule.needs`
(what it reads and how to record it) and calls :meth:`Rule.mark_evaluated` when it found its
input gets a :data:`~tensorlens.findings.NOT_EVALUATED` finding from :meth:`Rule.not_evaluated`
at the end otherwise. The online runner and :func:`~tensorlens.rules.offline.evaluate` ask for it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from tensorlens.findings import NOT_EVALUATED, Finding
from tensorlens.records import StepRecord
from tensorlens.rules.params import to_action

__all__ = ["Finding", "Rule"]


class Rule:
    """Base class of every rule, built-in or custom.

    Override :meth:`invoke_at_step`; it may return ``True``/``False`` (a finding about the whole
    step is made for ``True``), a :class:`Finding`, a list of them (build them with
    :meth:`finding`), or ``None``. Rules that keep state across steps set it up in :meth:`reset`,
    which :func:`~tensorlens.rules.invoke` calls before reading a run, so one instance can be
    invoked several times. Records of every mode arrive (``record.mode``); records of several
    workers arrive under ``include_workers="all"`` (``record.worker``).

    Args:
        action: ``"warn"``, ``"raise"``, ``"stop"`` or a callable taking a :class:`Finding`.
        name: the name findings carry (default: the class name), to tell two instances apart.
    """

    #: Seconds between two :meth:`check_idle` calls by the online runner; ``None``: never called.
    idle_poll: ClassVar[float | None] = None
    #: What the rule reads, said when a run held none of it: ``"no loss was recorded (pass ...)"``.
    #: ``None``: the rule never reports itself as not evaluated.
    needs: ClassVar[str | None] = None

    def __init__(self, *, action: str | Callable[[Finding], Any] = "warn", name: str | None = None) -> None:
        self.action = to_action(action)
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"Expected `name` to be None or a non-empty string, but got {name!r}")
        self.name = name or type(self).__name__
        self._noted: set[str] = set()
        self.restart()

    # ------------------------------------------------------------------ to override

    def invoke_at_step(self, record: StepRecord) -> bool | Finding | Iterable[Finding] | None:
        """Check one record; see the class docstring for what to return."""
        raise NotImplementedError(f"{type(self).__name__} must implement invoke_at_step(record)")

    def reset(self) -> None:  # noqa: B027 - optional hook
        """Forget what earlier records taught the rule (called by the constructor and by ``invoke``)."""

    def restart(self) -> None:
        """:meth:`reset` and forget whether anything was read (what ``invoke`` calls before a run)."""
        self._evaluated = False
        self._last_seen: tuple[int, Any, int | None, str | None] | None = None  # step, mode, mode step, worker
        self.reset()

    def finish(self) -> Iterable[Finding]:
        """The run has ended (or the offline range is read): report what only the end can tell."""
        return ()

    def check_idle(self, now: float) -> Iterable[Finding]:
        """Called every :attr:`idle_poll` seconds by the online runner, between records."""
        return ()

    # ------------------------------------------------------------------ helpers

    def finding(self, record: StepRecord, tensor: str | None, message: str, value: float | None = None) -> Finding:
        """A :class:`Finding` of this rule about ``tensor`` at ``record``'s step."""
        return Finding(self.name, record.step, record.mode, tensor, message,
                       None if value is None else float(value), record.mode_step, record.worker)

    def note(self, key: str, message: str) -> None:
        """Warn once per rule instance and ``key``: used to say which statistic or collection to
        enable when the records do not hold what the rule reads."""
        if key not in self._noted:
            self._noted.add(key)
            warnings.warn(f"tensorlens rule {self.name}: {message}", stacklevel=3)

    def mark_evaluated(self) -> None:
        """Say that the rule found what it reads (in :meth:`invoke_at_step`): it was evaluated."""
        self._evaluated = True

    @property
    def evaluated(self) -> bool:
        """Whether the rule has found what it reads since it was (re)started."""
        return self._evaluated

    def not_evaluated(self) -> Finding | None:
        """The :data:`~tensorlens.findings.NOT_EVALUATED` finding of a rule with :attr:`needs` that
        read nothing since it was (re)started, at the last step it saw; else ``None``."""
        if self.needs is None or self._evaluated:
            return None
        step, mode, mode_step, worker = self._last_seen or (0, "train", None, None)
        return Finding(self.name, step, mode, None, self.needs, None, mode_step, worker, kind=NOT_EVALUATED)

    def evaluate(self, record: StepRecord) -> list[Finding]:
        """Run :meth:`invoke_at_step` and return its findings as a list."""
        self._last_seen = (record.step, record.mode, record.mode_step, record.worker)
        return self._findings(record, self.invoke_at_step(record))

    def _findings(self, record: StepRecord | None, result: Any) -> list[Finding]:
        if result is None or result is False:
            return []
        if result is True:
            if record is None:
                raise TypeError(f"{self.name}: only invoke_at_step may return True; return Findings instead")
            return [self.finding(record, None, "condition met")]
        if isinstance(result, Finding):
            return [result]
        if isinstance(result, Iterable):
            found = list(result)
            if all(isinstance(f, Finding) for f in found):
                return found
        raise TypeError(f"{self.name}.invoke_at_step returned {result!r}: expected a bool, a Finding or a list of Findings")

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_") and k not in ("name",))
        return f"{type(self).__name__}({params})"
