"""What changed first: ``tl.explain(run)`` names the tensors that left their own trailing behaviour
earliest and farthest before an event (the first loss spike, the first non-finite value, or a step
you name), ranked.

The method, in full (``docs/explain.md`` says the same with an example):

1. **Series.** Of the train records of one worker, each statistic of each tensor read over the
   saved steps: the sizes (:data:`~.departures.SIZE_STATISTICS`, and ``mean``/``max`` of
   per-sample norms) on a log scale, plain values (``summaries``, ``scalars``) as they are, and
   ``nan_count``, ``inf_count``, ``grad_nonfinite_count`` as "NaN/Inf from here". Losses are the
   event, not a cause; ``dynamics/global`` sums every parameter; neither is a candidate.
2. **Event.** With ``at_step``: that saved step (or the last one before it). Otherwise the first
   saved step where a loss (a plain ``losses/*`` value) is NaN/Inf or a NaN/Inf count is above 0
   (*non-finite*), or a loss spikes as the ``LossSpike`` rule defines it with its defaults: its
   robust z-score ``(x - m) / (1.4826 * MAD)`` against the ``window`` finite saved values before
   (at least :data:`LOSS_MIN_HISTORY`) passes ``threshold`` *and* ``x > LOSS_FACTOR * m``. A run
   with neither has no event and no cause.
3. **Trailing behaviour.** For a series ``x`` at a saved step ``i``: ``m`` the median and
   ``s = max(1.4826 * MAD, floor)`` the robust scale (MAD: the median absolute deviation from
   ``m``) of its finite values at the ``window`` saved steps before ``i``, at least
   :data:`~.departures.MIN_HISTORY` of them; ``floor`` is :data:`~.departures.SCALE_FLOOR` on the
   log scale (a factor 1.02) and ``SCALE_FLOOR * |m|`` for a plain value, so that a statistic that
   hardly moved (a weight's norm) does not turn a rounding-level change into a huge z. The robust
   z-score is ``z = (x_i - m) / s``. NaN/Inf, and a size fallen to exactly 0 from a trailing
   behaviour, are infinitely far.
4. **Onset.** The first saved step ``i`` among the ``lookback`` saved steps before the event (and
   the event's own) where ``|z| >= threshold`` (a NaN/Inf needs no trailing behaviour) and the
   series stays away until the event: ``|x_j - m| / s >= threshold / 2`` at every later saved step
   ``j`` up to the event, ``m`` and ``s`` frozen at ``i``. A blip that came back is not an onset.
5. **Where in a step.** Within one training step tensors are computed in an order: the weights the
   step starts from (``weights``, ``biases``, ``optimizer``), the forward pass (``inputs``,
   ``activations``, ``summaries``) module by module in the order they first ran, the backward pass
   (activation and input gradients in the order they arrived, then ``gradients``), then the update
   (``dynamics/<param>``, ``updates``). A tensor's *phase* in ``[0, 1)`` is its place in that order
   (:func:`~.departures.phase_of`): a NaN that entered at one module is seen there first.
6. **Score.** ``lead = (event + 1) - (onset + phase)``, in saved steps: how long before the end of
   the event's step the series left. ``score = min(|z| at the onset, Z_NONFINITE) * sqrt(lead)``:
   a jump twice as far counts as one four times as early; NaN/Inf counts as
   :data:`~.departures.Z_NONFINITE`.
   A tensor's cause is its statistic of highest score (its NaN count on a tie); causes are sorted
   by score. A slow drift passes the threshold by a little, a fault by far: the magnitude at the
   onset, not the distance reached later, keeps a drift that began early from outranking the jump.

>>> result = tl.explain("tensorlens_runs/exp1")           # doctest: +SKIP
>>> result.event                                          # doctest: +SKIP
Event(step=40, kind='non-finite', ...)
>>> result.causes[0].tensor, result.causes[0].onset_step  # doctest: +SKIP
('activations/fc3/sample_norm', 40)
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from tensorlens._checks import expected
from tensorlens.analysis.departures import (
    COUNT,
    MIN_HISTORY,
    NONFINITE_COUNTS,
    Z_NONFINITE,
    departures,
    forward_order,
    phase_of,
    series_kind,
)
from tensorlens.findings import Finding
from tensorlens.store.reader import Run, open_run
from tensorlens.store.validate import scalar_values

__all__ = ["Cause", "Event", "Explanation", "TrailingSteps", "attach_causes", "explain"]

#: A loss spike is also this many times the trailing median, and needs this many values before
#: it: the ``LossSpike`` rule's defaults, so that its finding and ``explain``'s event agree.
LOSS_FACTOR = 2.0
LOSS_MIN_HISTORY = 5


@dataclasses.dataclass(frozen=True)
class Event:
    """What happened at ``step``: ``kind`` is ``"non-finite"``, ``"loss spike"`` or ``"given"``
    (``at_step``). ``tensor``/``statistic``/``value`` show it (the loss and its value; the first
    tensor holding NaN/Inf and its count)."""

    step: int
    kind: str
    tensor: str | None = None
    statistic: str | None = None
    value: float | None = None
    detail: str = ""

    def __str__(self) -> str:
        what = f"step {self.step} (given)" if self.kind == "given" else f"{self.kind} at step {self.step}"
        return what + (f": {self.detail}" if self.detail else "")


@dataclasses.dataclass(frozen=True)
class Cause:
    """A tensor that left its trailing behaviour before the event: its ``statistic`` passed the
    threshold at ``onset_step`` and stayed away, ``deviation`` robust z-scores from its trailing
    median ``baseline`` to ``value`` there (``inf``: NaN/Inf, or a size fallen to 0). Higher
    ``score``: earlier and farther."""

    tensor: str
    statistic: str
    onset_step: int
    score: float
    deviation: float
    baseline: float
    value: float
    lead: float  # saved steps between the onset (with its phase in the step) and the end of the event's step

    def __str__(self) -> str:
        stat = f" {self.statistic}" if self.statistic else ""
        return f"{self.tensor}{stat} from step {self.onset_step}"


@dataclasses.dataclass
class Explanation:
    """What :func:`explain` found: the ``event`` (``None`` when there is none) and its ``causes``,
    best first. Iterating, indexing and ``len()`` go over the causes; ``message`` says in words."""

    run: str
    event: Event | None
    causes: list[Cause]
    message: str
    window: int
    threshold: float
    steps_read: int

    def __iter__(self) -> Iterator[Cause]:
        return iter(self.causes)

    def __len__(self) -> int:
        return len(self.causes)

    def __getitem__(self, index: int) -> Cause:
        return self.causes[index]

    def summary(self, top: int = 3) -> str:
        """One line: ``"first to move: gradients/fc3.weight l2 from step 40, ..."``."""
        if not self.causes:
            return self.message
        return "first to move: " + ", ".join(str(c) for c in self.causes[:top])


# ---------------------------------------------------------------------------------------- reading


class _Plan:
    """Where, in the rows of one stored layout, the values this module reads sit."""

    def __init__(self, names: Sequence[tuple[str, str]]) -> None:
        self.losses = [(i, t) for i, (t, s) in enumerate(names) if t.startswith("losses/") and s == ""]
        self.counts = [(i, t, s) for i, (t, s) in enumerate(names) if s in NONFINITE_COUNTS]
        kinds = [series_kind(t, s) for t, s in names]
        chosen = [i for i, kind in enumerate(kinds) if kind is not None]
        self.series = [names[i] for i in chosen]
        self.kinds = {names[i]: kinds[i] for i in chosen}
        self.positions = np.asarray(chosen, dtype=np.intp)
        self.count_at = np.asarray([i for i, _, _ in self.counts], dtype=np.intp)
        self.tensors = list(dict.fromkeys(t for t, _ in names))


def _pick_worker(run: Run, worker: str | None) -> str:
    workers = run.workers()
    if not workers:
        raise ValueError(f"the run {run.path!r} holds no saved step yet")
    if worker is not None:
        if worker not in workers:
            raise expected("worker", f"one of {workers}", worker)
        return worker
    return next((w for w in ("worker_0", "reduced") if w in workers), workers[0])


def _scalar_rows(
    run: Run, worker: str, end_step: int | None, last: int | None = None
) -> Iterator[tuple[int, _Plan, np.ndarray]]:
    """``(step, plan, values)`` of the train (else global) record of ``worker`` at each saved step up
    to ``end_step`` (inclusive; only the ``last`` steps with it): the scalars rows only, read one at
    a time (histograms and raw tensors are never read, and a long run is never held)."""
    plans: dict[tuple[str, int], _Plan] = {}
    chosen: dict[int, tuple[Any, ...]] = {}
    for k, f in enumerate(run._files):  # noqa: SLF001 - this module reads the store's rows as the reader does
        for s in f.steps().values():
            if s.mode in ("train", "global") and s.worker == worker and (end_step is None or s.step <= end_step):
                key = (s.mode != "train", s.mode_step, k)
                if s.step not in chosen or key < chosen[s.step][0]:
                    chosen[s.step] = (key, f, s)
    steps = sorted(chosen)
    for step in steps[-last:] if last else steps:
        _, f, s = chosen[step]
        for _, row in f.rows("scalars", [s]):
            layout = f.row_layout("scalars", row)
            plan = plans.get((f.path, row[3]))
            if plan is None:
                plan = plans[(f.path, row[3])] = _Plan(layout.names)
            yield step, plan, scalar_values(f.path, layout, row[4], s.where)


class _EventWatch:
    """The default event, seen step by step: the first non-finite value or loss spike."""

    def __init__(self, window: int, threshold: float) -> None:
        self.window, self.threshold = window, threshold
        self.losses: dict[str, collections.deque[float]] = {}

    def check(self, step: int, plan: _Plan, values: np.ndarray) -> Event | None:
        for i, tensor in plan.losses:
            if not math.isfinite(values[i]):
                return Event(step, "non-finite", tensor, "", float(values[i]), f"the loss {tensor} is {values[i]}")
        if plan.count_at.size:
            counts = values[plan.count_at]
            bad = np.flatnonzero((counts > 0) | np.isnan(counts))  # NaN: uncounted, the norm was not finite
            if bad.size:
                _, tensor, stat = plan.counts[int(bad[0])]
                return Event(
                    step,
                    "non-finite",
                    tensor,
                    stat,
                    float(counts[bad[0]]),
                    f"{len({plan.counts[int(b)][1] for b in bad})} tensor(s) hold NaN or Inf, "
                    f"first recorded: {tensor} ({stat} {counts[bad[0]]:g})",
                )
        for i, tensor in plan.losses:
            history = self.losses.setdefault(tensor, collections.deque(maxlen=self.window))
            value = float(values[i])
            if len(history) >= LOSS_MIN_HISTORY:
                median = statistics.median(history)
                scale = 1.4826 * statistics.median(abs(v - median) for v in history)
                z = (value - median) / scale if scale > 0 else (math.inf if value > median else 0.0)
                if z > self.threshold and value > LOSS_FACTOR * median:
                    return Event(
                        step,
                        "loss spike",
                        tensor,
                        "",
                        value,
                        f"{tensor} {value:.4g} is {z:.3g} robust standard deviations above the median {median:.4g} "
                        f"of the previous {len(history)} saved steps (> {self.threshold:g}, and > "
                        f"{LOSS_FACTOR:g} x the median)",
                    )
            history.append(value)
        return None


def _rank(
    steps: list[int],
    series: list[tuple[str, str]],
    kinds: np.ndarray,
    values: np.ndarray,
    present: np.ndarray,
    forward_order: dict[str, float],
    window: int,
    lookback: int,
    threshold: float,
) -> list[Cause]:
    onset, jump, baseline = departures(values, present, kinds, window, lookback, threshold)
    event = len(steps) - 1
    best: dict[str, Cause] = {}
    for k in np.flatnonzero(onset >= 0).tolist():
        tensor, stat = series[k]
        lead = (event + 1) - (int(onset[k]) + phase_of(tensor, forward_order))
        far = min(float(jump[k]), Z_NONFINITE)
        score = far * math.sqrt(lead)
        cause = Cause(
            tensor,
            stat,
            steps[int(onset[k])],
            score,
            float(jump[k]),
            float(baseline[k]),
            float(values[int(onset[k]), k]),
            lead,
        )
        if (
            tensor not in best or score > best[tensor].score or (score == best[tensor].score and kinds[k] == COUNT)
        ):  # "nan_count" says it better than "max"
            best[tensor] = cause
    return sorted(best.values(), key=lambda c: (-c.score, c.onset_step, c.tensor))


def explain(
    run: Run | str,
    at_step: int | None = None,
    top: int = 10,
    *,
    window: int = 20,
    threshold: float = 6.0,
    lookback: int | None = None,
    worker: str | None = None,
) -> Explanation:
    """What changed first before an event: the ``top`` tensors ranked by how early and how far they
    left their own trailing behaviour (the method: :mod:`tensorlens.analysis.explain`).

    The event is the first loss spike or non-finite value of ``run`` (a path or an open run), or
    the saved step ``at_step`` (the last saved step before it when it was not saved). ``window``
    saved steps make a statistic's trailing behaviour; ``threshold`` robust z-scores make an onset;
    onsets are looked for over ``lookback`` saved steps before the event (default: ``window``).
    A run with no event returns no cause, and says so in ``.message``.

    >>> result = explain("tensorlens_runs/exp1")          # doctest: +SKIP
    >>> [(c.tensor, c.statistic, c.onset_step) for c in result][:2]   # doctest: +SKIP
    [('weights/fc3.weight', 'l2', 40), ('activations/fc3/sample_norm', 'max', 40)]
    """
    for name, value, least in (("top", top, 1), ("window", window, MIN_HISTORY)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise expected(name, f"an integer >= {least}", value)
    if lookback is not None and (isinstance(lookback, bool) or not isinstance(lookback, int) or lookback < 0):
        raise expected("lookback", "None or an integer >= 0", lookback)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
        raise expected("threshold", "a number > 0", threshold)
    if at_step is not None and (isinstance(at_step, bool) or not isinstance(at_step, int)):
        raise expected("at_step", "None or a saved step (an integer)", at_step)
    lookback = window if lookback is None else lookback
    opened = not isinstance(run, Run)
    store = open_run(str(run)) if opened else run
    try:
        return _explain(store, at_step, top, window, float(threshold), lookback, _pick_worker(store, worker))
    finally:
        if opened:
            store.close()


def _explain(
    run: Run, at_step: int | None, top: int, window: int, threshold: float, lookback: int, worker: str
) -> Explanation:
    keep = window + lookback + 1
    recent: collections.deque[tuple[int, _Plan, np.ndarray]] = collections.deque(maxlen=keep)
    watch = _EventWatch(window, threshold)
    event: Event | None = None
    read, losses = 0, set()
    for step, plan, values in _scalar_rows(run, worker, at_step, keep if at_step is not None else None):
        read += 1
        recent.append((step, plan, values))
        losses.update(t for _, t in plan.losses)
        if at_step is None:
            event = watch.check(step, plan, values)
            if event is not None:
                break
    if at_step is not None:
        if not recent:
            raise ValueError(
                f"no saved step at or before step {at_step} in {run.path!r}; saved steps: {run.steps()[:3]}..."
            )
        event = Event(recent[-1][0], "given", detail=f"asked for step {at_step}" if recent[-1][0] != at_step else "")
    if event is None:
        what = (
            f"no loss spike and no NaN/Inf in {read} saved steps (losses read: {', '.join(sorted(losses))})"
            if losses
            else f"no NaN/Inf in {read} saved steps, and no loss was recorded to look for a spike in "
            "(tl.watch(model, loss_fn) or hook.register_loss records one)"
        )
        return Explanation(run.path, None, [], f"no event: {what}", window, threshold, read)
    return _explain_recent(run.path, list(recent), event, top, window, threshold, lookback, read)


def _explain_recent(
    path: str,
    recent: list[tuple[int, _Plan, np.ndarray]],
    event: Event,
    top: int,
    window: int,
    threshold: float,
    lookback: int,
    read: int,
) -> Explanation:
    """The causes of ``event`` (at the last of ``recent``, the saved steps before it and its own)."""
    steps = [s for s, _, _ in recent]
    plans = list({id(plan): plan for _, plan, _ in recent}.values())  # one per layout, usually one in all
    series = list(dict.fromkeys(name for plan in plans for name in plan.series))
    column = {name: i for i, name in enumerate(series)}
    kinds = np.zeros(len(series), dtype=np.intp)
    values = np.full((len(recent), len(series)), np.nan)
    present = np.zeros(values.shape, dtype=bool)
    columns = {id(plan): np.asarray([column[n] for n in plan.series], dtype=np.intp) for plan in plans}
    for plan in plans:
        kinds[columns[id(plan)]] = [plan.kinds[n] for n in plan.series]
    for row, (_, plan, found) in enumerate(recent):
        values[row, columns[id(plan)]] = found[plan.positions]
        present[row, columns[id(plan)]] = True
    causes = _rank(
        steps, series, kinds, values, present, forward_order(recent[-1][1].tensors), window, lookback, threshold
    )
    message = f"{event}; " + (
        f"{len(causes)} tensor(s) left their trailing behaviour before it"
        if causes
        else "no tensor left its trailing behaviour before it"
        + (
            f" (only {len(steps) - 1} saved step(s) before it: a trailing behaviour needs {MIN_HISTORY})"
            if len(steps) - 1 < MIN_HISTORY
            else ""
        )
    )
    return Explanation(path, event, causes[:top], message, window, threshold, read)


#: The rules whose findings mark an event worth explaining (:func:`attach_causes`).
EVENT_RULES = ("NonFiniteGradient", "GradientNormSpike", "LossSpike")
#: At most this many episodes of one rule are explained in one call (each reads ~2 windows of steps).
MAX_EPISODES = 20


def attach_causes(
    findings: Iterable[Finding], run: Run | str, top: int = 3, rules: Sequence[str] = EVENT_RULES
) -> list[Finding]:
    """``findings`` with the ``top`` causes appended to the message of each finding of ``rules``
    (``"...; first to move: gradients/fc3.weight l2 from step 40, ..."``); other findings, and
    "not evaluated" notes, unchanged.

    A rule that fires at consecutive saved steps (a NaN stays, so NonFiniteGradient fires at every
    step after it, on every gradient) makes one *episode*: it is explained once, at its first step
    (what moved before the event, not after it), and each of its findings carries those causes.
    Each rule's first :data:`MAX_EPISODES` episodes are explained; a finding already carrying
    causes is left as it is.

    >>> attach_causes(R.evaluate(run).findings, run)[0].message   # doctest: +SKIP
    '1 NaN and 0 Inf in the gradient (1024 values); first to move: activations/fc3/sample_norm nan_count from step 30, ...'
    """
    findings = list(findings)
    chosen = [
        f
        for f in findings
        if f.rule in rules and getattr(f, "evaluated", True) and "; first to move: " not in f.message
    ]
    if not chosen:
        return findings
    opened = not isinstance(run, Run)
    store = open_run(str(run)) if opened else run
    try:
        saved = store.steps()
        before = {step: saved[i - 1] for i, step in enumerate(saved) if i}  # the saved step before each
        start: dict[tuple[str, int], int] = {}  # (rule, step) -> the first step of its episode
        for rule in dict.fromkeys(f.rule for f in chosen):
            steps = sorted({f.step for f in chosen if f.rule == rule})
            fired = set(steps)
            for step in steps:
                start[(rule, step)] = (
                    start.get((rule, before.get(step, -1)), step) if before.get(step) in fired else step
                )
        said: dict[int, str] = {}
        for rule in dict.fromkeys(f.rule for f in chosen):
            for step in sorted({s for (r, s), first in start.items() if r == rule and s == first})[:MAX_EPISODES]:
                if step not in said:
                    found = explain(store, at_step=step, top=top)
                    said[step] = found.summary(top) if found.causes else ""
    finally:
        if opened:
            store.close()
    mine = {id(f) for f in chosen}
    out = []
    for f in findings:
        text = said.get(start[(f.rule, f.step)], "") if id(f) in mine else ""
        out.append(dataclasses.replace(f, message=f"{f.message}; {text}") if text else f)
    return out


class TrailingSteps:
    """The last saved train steps of a run in training, so that a rule firing online can say what
    moved first (:class:`~tensorlens.rules.online.RuleRunner` feeds it every saved train record and
    asks it when a rule of :data:`EVENT_RULES` fires): the same method as :func:`explain` with the
    firing step as the event, over at most ``window + lookback + 1`` steps held in memory (the
    records' own scalar arrays, not copies)."""

    def __init__(self, window: int = 20, threshold: float = 6.0, lookback: int | None = None) -> None:
        self.window, self.threshold = window, float(threshold)
        self.lookback = window if lookback is None else lookback
        self._recent: collections.deque[tuple[int, _Plan, np.ndarray]] = collections.deque(
            maxlen=self.window + self.lookback + 1
        )
        self._plans: dict[int, tuple[tuple[tuple[str, str], ...], _Plan]] = {}  # id(names) -> (names, plan)

    def add(self, step: int, names: tuple[tuple[str, str], ...], values: np.ndarray) -> None:
        """Keep one saved step's scalars (a record's ``scalar_names`` and ``scalar_values``)."""
        kept = self._plans.get(id(names))
        if kept is None or kept[0] is not names:  # records of one layout share their names tuple
            kept = self._plans[id(names)] = (names, _Plan(names))
            if len(self._plans) > 64:  # layouts that no longer come back
                self._plans = {id(names): kept}
        self._recent.append((step, kept[1], np.asarray(values, dtype=np.float64)))

    def previous_step(self) -> int | None:
        """The saved step before the last one kept, if any."""
        return self._recent[-2][0] if len(self._recent) > 1 else None

    def explain(self, top: int = 3, run: str = "") -> Explanation:
        """What moved first before the last step kept (the event)."""
        if not self._recent:
            return Explanation(run, None, [], "no saved step yet", self.window, self.threshold, 0)
        event = Event(self._recent[-1][0], "given", detail="a rule fired")
        recent = list(self._recent)
        return _explain_recent(run, recent, event, top, self.window, self.threshold, self.lookback, len(recent))
