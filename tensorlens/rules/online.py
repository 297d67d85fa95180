"""Rules online: a :class:`RuleRunner` checks every saved record off the training thread, and the
training thread takes the rules' actions at the next step boundary.

The runner is a :class:`~tensorlens.Backend` named ``"rules"``: the dispatcher already gives
each backend every saved record on a thread of its own and isolates a backend that fails or
falls behind, so a slow rule never slows training and a rule that raises is warned about once
and skipped for that record, while the other rules, the trackers and training go on. Findings
go three ways: into :meth:`RuleRunner.findings`, to every other backend through the dispatcher
(the run store's ``findings`` table, a W&B alert, an MLflow tag, a TensorBoard text), and into a
queue of actions that :meth:`RuleRunner.take_action` empties on the training thread.

>>> runner = RuleRunner([R.ExplodingTensor(action="stop"), R.VanishingGradient()])   # doctest: +SKIP
>>> hook = tl.Hook(out_dir="runs/exp1", backends=[runner]).register_module(model)   # doctest: +SKIP
>>> for batch in data:                                                             # doctest: +SKIP
...     train_step(batch)
...     if runner.take_action():        # warns, raises or says stop, on this thread
...         break
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

from tensorlens._checks import expected
from tensorlens.backends.base import Backend, RunInfo
from tensorlens.findings import Finding
from tensorlens.modes import ModeKeys
from tensorlens.records import StepRecord
from tensorlens.rules.base import Rule
from tensorlens.rules.defaults import default_rules, recorded_kinds
from tensorlens.rules.exceptions import RuleEvaluationConditionMet, RuleWarning
from tensorlens.rules.params import collection_of, kind_of

logger = logging.getLogger("tensorlens.rules")
#: ``rules=DEFAULT``: the default rules for what the run records, chosen when it opens.
DEFAULT = "default"
#: Rules whose online findings carry what moved first (tl.explain's method; offline: attach_causes).
CAUSE_RULES = ("NonFiniteGradient", "GradientNormSpike", "LossSpike")


class RuleRunner(Backend):
    """Runs ``rules`` on every saved record, on the dispatcher's thread for this backend.

    Created by ``tl.watch(..., rules=[...])`` and the hooks' ``rules=`` argument, or by hand and
    passed in ``backends=[...]``. Only rank 0 of a distributed run checks rules.
    ``rules="default"`` (:data:`DEFAULT`): the default rules for what the run records
    (:func:`~tensorlens.rules.defaults.default_rules`), chosen when the run opens, from the
    collections its metadata names (else from its first record).
    """

    name: ClassVar[str] = "rules"
    supports_histograms: ClassVar[bool] = True
    supports_tensors: ClassVar[bool] = True
    main_process_only: ClassVar[bool] = True
    produces_findings: ClassVar[bool] = True

    def __init__(self, rules: Rule | Sequence[Rule] | str) -> None:
        self._choose_defaults = isinstance(rules, str) and rules == DEFAULT
        if self._choose_defaults:
            rules = []
        if isinstance(rules, Rule):
            rules = [rules]
        if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
            raise expected("rules", f"a list of tensorlens rules (tensorlens.rules.Rule instances) or {DEFAULT!r}", rules)
        self.rules: list[Rule] = list(rules)
        for rule in self.rules:
            if not isinstance(rule, Rule):
                raise expected("rules", "a list of tensorlens rules (tensorlens.rules.Rule instances)", rule)
        self._lock = threading.Lock()  # findings and pending actions, shared with the training thread
        self._rule_lock = threading.Lock()  # a rule is called by one thread at a time (records, idle checks)
        self._findings: list[Finding] = []
        self._not_evaluated: list[Finding] = []
        self._pending: list[tuple[Finding, str | Callable[[Finding], Any]]] = []
        self._warned: set[tuple[str, str | None]] = set()
        self._failed: dict[str, int] = {}
        self._sink: Callable[[Finding], None] | None = None
        self._should_stop = False
        self._idle_stop = threading.Event()
        self._idle_thread: threading.Thread | None = None
        self._trail: Any = None  # tl.explain's TrailingSteps, made when a rule of CAUSE_RULES runs
        self._episodes: dict[str, tuple[int, str]] = {}  # rule -> (last step it fired, its causes)

    # ------------------------------------------------------------------ the backend side (its own thread)

    def bind_findings(self, sink: Callable[[Finding], None]) -> None:
        self._sink = sink

    def open(self, run: RunInfo) -> None:
        config = run.metadata.get("config") if isinstance(run.metadata, Mapping) else None
        if self._choose_defaults and isinstance(config, Mapping) and "collections" in config:
            self._choose_defaults = False
            self.rules = default_rules(recorded_kinds(config))
        polls = [rule.idle_poll for rule in self.rules if rule.idle_poll is not None]
        if polls and self._idle_thread is None:
            self._idle_thread = threading.Thread(target=self._idle_loop, args=(min(polls),), name="tensorlens-rules-idle", daemon=True)
            self._idle_thread.start()

    def write(self, record: StepRecord) -> None:
        if self._choose_defaults:  # no metadata said what is recorded: the first record does
            self._choose_defaults = False
            self.rules = default_rules({kind_of(t) or collection_of(t) for t, _ in record.scalar_names})
        explaining = self._keep_for_causes(record)
        for rule in self.rules:
            found = self._call(rule, "invoke_at_step", lambda rule=rule: rule.evaluate(record))
            if explaining and found and rule.name in CAUSE_RULES:
                found = self._with_causes(rule.name, record.step, found)
            self._emit(rule, found)

    def _keep_for_causes(self, record: StepRecord) -> bool:
        # findings of CAUSE_RULES carry what moved first to every tracker: the trailing saved train
        # steps are kept here (a bounded window of the records' own arrays) to explain them online
        if record.mode != ModeKeys.TRAIN or not any(rule.name in CAUSE_RULES for rule in self.rules):
            return False
        if self._trail is None:
            from tensorlens.analysis.explain import TrailingSteps  # rules import no analysis at import time

            self._trail = TrailingSteps()
        self._trail.add(record.step, record.scalar_names, record.scalar_values)
        return True

    def _with_causes(self, rule: str, step: int, findings: list[Finding]) -> list[Finding]:
        # one episode (a rule firing at consecutive saved steps: a NaN stays) is explained once, at
        # its first step, as tl.explain's attach_causes does offline
        last = self._episodes.get(rule)
        if last is not None and last[0] == self._trail.previous_step():
            text = last[1]
        else:
            try:
                found = self._trail.explain(top=3)
                text = found.summary(3) if found.causes else ""
            except Exception as err:  # explaining is extra: the finding goes out without it
                logger.warning("tensorlens: could not explain %s at step %s: %s: %s", rule, step, type(err).__name__, err)
                text = ""
        self._episodes[rule] = (step, text)
        if not text:
            return findings
        return [dataclasses.replace(f, message=f"{f.message}; {text}") for f in findings]

    def close(self) -> None:
        self._idle_stop.set()
        if self._idle_thread is not None:
            self._idle_thread.join(5.0)
        for rule in self.rules:
            self._emit(rule, self._call(rule, "finish", lambda rule=rule: rule._findings(None, rule.finish())))
        # a rule that read nothing says so once; a note, not a problem: kept here, not sent to trackers
        notes = [note for note in (rule.not_evaluated() for rule in self.rules) if note is not None]
        with self._lock:
            self._not_evaluated = notes
        for note in notes:
            logger.info("%s", note)

    def _idle_loop(self, poll: float) -> None:
        while not self._idle_stop.wait(poll):
            for rule in self.rules:
                if rule.idle_poll is not None:
                    self._emit(rule, self._call(rule, "check_idle", lambda rule=rule: rule._findings(None, rule.check_idle(time.time()))))

    def _call(self, rule: Rule, what: str, fn: Callable[[], list[Finding]]) -> list[Finding]:
        try:
            with self._rule_lock:
                return fn()
        except Exception as err:  # a rule's bug is isolated: the other rules and training go on
            count = self._failed[rule.name] = self._failed.get(rule.name, 0) + 1
            if count == 1:
                warnings.warn(f"tensorlens: rule {rule.name} failed in {what}: {type(err).__name__}: {err}; training and "
                              "the other rules continue (this warning is shown once)", RuleWarning, stacklevel=2)
            return []

    def _emit(self, rule: Rule, findings: list[Finding]) -> None:
        if not findings:
            return
        with self._lock:
            self._findings.extend(findings)
            self._pending.extend((f, rule.action) for f in findings)
        if self._sink is not None:
            for finding in findings:
                self._sink(finding)

    # ------------------------------------------------------------------ the training thread's side

    def take_action(self, raise_errors: bool = True) -> bool:
        """Take the actions of the findings made since the last call; call it at each step
        boundary on the training thread. Warns (once per rule and tensor), calls callables,
        raises :class:`RuleEvaluationConditionMet` for the first ``"raise"`` finding (a warning
        instead with ``raise_errors=False``, as at ``close()``), and returns :attr:`should_stop`.
        """
        with self._lock:
            pending, self._pending = self._pending, []
        to_raise: Finding | None = None
        for finding, action in pending:
            if action == "warn":
                if (finding.rule, finding.tensor) not in self._warned:
                    self._warned.add((finding.rule, finding.tensor))
                    warnings.warn(f"tensorlens rule fired: {finding} (shown once per rule and tensor)", RuleWarning, stacklevel=2)
            elif action == "stop":
                if not self._should_stop:
                    warnings.warn(f"tensorlens rule asks to stop training: {finding}", RuleWarning, stacklevel=2)
                self._should_stop = True
            elif action == "raise":
                if to_raise is None:
                    to_raise = finding
            else:
                action(finding)
        if to_raise is not None:
            if raise_errors:
                raise RuleEvaluationConditionMet(to_raise.rule, to_raise.step, to_raise)
            warnings.warn(f"tensorlens rule fired (action 'raise'): {to_raise}", RuleWarning, stacklevel=2)
        return self._should_stop

    @property
    def should_stop(self) -> bool:
        """True once a rule with ``action="stop"`` fired and :meth:`take_action` saw it."""
        return self._should_stop

    def findings(self) -> list[Finding]:
        """Every finding so far, in the order found."""
        with self._lock:
            return list(self._findings)

    def not_evaluated(self) -> list[Finding]:
        """After ``close()``: one note per rule that had nothing to read in the run (kind
        ``"not_evaluated"``, its message says what to record). Not findings: no action is taken,
        and trackers do not get them."""
        with self._lock:
            return list(self._not_evaluated)

    def failures(self) -> dict[str, int]:
        """Errors per rule name (a rule that raised is skipped for that record and warned about once)."""
        return dict(self._failed)
