"""Rules offline: run the same rule classes over a stored run, with SageMaker Debugger's
``invoke_rule(rule, start_step, end_step, raise_eval_cond)`` semantics; :func:`evaluate`, a
run's health by the default rules (what ``tensorlens rules RUN`` and the report show).

>>> run = tl.open_run("tensorlens_runs/exp1")                                        # doctest: +SKIP
>>> R.invoke(run, R.DeadRelu(threshold_layer=50.0), start_step=0, end_step=None)    # doctest: +SKIP
[Finding(rule='DeadRelu', step=40, ...)]
>>> health = R.evaluate(run)               # the default rules for what the run recorded   # doctest: +SKIP
>>> health.findings, health.not_evaluated                                             # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tensorlens._checks import expected
from tensorlens.findings import Finding
from tensorlens.modes import ModeKeys
from tensorlens.records import StepRecord
from tensorlens.rules.base import Rule
from tensorlens.rules.builtin import BUILTIN_RULES, DEFAULT_RULES, create_rule
from tensorlens.rules.defaults import default_rules
from tensorlens.rules.exceptions import RuleEvaluationConditionMet
from tensorlens.store.reader import Run, open_run

logger = logging.getLogger("tensorlens.rules")


def _by_step(records: Iterator[StepRecord]) -> Iterator[list[StepRecord]]:
    """Records grouped by global step, each group in the order they were saved (wall time):
    an evaluation at global step s came before train step s ended, as the online runner saw it."""
    group: list[StepRecord] = []
    for record in records:
        if group and record.step != group[0].step:
            yield sorted(group, key=lambda r: (r.wall_time, list(ModeKeys).index(r.mode), r.mode_step))
            group = []
        group.append(record)
    if group:
        yield sorted(group, key=lambda r: (r.wall_time, list(ModeKeys).index(r.mode), r.mode_step))


def _follow(run: Run, start_step: int, end_step: int | None, wait: bool, timeout: float | None,
            poll: float) -> Iterator[StepRecord]:
    """Every record with ``start_step <= step < end_step``; with ``wait``, new ones as training
    writes them, until the run has ended (or ``end_step`` is reached, or ``timeout`` seconds pass).
    One record at a time: a run of any length is never held in memory."""
    seen: set[tuple[str, int, str]] = set()
    last_step = start_step
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        ended = run.ended  # read before the records: whatever was written before the end is read below
        fresh = False
        for group in _by_step(run.records(start_step=last_step, end_step=end_step)):
            for record in group:
                key = (record.mode.value, record.mode_step, record.worker)
                if key in seen:
                    continue
                seen.add(key)
                fresh = True
                yield record
            if group[0].step > last_step:  # keys of older steps can never come again
                seen = {(r.mode.value, r.mode_step, r.worker) for r in group}
                last_step = group[0].step
        if not wait or ended or (end_step is not None and run.steps() and max(run.steps()) >= end_step):
            return
        if deadline is not None and time.monotonic() >= deadline:
            logger.info("stopped following %s after %.3g s: the run has not ended", run.path, timeout)
            return
        if not fresh:
            time.sleep(poll)


def _rules_list(rule: Rule | Sequence[Rule]) -> list[Rule]:
    rules = [rule] if isinstance(rule, Rule) else list(rule) if isinstance(rule, Sequence) else None
    if not rules or not all(isinstance(r, Rule) for r in rules):
        raise expected("rule", "a tensorlens rule or a list of them", rule)
    return rules


def _check_range(start_step: int, end_step: int | None) -> None:
    if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
        raise expected("start_step", "an integer >= 0", start_step)
    if end_step is not None and (isinstance(end_step, bool) or not isinstance(end_step, int) or end_step < start_step):
        raise expected("end_step", f"None or an integer >= start_step ({start_step})", end_step)


def _run_rules(run: Run | str, rules: list[Rule], start_step: int, end_step: int | None, raise_eval_cond: bool,
               wait: bool, timeout: float | None, poll: float,
               on_record: Callable[[StepRecord], object] | None) -> tuple[list[Finding], list[Finding]]:
    """``(findings, not-evaluated notes)`` of ``rules`` over the records of ``run`` (see :func:`invoke`)."""
    opened = not isinstance(run, Run)
    store = open_run(str(run)) if opened else run
    found: list[Finding] = []

    def report(r: Rule, findings: list[Finding]) -> None:
        for finding in findings:
            if raise_eval_cond:
                raise RuleEvaluationConditionMet(r.name, finding.step, finding)
            logger.debug("%s", finding)
            found.append(finding)

    try:
        for r in rules:
            r.restart()
        for record in _follow(store, start_step, end_step, wait, timeout, poll):
            for r in rules:
                report(r, r.evaluate(record))
            if on_record is not None:
                on_record(record)
        for r in rules:
            report(r, r._findings(None, r.finish()))
    finally:
        if opened:
            store.close()
    return found, [note for note in (r.not_evaluated() for r in rules) if note is not None]


def invoke(run: Run | str, rule: Rule | Sequence[Rule], start_step: int = 0, end_step: int | None = None,
           raise_eval_cond: bool = False, *, wait: bool = False, timeout: float | None = None,
           poll: float = 0.5, on_record: Callable[[StepRecord], object] | None = None) -> list[Finding]:
    """Run ``rule`` (or several) over the stored records of ``run`` at global steps
    ``start_step <= step < end_step`` and return the findings.

    As SageMaker's ``invoke_rule``: the rule is invoked at those steps only, ``end_step`` is
    exclusive, ``None`` reads to the end; ``raise_eval_cond=True`` raises
    :class:`RuleEvaluationConditionMet` at the first finding, else findings are collected and
    logged. Records before ``start_step`` are not read: a rule that looks back over its last
    ``n`` steps (UnchangedTensor, LossNotDecreasing) fills its window from ``start_step`` on
    (a SageMaker rule could query its trial for earlier steps; a tensorlens rule learns only from
    the records it is handed, so start earlier to give it that history). Each rule is
    :meth:`~Rule.restart` first, and its action is not taken: offline there is no training to warn,
    stop or raise into. Rules that had nothing to read are not among the findings: :func:`evaluate`
    returns those notes too.

    ``wait=True`` follows a run that is still being written until it ends (``Run.ended``), like
    SageMaker rules on a live trial; ``timeout`` bounds the wait (a crashed run never ends).
    ``on_record`` is called after each record is checked (the CLI's progress bar).
    """
    rules = _rules_list(rule)
    _check_range(start_step, end_step)
    return _run_rules(run, rules, start_step, end_step, raise_eval_cond, wait, timeout, poll, on_record)[0]


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What :func:`evaluate` found: the ``rules`` run, their health ``findings`` (kind
    ``"health"``, in the order found) and one ``not_evaluated`` note per rule that had nothing to
    read (kind ``"not_evaluated"``: its message says what to record). Only findings are problems."""

    rules: list[Rule]
    findings: list[Finding]
    not_evaluated: list[Finding]

    @property
    def healthy(self) -> bool:
        """No rule fired (rules that were not evaluated do not count)."""
        return not self.findings

    def by_rule(self) -> dict[str, list[Finding]]:
        """Each rule's name -> its findings (empty for a rule that did not fire), in rule order."""
        out: dict[str, list[Finding]] = {r.name: [] for r in self.rules}
        for finding in self.findings:
            out.setdefault(finding.rule, []).append(finding)
        return out


def evaluate(run: Run | str, rules: Rule | Sequence[Rule] | None = None, start_step: int = 0, end_step: int | None = None,
             *, on_record: Callable[[StepRecord], object] | None = None) -> Evaluation:
    """Check a stored run with ``rules`` (default: :func:`~tensorlens.rules.defaults.default_rules`
    for what the run recorded) and return the findings and the rules that had nothing to read.

    >>> health = evaluate("tensorlens_runs/exp1")                  # doctest: +SKIP
    >>> [str(n) for n in health.not_evaluated]                     # doctest: +SKIP
    ['[LossNotDecreasing] not evaluated: no loss was recorded (...)', ...]
    """
    _check_range(start_step, end_step)
    opened = not isinstance(run, Run)
    store = open_run(str(run)) if opened else run
    try:
        chosen = default_rules(store) if rules is None else _rules_list(rules)
        found, notes = _run_rules(store, chosen, start_step, end_step, False, False, None, 0.5, on_record)
        # NonFiniteGradient, GradientNormSpike and LossSpike findings name what moved first (tl.explain);
        # imported here: analysis reads runs with the rules, rules import no analysis at import time
        from tensorlens.analysis.explain import attach_causes

        found = attach_causes(found, store)
    finally:
        if opened:
            store.close()
    return Evaluation(chosen, found, notes)


def parse_rule_spec(spec: str) -> Rule:
    """A built-in rule from ``NAME`` or ``NAME:key=value;key=value`` (the CLI's ``--rule``); values
    are strings as SageMaker passes rule parameters.

    >>> parse_rule_spec("UnchangedTensor:collection_names=weights;num_steps=5").num_steps
    5
    """
    name, _, rest = spec.partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(";"))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"Expected rule parameters as key=value separated by ';', but got {item!r} in {spec!r}")
        params[key.strip()] = value.strip()
    return create_rule(name.strip(), **params)


