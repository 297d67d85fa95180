"""The sections a report opens with: each run's health (:mod:`.health`) and, for several runs, what
differs between them (:class:`~tensorlens.analysis.compare.DivergenceRanking`, the ranking
``tensorlens compare`` prints).

What differs: every run after the first is compared with the first (the reference). The ranking
reads the records the report keeps; when a run has more saved steps than the report keeps, the two
runs are read again from their stores, so the ranking is the one ``tensorlens compare`` prints (for
the train records of the worker shown). A heatmap shows the relative difference
``|a - b| / (|a| + |b|)`` of the ranked statistics over the steps, on one scale from 0 to 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tensorlens.analysis.compare import DivergenceRanking, Divergent, rank_runs, relative_difference
from tensorlens.reports.blocks import RUN_COLORS, Card, Cards, Chart, Group, Note, Section, Table, layer_heatmap_spec
from tensorlens.reports.data import RunData
from tensorlens.reports.health import WORST, Health, fmt, percent, run_health
from tensorlens.reports.page import matrix

#: The sign of a severity, in the health cards and the explorer's tree alike.
MARKS = {"critical": "\u2716", "warning": "\u25b2"}
#: Tensors a health line names at most before "+N more".
NAMED = 3
#: Tensors the "what differs" section ranks per pair of runs.
TOP = 20
#: The relative difference beyond which a tensor diverges (as ``tensorlens compare --tolerance``).
TOLERANCE = 0.01


def _names(names: Sequence[str], limit: int = NAMED) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" +{len(names) - limit} more" if len(names) > limit else "")


def health_card(health: Health, data: RunData, color: str, rules_listed: bool = False) -> Card:
    """One run's health as a card (see :mod:`.health` for what each line means); with
    ``rules_listed`` the section names the rules (every run was checked by the same ones)."""
    counts = health.counts()
    if health.status == "healthy":
        badge = "healthy: no rule fired"
    else:
        badge = " · ".join(f"{n} {s}" for s, n in counts.items() if n) + (" finding" if len(health.findings) == 1
                                                                            else " findings")
    facts: list[tuple[str, str]] = []
    if health.rules:
        names = "listed above" if rules_listed else ", ".join(health.rules)
        facts.append(("rules", f"{len(health.rules)} evaluated on the store ({names})"))
    for error in health.errors:
        facts.append(("rule note", error))
    if health.first_nonfinite is not None:
        step, tensors = health.first_nonfinite
        facts.append(("first NaN/Inf", f"step {step}: {_names(tensors)}"))
    elif health.nonfinite_recorded:
        facts.append(("first NaN/Inf", f"none in {len(data.steps)} saved steps"))
    else:
        facts.append(("first NaN/Inf", "not recorded (no nan_count/inf_count)"))
    if health.explanation is not None:
        causes = ", ".join(str(c) for c in health.explanation.causes[:WORST]) or "no tensor left its trailing behaviour"
        facts.append(("what changed first", f"{causes} (tl.explain; the event: {health.explanation.event})"))
    last = data.steps[-1] if data.steps else None
    if health.dead is None:
        facts.append(("dead units", "not recorded: tl.watch(model, dynamics=True) records dead_fraction"))
    else:
        label = "dead units" if health.dead_statistic == "dead_fraction" else "zero activations"
        finite = [(t, v) for t, v in health.dead if math.isfinite(v)]
        shown = [f"{t} {percent(v)}" for t, v in finite[:WORST] if v > 0]
        what = f"{health.dead_statistic} at step {last}"
        if health.dead_statistic != "dead_fraction":  # zeros of single values, not units dead for a whole batch
            what += "; dead units need tl.watch(model, dynamics=True)"
        text = f"{', '.join(shown)} ({what})" if shown else f"none ({what} is 0 everywhere)"
        broken = len(health.dead) - len(finite)
        if broken == len(health.dead):
            text = f"not counted: all {broken} layers hold NaN/Inf at step {last}"
        elif broken:
            text += f"; {broken} of {len(health.dead)} layers hold NaN/Inf there, not counted"
        facts.append((label, text))
    if health.update_ratios is None:
        facts.append(("update ratio", "not recorded: tl.watch(model, dynamics=True) records update_ratio"))
    else:
        shown = [f"{p} {fmt(v)}" for p, v in health.update_ratios[:WORST]]
        facts.append(("update ratio", f"{', '.join(shown)} (farthest from 1e-3 at step {last})"))
    for note in health.not_evaluated:
        facts.append(("not evaluated", f"{note.rule}: {note.message}"))
    blocks: list[Any] = []
    if health.fired:
        rows = [(f"{MARKS.get(r.severity, '')} {r.rule}", f"{len(r.findings)} from step {r.first.step}",
                 _names(r.tensors) or "-") for r in health.fired]
        blocks.append(Table(["rule (\u2716 critical, \u25b2 warning)", "findings", "tensors"], rows))
    return Card(health.run, health.status, badge, facts, blocks, color)


def health(runs: Sequence[RunData], options: Any) -> Section | None:
    found = [run_health(r) for r in runs]
    same = len(runs) > 1 and all(h.rules == found[0].rules for h in found) and bool(found[0].rules)
    cards = [health_card(h, r, RUN_COLORS[i % len(RUN_COLORS)], same) for i, (h, r) in enumerate(zip(found, runs, strict=True))]
    rules = f" ({', '.join(found[0].rules)})" if same else ""
    intro = (f"Each run checked by the default rules for what it recorded{rules}, evaluated on the store now, with "
             "what the rules stored while it trained: findings by severity (critical: NaN/Inf; every finding is in "
             "Rule findings below), the first step a tensor held NaN or Inf (tensors in the order a step computes "
             "them), the layers with the most dead units and the update ratios farthest from 1e-3 at the last step, "
             "and the rules that had nothing to read.")
    return Section("health", "Health", [Cards(cards)], intro=intro)


# ---------------------------------------------------------------------------- what differs


def _ranking(reference: RunData, other: RunData) -> tuple[list[Divergent], int]:
    """The ranking of ``other`` against ``reference`` and how many tensors diverge at all."""
    thinned = len(reference.column_records) < len(reference.steps) or len(other.column_records) < len(other.steps)
    if thinned:  # the kept steps are a sample: read the stores, as tensorlens compare does
        found = rank_runs(reference.run, other.run, TOLERANCE, None, mode="train", worker=reference.worker)
        return found[:TOP], len(found)
    ranking = DivergenceRanking(TOLERANCE)
    theirs = {r.step: r for r in other.column_records}
    for record in reference.column_records:
        paired = theirs.get(record.step)
        if paired is not None:
            ranking.add(record, paired)
    return ranking.ranked(TOP), ranking.diverging


def _difference_chart(reference: RunData, other: RunData, ranked: list[Divergent]) -> Chart | None:
    """The relative difference of each ranked statistic over the steps both runs kept."""
    theirs = {r.step: r for r in other.column_records}
    pairs = [(r, theirs[r.step]) for r in reference.column_records if r.step in theirs]
    if not pairs:
        return None
    labels = [f"{d.tensor} · {d.stat or 'value'}" for d in ranked]
    values = np.full((len(ranked), len(pairs)), np.nan)
    for j, (a, b) in enumerate(pairs):
        for i, d in enumerate(ranked):
            x, y = a.scalar(d.tensor, d.stat), b.scalar(d.tensor, d.stat)
            if x is not None and y is not None:
                values[i, j] = float(relative_difference(np.array([x]), np.array([y]))[0])
    title = f"relative difference |a-b|/(|a|+|b|): {other.name} against {reference.name}"
    spec = layer_heatmap_spec(title, "difference", len(ranked), False, (0.0, 1.0))
    return Chart(spec, {"values": matrix(labels, [a.step for a, _ in pairs], values, stat="relative difference")},
                 caption="0: the same; 1/3: one is twice the other; 1: one is zero, of the other sign, or NaN/Inf")


def differences(runs: Sequence[RunData], options: Any) -> Section | None:
    if len(runs) < 2:
        return None
    reference = runs[0]
    blocks: list[Any] = []
    for i, other in enumerate(runs[1:]):
        ranked, diverging = _ranking(reference, other)
        title = f"{other.name} against {reference.name}"
        if not ranked:
            blocks.append(Note(f"{title}: no tensor differs by more than {TOLERANCE:.0%} (relative difference) at any "
                               "step both runs saved."))
            continue
        rows = [(k, d.tensor, d.stat or "value", d.step, f"{d.score:.3f}", fmt(d.a), fmt(d.b))
                for k, d in enumerate(ranked, 1)]
        inner: list[Any] = [Table(["#", "tensor", "statistic", "from step", "score", reference.name, other.name], rows)]
        chart = _difference_chart(reference, other, ranked)
        if chart is not None:
            inner.append(chart)
        shown = f"{len(ranked)} of {diverging}" if diverging > len(ranked) else f"all {diverging}"
        blocks.append(Group(f"{title}: {shown} diverging tensors", inner, open=i < 2))
    intro = (f"Each run against the first ({reference.name}): the tensors that differ by more than {TOLERANCE:.0%} "
             "(relative difference |a-b|/(|a|+|b|)) at a step both saved, ranked by how early (the first such step) "
             "and then how far they diverge (score: the relative difference summed from that step on, over the "
             "steps compared; 1 is different everywhere), then in the order a step computes them. A tensor is "
             f"shown by its statistic that diverged first; at most {TOP} per run. `tensorlens compare A B` prints "
             "the same ranking.")
    return Section("differences", "What differs", blocks, intro=intro)
