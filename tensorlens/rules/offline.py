"""Rules offline: run the same rule classes over a stored run, with SageMaker Debugger's
``invoke_rule(rule, start_step, end_step, raise_eval_cond)`` semantics, and ``tensorlens rules RUN``.

>>> run = tl.open_run("tensorlens_runs/exp1")                                        # doctest: +SKIP
>>> R.invoke(run, R.DeadRelu(threshold_layer=50.0), start_step=0, end_step=None)    # doctest: +SKIP
[Finding(rule='DeadRelu', step=40, ...)]
"""

from __future__ import annotations

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
    :meth:`~Rule.reset` first, and its action is not taken: offline there is no training to warn,
    stop or raise into.

    ``wait=True`` follows a run that is still being written until it ends (``Run.ended``), like
    SageMaker rules on a live trial; ``timeout`` bounds the wait (a crashed run never ends).
    ``on_record`` is called after each record is checked (the CLI's progress bar).
    """
    rules = [rule] if isinstance(rule, Rule) else list(rule) if isinstance(rule, Sequence) else None
    if not rules or not all(isinstance(r, Rule) for r in rules):
        raise expected("rule", "a tensorlens rule or a list of them", rule)
    if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
        raise expected("start_step", "an integer >= 0", start_step)
    if end_step is not None and (isinstance(end_step, bool) or not isinstance(end_step, int) or end_step < start_step):
        raise expected("end_step", f"None or an integer >= start_step ({start_step})", end_step)
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
            r.reset()
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
    return found


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
    Without ``--rule``: the rules that need nothing beyond the default statistics
    (:data:`~tensorlens.rules.builtin.DEFAULT_RULES`). Returns the exit code: 0 when no rule
    fired, 1 when one did.
    """
    rules = command_rules(rule_specs)
    return print_findings(rules, invoke(path, rules, start_step=start_step, end_step=end_step, on_record=on_record), echo)


def command_rules(rule_specs: Sequence[str] = ()) -> list[Rule]:
    """The rules of ``--rule`` specs, or the default rules when there are none."""
    return [parse_rule_spec(spec) for spec in rule_specs] if rule_specs else [BUILTIN_RULES[n]() for n in DEFAULT_RULES]


def print_findings(rules: Sequence[Rule], findings: Sequence[Finding], echo: Callable[[str], object] = print) -> int:
    """Per rule: how many findings from which step, and the first finding of each tensor.
    Returns 1 when a rule fired, else 0."""
    for rule in rules:
        mine = [f for f in findings if f.rule == rule.name]
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
    return 1 if findings else 0


def invoke_rule(rule_obj: Rule, start_step: int = 0, end_step: int | None = None, raise_eval_cond: bool = False, *,
                run: Run | str) -> list[Finding]:
    """SageMaker's ``invoke_rule`` signature, with the run given by keyword (a SageMaker rule
    holds its trial; a tensorlens rule does not): ``invoke_rule(rule, 0, None, run=path)``."""
    return invoke(run, rule_obj, start_step, end_step, raise_eval_cond)