def rules_command(path: str | Run, rule_specs: Sequence[str] = (), start_step: int = 0, end_step: int | None = None,
                  echo: Callable[[str], object] = print, on_record: Callable[[StepRecord], object] | None = None) -> int:
    """``tensorlens rules RUN [--rule SPEC ...]``: run rules over a stored run and print the
    findings, one line at a time through ``echo`` (the CLI's escapes names read from the store).
    Without ``--rule``: the default rules for what the run recorded
    (:func:`~tensorlens.rules.defaults.default_rules`). Rules that had nothing to read say so.
    Returns the exit code: 0 when no rule fired, 1 when one did.
    """
    rules = command_rules(rule_specs) if rule_specs else None
    result = evaluate(path, rules, start_step=start_step, end_step=end_step, on_record=on_record)
    return print_findings(result.rules, [*result.findings, *result.not_evaluated], echo)


def command_rules(rule_specs: Sequence[str] = (), run: Run | str | None = None) -> list[Rule]:
    """The rules of ``--rule`` specs; without any, the default rules for what ``run`` recorded
    (without a run, those every run gets)."""
    if rule_specs:
        return [parse_rule_spec(spec) for spec in rule_specs]
    return default_rules(run) if run is not None else [BUILTIN_RULES[n]() for n in DEFAULT_RULES]


