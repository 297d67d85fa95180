"""A run's health at a glance: what the report opens with and what the explorer marks.

For one run (a :class:`~tensorlens.reports.data.RunData`, already read in one pass):

- **rules**: the default rules for what the run recorded
  (:func:`tensorlens.rules.offline.evaluate`) checked over the store now, plus the findings the
  rules stored while it trained; their findings grouped by rule, each rule with a *severity*
  (:data:`SEVERITY`: ``critical`` when the run's numbers are broken, ``warning`` otherwise), and
  the rules that had nothing to read, with why (a "not evaluated" note, never counted as health);
- **first non-finite**: the first saved step at which any tensor held a NaN or an Inf (counted,
  ``nan_count`` / ``inf_count``) or a loss was NaN/Inf, and the tensors that did, in the order a
  training step computes them (weights, the forward pass, the loss, the backward pass, the update);
- **dead units**: the layers with the largest ``dead_fraction`` (units zero for the whole batch,
  ``tl.watch(model, dynamics=True)``) at the last saved step; without it, the largest
  ``zero_fraction`` of activations;
- **what changed first**: before the run's first loss spike or non-finite value, the tensors that
  left their own trailing behaviour earliest and farthest (:func:`tensorlens.analysis.explain.explain`);
- **update ratio**: the parameters whose ``||update|| / ||weight||`` at the last saved step lies
  farthest from 1e-3 on a log scale (an update of 0, or NaN, is farthest of all), from
  ``dynamics/<param>`` ``update_ratio`` or ``updates/<param>`` l2 over ``weights/<param>`` l2.

>>> health = run_health(load_run("tensorlens_runs/exp1"))      # doctest: +SKIP
>>> health.status, health.first_nonfinite                       # doctest: +SKIP
('critical', (12, ['activations/0', ...]))
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from tensorlens.analysis.compare import step_order
from tensorlens.findings import Finding
from tensorlens.records import StepRecord
from tensorlens.reports.data import RunData

#: A rule's severity in the health summary; a rule not listed is a ``warning``. ``critical``: the
#: run's numbers are broken (NaN/Inf), whatever else it does.
SEVERITY = {"NonFiniteGradient": "critical", "ExplodingTensor": "critical"}
SEVERITIES = ("critical", "warning")
#: The update ratio a healthy layer is usually near (Karpathy's rule of thumb): the worst layers lie
#: farthest from it on a log scale.
TYPICAL_UPDATE_RATIO = 1e-3
#: Layers listed at most per health line.
WORST = 3


@dataclasses.dataclass(frozen=True)
class RuleHealth:
    """One rule that fired: its ``findings`` (every one), ``severity``, the ``tensors`` it named in
    the order they first fired (``None`` for a finding about the whole step is left out)."""

    rule: str
    severity: str
    findings: tuple[Finding, ...]

    @property
    def first(self) -> Finding:
        return self.findings[0]

    @property
    def tensors(self) -> list[str]:
        return list(dict.fromkeys(f.tensor for f in self.findings if f.tensor))


@dataclasses.dataclass
class Health:
    """A run's health (see the module docstring). ``status`` is ``critical``, ``warning`` or
    ``healthy`` (no rule fired; rules that were not evaluated do not make a run unhealthy)."""

    run: str
    rules: list[str]  # the rules evaluated on the store, by name
    fired: list[RuleHealth]  # by severity, then first step
    not_evaluated: list[Finding]
    first_nonfinite: tuple[int, list[str]] | None  # step, the tensors non-finite there (step order)
    nonfinite_recorded: bool
    dead: list[tuple[str, float]] | None  # (tensor, fraction) worst first; None: nothing recorded
    dead_statistic: str  # "dead_fraction" or "zero_fraction"
    update_ratios: list[tuple[str, float]] | None  # (parameter, ratio) worst first
    errors: list[str] = dataclasses.field(default_factory=list)  # what the rules warned about, or why they could not run
    explanation: Any = None  # tl.explain's answer for the run's first event (None: no event, or not run)

    @property
    def findings(self) -> list[Finding]:
        return [f for r in self.fired for f in r.findings]

    @property
    def status(self) -> str:
        return self.fired[0].severity if self.fired else "healthy"

    def counts(self) -> dict[str, int]:
        """Findings per severity."""
        out = {s: 0 for s in SEVERITIES}
        for r in self.fired:
            out[r.severity] = out.get(r.severity, 0) + len(r.findings)
        return out


def severity(rule: str) -> str:
    return SEVERITY.get(rule, "warning")


def run_health(data: RunData, rules: Sequence[Any] | None = None) -> Health:
    """The health of one run read by :func:`~tensorlens.reports.data.load_run` (computed once and
    kept on ``data``; ``rules`` replaces the default rules)."""
    cached = getattr(data, "_health", None)
    if cached is not None and rules is None:
        return cached
    found, notes, names, errors = _rules(data, rules)
    by_rule: dict[str, list[Finding]] = {}
    for f in found:
        by_rule.setdefault(f.rule, []).append(f)
    fired = [RuleHealth(rule, severity(rule), tuple(sorted(fs, key=lambda f: f.step))) for rule, fs in by_rule.items()]
    fired.sort(key=lambda r: (SEVERITIES.index(r.severity) if r.severity in SEVERITIES else 9, r.first.step, r.rule))
    dead, dead_statistic = _dead(data)
    health = Health(data.name, names, fired, notes, _first_nonfinite(data), bool(data.nonfinite), dead, dead_statistic,
                    _update_ratios(data), errors)
    health.explanation = _explain(data, errors)
    if rules is None:
        data._health = health  # type: ignore[attr-defined]
    return health


def rules_reader(data: RunData, take: Callable[[StepRecord], None]) -> None:
    """A ``reader`` for :func:`~tensorlens.reports.data.load_run`: the default rules evaluated on the
    store (``tensorlens.rules.evaluate``) in the same pass that loads the run, their result kept
    for :func:`run_health`. If the rules fail part way, the records they did not reach are read
    without them (and the page says why)."""
    seen: set[tuple[int, str, int, str]] = set()

    def keep(record: StepRecord) -> None:
        seen.add((record.step, str(record.mode), record.mode_step, record.worker))
        take(record)

    data._evaluation = _evaluate(data, None, keep)  # type: ignore[attr-defined]
    if data._evaluation[3] and any(e.startswith(_FAILED) for e in data._evaluation[3]):  # type: ignore[attr-defined]
        for record in data.run.records():
            if (record.step, str(record.mode), record.mode_step, record.worker) not in seen:
                take(record)


_FAILED = "the rules could not be run on the store"


def _evaluate(data: RunData, rules: Sequence[Any] | None, on_record: Callable[[StepRecord], None] | None = None,
              ) -> tuple[list[Finding], list[Finding], list[str], list[str]]:
    """``(findings, not-evaluated notes, rule names, errors)`` of ``rules`` (default: the default
    rules for what the run recorded) over the store; what a rule warned about is among the errors."""
    errors: list[str] = []
    with warnings.catch_warnings(record=True) as caught:  # a rule's warning belongs on the page, not in a log
        warnings.simplefilter("always")
        try:
            from tensorlens.rules.offline import evaluate  # the rules are imported only when a page asks for health

            result = evaluate(data.run, list(rules) if rules is not None else None, on_record=on_record)
            found, notes, names = list(result.findings), list(result.not_evaluated), [r.name for r in result.rules]
        except Exception as err:  # a rule that breaks on an odd store must not take the page down
            found, notes, names = [], [], []
            errors.append(f"{_FAILED}: {type(err).__name__}: {err}")
    errors += list(dict.fromkeys(str(w.message).removeprefix("tensorlens rule ") for w in caught))
    return found, notes, names, errors


def _rules(data: RunData, rules: Sequence[Any] | None) -> tuple[list[Finding], list[Finding], list[str], list[str]]:
    """``(findings, not-evaluated notes, rule names, errors)``: the rules evaluated on the store (in
    the pass that loaded the run, when :func:`rules_reader` read it) and what the rules stored while
    the run trained, each finding once."""
    evaluated = getattr(data, "_evaluation", None)
    found, notes, names, errors = [list(x) for x in evaluated] if evaluated and rules is None else _evaluate(data, rules)
    try:
        stored = data.run.findings()
    except Exception:  # a store written before findings were stored
        stored = []
    seen = {(f.rule, f.step, f.mode, f.mode_step, f.tensor, f.worker) for f in found}
    for f in stored:
        if not getattr(f, "evaluated", True):
            if all(n.rule != f.rule for n in notes) and all(g.rule != f.rule for g in found):
                notes.append(f)
            continue
        key = (f.rule, f.step, f.mode, f.mode_step, f.tensor, f.worker)
        if key not in seen:
            seen.add(key)
            found.append(f)
    notes = [n for n in notes if all(f.rule != n.rule for f in found)]  # a rule that fired was evaluated
    return found, notes, names, errors


def _explain(data: RunData, errors: list[str]) -> Any:
    """What changed first before the run's first loss spike or non-finite value (``tl.explain``),
    or ``None`` when the run has no such event."""
    try:
        from tensorlens.analysis.explain import explain

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = explain(data.run, top=WORST, worker=data.worker)
    except Exception as err:  # an odd store must not take the page down
        errors.append(f"what changed first could not be worked out: {type(err).__name__}: {err}")
        return None
    return found if found.event is not None else None


def _first_nonfinite(data: RunData) -> tuple[int, list[str]] | None:
    firsts = {tensor: int(first) for tensor, (first, _, _) in data.nonfinite_tensors.items()}
    for (tensor, mode), (steps, values) in data.plain.items():
        if mode != "train":
            continue
        bad = [s for s, v in zip(steps, values, strict=True) if not math.isfinite(v)]
        if bad:
            firsts[tensor] = min(bad)
    if not firsts:
        return None
    step = min(firsts.values())
    order = {t: i for i, t in enumerate(data.tensors)}
    tensors = sorted((t for t, s in firsts.items() if s == step), key=lambda t: (step_order(t), order.get(t, len(order))))
    return step, tensors


def _last_values(data: RunData, stat: str, collections: tuple[str, ...],
                 with_nonfinite: bool = False) -> dict[str, float]:
    """``tensor -> value`` of ``stat`` at the last kept step that holds it, for tensors of
    ``collections``; a tensor that held NaN or Inf values at that step has the value NaN unless
    ``with_nonfinite`` (a dead fraction of NaN activations says nothing about dead units)."""
    tensors = [t for t in data.tensors if t.split("/", 1)[0] in collections and stat in data.stats.get(t, ())]
    out: dict[str, float] = {}
    for record in reversed(data.column_records):
        for tensor in tensors:
            if tensor not in out:
                value = record.scalar(tensor, stat)
                if value is not None:
                    broken = (record.scalar(tensor, "nan_count") or 0) + (record.scalar(tensor, "inf_count") or 0)
                    out[tensor] = float(value) if with_nonfinite or not broken else math.nan
        if len(out) == len(tensors):
            break
    return out


def _dead(data: RunData) -> tuple[list[tuple[str, float]] | None, str]:
    """The activations by their dead (or zero) fraction at the last step, largest first; those that
    held NaN/Inf there (value NaN) last."""
    for stat in ("dead_fraction", "zero_fraction"):
        values = _last_values(data, stat, ("activations",))
        if values:
            ranked = sorted(values.items(), key=lambda kv: -kv[1] if math.isfinite(kv[1]) else 1.0)
            return ranked, stat
    return None, "dead_fraction"


def _update_ratios(data: RunData) -> list[tuple[str, float]] | None:
    ratios = {t.split("/", 1)[1]: v for t, v in _last_values(data, "update_ratio", ("dynamics",), True).items()}
    if not ratios:
        updates = _last_values(data, "l2", ("updates",), True)
        weights = _last_values(data, "l2", ("weights", "biases"), True)
        for tensor, update in updates.items():
            param = tensor.split("/", 1)[1]
            weight = weights.get(f"weights/{param}", weights.get(f"biases/{param}"))
            if weight is not None and weight > 0:
                ratios[param] = update / weight
    if not ratios:
        return None

    def distance(value: float) -> float:
        if not math.isfinite(value) or value <= 0:
            return math.inf
        return abs(math.log10(value / TYPICAL_UPDATE_RATIO))

    return sorted(ratios.items(), key=lambda kv: -distance(kv[1]))


def module_findings(health: Health, owner: Any) -> dict[str, list[Finding]]:
    """The findings of ``health`` by the module their tensor belongs to (``owner(tensor)`` says
    which; a finding without a tensor belongs to the root, ``""``)."""
    out: dict[str, list[Finding]] = {}
    for f in health.findings:
        out.setdefault(owner(f.tensor) if f.tensor else "", []).append(f)
    return out


def fmt(value: float) -> str:
    """A number for the summary: 3 significant digits, NaN/Inf by name."""
    if not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Inf" if value > 0 else "-Inf")
    return f"{value:.3g}"


def percent(value: float) -> str:
    return fmt(value) if not math.isfinite(value) else f"{100 * value:.0f} %" if value >= 0.01 or value == 0 else f"{100 * value:.2g} %"


__all__ = ["SEVERITY", "Health", "RuleHealth", "module_findings", "rules_reader", "run_health", "severity"]