def print_findings(rules: Sequence[Rule], findings: Sequence[Finding], echo: Callable[[str], object] = print) -> int:
    """Per rule: how many findings from which step, and the first finding of each tensor; a rule
    that had nothing to read says "not evaluated" and why. Returns 1 when a rule fired, else 0
    (a rule that was not evaluated found no problem)."""
    for rule in rules:
        notes = [f for f in findings if f.rule == rule.name and not f.evaluated]
        mine = [f for f in findings if f.rule == rule.name and f.evaluated]
        if notes and not mine:
            echo(f"{rule.name}: not evaluated: {notes[0].message}")
            continue
        if not mine:
            echo(f"{rule.name}: no finding")
            continue
        tensors = {f.tensor for f in mine if f.tensor}
        echo(f"{rule.name}: {len(mine)} finding(s) from step {mine[0].step}" + (f" on {len(tensors)} tensor(s)" if tensors else ""))
        shown: set[str | None] = set()
        for finding in mine:  # the first finding of each tensor
            if finding.tensor not in shown:
                shown.add(finding.tensor)
                echo(f"  {finding}")
    return 1 if any(f.evaluated for f in findings) else 0


def invoke_rule(rule_obj: Rule, start_step: int = 0, end_step: int | None = None, raise_eval_cond: bool = False, *,
                run: Run | str) -> list[Finding]:
    """SageMaker's ``invoke_rule`` signature, with the run given by keyword (a SageMaker rule
    holds its trial; a tensorlens rule does not): ``invoke_rule(rule, 0, None, run=path)``."""
    return invoke(run, rule_obj, start_step, end_step, raise_eval_cond)
