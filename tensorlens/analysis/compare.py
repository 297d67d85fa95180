"""Run comparison: where two runs' statistics first differ, tensor by tensor and statistic by statistic.

Cerebras users diff two runs' tensors to find where a change (a kernel, a precision, a seed, a
refactor) first made a difference; :func:`compare_runs` does it over two stored runs, reading
them step by step (never whole). Records are paired by (mode, mode step, worker); for each tensor
and statistic the first paired step where the two values differ beyond tolerance is reported with
both values. Steps, tensors and statistics present in one run only are listed, so runs of
different lengths or configurations compare too. Two records are compared by
:mod:`tensorlens.record_diff` (``compare_records``, re-exported here), which the ``SimilarAcrossRuns``
rule uses too.

>>> result = compare_runs("runs/a", "runs/b", rtol=1e-6)      # doctest: +SKIP
>>> result.first_divergence                                     # doctest: +SKIP
Divergence(tensor='weights/fc1.weight', stat='l2', step=1, ...)

Two runs that differ at all differ almost everywhere (a changed learning rate moves every weight
and every gradient after one step), so the exhaustive list answers "is it the same?" and not "what
differs?". The **ranking** (:class:`DivergenceRanking`, ``Comparison.ranking``, the report's "What
differs" section and the top of ``tensorlens compare``) answers the second: tensors ranked by how
early and how far they diverge, not every bit difference:

- at each paired step, the *relative difference* of a statistic is
  ``d = |a - b| / (|a| + |b|)``: 0 when equal, 1/3 when one is twice the other, 1 when one is zero,
  of the other sign, or NaN/Inf where the other is finite (both NaN, or the same infinity: 0);
- its *onset* is the first paired step where ``d > tolerance`` (default 0.01: about 2 %);
- its *score* is ``sum(d from the onset on) / paired steps``, in [0, 1]: 1 for a statistic that is
  completely different from the first step to the last, 0.5 for one that is completely different
  over the second half only, 0.1 for a 20 % difference that lasts the whole run;
- a tensor is ranked by its statistic that diverges first (then with the higher score); tensors by
  onset, then score, then the order in which a training step computes them (weights and the
  optimizer's settings, inputs, activations in call order, losses, gradients, updates), so that
  what diverged first, and most, and upstream, comes first. Only statistics that measure a size or
  a count are ranked (``l2``, ``std``, ``dead_fraction``, ``update_ratio``, NaN counts, a loss's
  value, ...): signed ones (``mean``, ``min``, ``max``, quantiles, cosines) cross zero, where a tiny
  change is a large relative difference.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tensorlens._checks import expected
from tensorlens.modes import ModeKeys
from tensorlens.record_diff import (
    HISTOGRAM,
    VALUE,
    Alignment,
    Difference,
    Reported,
    alignment,
    compare_aligned,
    compare_records,
)
from tensorlens.records import StepRecord
from tensorlens.store.reader import Run, StepKey, open_run

__all__ = ["HISTOGRAM", "VALUE", "Comparison", "Difference", "Divergence", "DivergenceRanking", "Divergent",
           "compare_records", "compare_runs", "rank_runs", "relative_difference"]


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first step at which ``stat`` of ``tensor`` differs between the two runs."""

    tensor: str
    stat: str
    step: int  # run a's global step at that record
    mode: ModeKeys
    mode_step: int
    worker: str
    a: float
    b: float
    index: int | None = None

    def __str__(self) -> str:
        key = f"{self.tensor}/{self.stat}" if self.stat else self.tensor
        where = f"[{self.index}]" if self.index is not None else ""
        mode = "" if self.mode == ModeKeys.TRAIN else f" ({self.mode.value} step {self.mode_step})"
        return f"{key}{where}: step {self.step}{mode}: a={self.a!r} b={self.b!r}"


#: A statistic is ranked unless it is one of these: signed ones cross zero, where a tiny change is a
#: large relative difference; ``numel`` is the tensor's shape, not its state.
UNRANKED_STATS = frozenset({"mean", "min", "max", "median", "sum", "prod", "numel", "histogram_edges", HISTOGRAM, VALUE})
_SIGNED = re.compile(r"^p\d+(\.\d+)?$|cosine")
#: The order in which a training step computes a collection's tensors: the tie-break of the ranking
#: (what a step starts from, then the forward, the loss, the backward, the update).
STEP_ORDER = ("weights", "biases", "optimizer", "inputs", "activations", "losses", "scalars", "summaries",
              "activation_gradients", "input_gradients", "gradients", "dynamics", "updates", "optimizer_state")


#: The statistic a tensor is shown by when several diverge as early and as far (the others in record order).
_PREFERRED = ("", "l2", "nan_count", "inf_count", "dead_fraction", "update_ratio", "std")


def step_order(tensor: str) -> int:
    """Where in a training step the collection of ``tensor`` is computed (:data:`STEP_ORDER`;
    collections not listed come last)."""
    collection = tensor.split("/", 1)[0]
    return STEP_ORDER.index(collection) if collection in STEP_ORDER else len(STEP_ORDER)


def ranked_statistic(stat: str) -> bool:
    """Whether the ranking reads ``stat`` (see :data:`UNRANKED_STATS`)."""
    return stat not in UNRANKED_STATS and not _SIGNED.search(stat)


def relative_difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``|a - b| / (|a| + |b|)`` element-wise, in [0, 1]: 0 when equal (both NaN, the same
    infinity, both zero), 1 when one is zero and the other not, of the other sign, or non-finite
    where the other is finite (see the module docstring).

    >>> relative_difference(np.array([1.0, 2.0, 0.0, np.nan, np.nan]), np.array([1.0, 1.0, 3.0, 2.0, np.nan])).round(3).tolist()
    [0.0, 0.333, 1.0, 1.0, 0.0]
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        d = np.abs(a - b) / (np.abs(a) + np.abs(b))
    finite = np.isfinite(a) & np.isfinite(b)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    return np.where(same, 0.0, np.where(finite, np.nan_to_num(d, nan=0.0), 1.0))


@dataclasses.dataclass(frozen=True)
class Divergent:
    """One tensor of the ranking: its statistic ``stat`` first differed by more than the tolerance at
    global step ``step`` (``a`` and ``b`` the two values there); ``score`` in [0, 1] says how far and
    how long (see the module docstring), ``peak`` the largest relative difference, ``paired`` over how
    many paired steps."""

    tensor: str
    stat: str
    mode: ModeKeys
    step: int
    mode_step: int
    a: float
    b: float
    score: float
    peak: float
    paired: int

    @property
    def key(self) -> str:
        return f"{self.tensor}/{self.stat}" if self.stat else self.tensor

    def __str__(self) -> str:
        mode = "" if self.mode == ModeKeys.TRAIN else f" ({self.mode.value} step {self.mode_step})"
        return f"{self.key}: from step {self.step}{mode}, score {self.score:.3f}: a={self.a:.6g} b={self.b:.6g}"


class DivergenceRanking:
    """Tensors ranked by how early and how far two runs diverge (see the module docstring), from
    pairs of records fed one at a time: ``add(a, b)`` for records of the same step, then
    :meth:`ranked`. Holds a few numbers per statistic, never the records.

    >>> ranking = DivergenceRanking(tolerance=0.01)
    >>> for a, b in paired_records: ranking.add(a, b)       # doctest: +SKIP
    >>> ranking.ranked(top=20)[0].tensor                      # doctest: +SKIP
    'weights/fc2.weight'
    """

    def __init__(self, tolerance: float = 0.01) -> None:
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
            raise expected("tolerance", "a number in [0, 1)", tolerance)
        self.tolerance = float(tolerance)
        self.keys: dict[tuple[str, str, ModeKeys], int] = {}
        self._positions: dict[tuple[int, ModeKeys], tuple[Alignment, np.ndarray, np.ndarray]] = {}
        self._size = 0
        self.onset = np.zeros(0, dtype=np.int64)  # global step of the onset; -1 before it
        self.onset_mode_step = np.zeros(0, dtype=np.int64)
        self.at_onset = np.zeros((0, 2))
        self.total = np.zeros(0)  # sum of d from the onset on
        self.peak = np.zeros(0)
        self.paired = np.zeros(0, dtype=np.int64)

    def _grow(self, size: int) -> None:
        if size <= len(self.onset):
            return
        n = max(size, 2 * len(self.onset), 64)
        pad = n - len(self.onset)
        self.onset = np.concatenate([self.onset, np.full(pad, -1, dtype=np.int64)])
        self.onset_mode_step = np.concatenate([self.onset_mode_step, np.zeros(pad, dtype=np.int64)])
        self.at_onset = np.concatenate([self.at_onset, np.zeros((pad, 2))])
        self.total = np.concatenate([self.total, np.zeros(pad)])
        self.peak = np.concatenate([self.peak, np.zeros(pad)])
        self.paired = np.concatenate([self.paired, np.zeros(pad, dtype=np.int64)])

    def _where(self, a: StepRecord, b: StepRecord, mode: ModeKeys) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(positions in a, positions in b, slots)`` of the ranked statistics both records hold."""
        aligned = alignment(a, b, histograms=False)
        found = self._positions.get((id(aligned), mode))
        if found is None or found[0] is not aligned:
            kept = [k for k, (_, stat) in enumerate(aligned.scalar_names) if ranked_statistic(stat)]
            slots = []
            for k in kept:
                tensor, stat = aligned.scalar_names[k]
                slots.append(self.keys.setdefault((tensor, stat, mode), len(self.keys)))
            self._grow(len(self.keys))
            found = (aligned, aligned.scalar_a[kept], aligned.scalar_b[kept], np.asarray(slots, dtype=np.intp))
            self._positions[(id(aligned), mode)] = found  # type: ignore[assignment]
        return found[1], found[2], found[3]  # type: ignore[misc]

    def add(self, a: StepRecord, b: StepRecord) -> None:
        """Account one pair of records of the same (mode, mode step, worker); ``a``'s global step
        is the step reported. The train and global modes are ranked together."""
        mode = ModeKeys.TRAIN if a.mode in (ModeKeys.TRAIN, ModeKeys.GLOBAL) else a.mode
        at_a, at_b, slots = self._where(a, b, mode)
        if not len(slots):
            return
        va, vb = a.scalar_values[at_a], b.scalar_values[at_b]
        d = relative_difference(va, vb)
        fresh = (self.onset[slots] < 0) & (d > self.tolerance)
        started = slots[fresh]
        self.onset[started] = a.step
        self.onset_mode_step[started] = a.mode_step
        self.at_onset[started, 0] = va[fresh]
        self.at_onset[started, 1] = vb[fresh]
        self.total[slots] += np.where(self.onset[slots] >= 0, d, 0.0)
        self.peak[slots] = np.maximum(self.peak[slots], d)
        self.paired[slots] += 1

    def ranked(self, top: int | None = 20) -> list[Divergent]:
        """The diverging tensors, most telling first (see the module docstring): each tensor once,
        by its statistic that diverged first (then with the higher score); ``top=None`` for all."""
        best: dict[tuple[str, ModeKeys], tuple[tuple[Any, ...], Divergent]] = {}
        for (tensor, stat, mode), i in self.keys.items():
            if self.onset[i] < 0:
                continue
            score = float(self.total[i] / max(int(self.paired[i]), 1))
            found = Divergent(tensor, stat, mode, int(self.onset[i]), int(self.onset_mode_step[i]),
                              float(self.at_onset[i, 0]), float(self.at_onset[i, 1]), score, float(self.peak[i]),
                              int(self.paired[i]))
            order = step_order(tensor)
            preferred = _PREFERRED.index(stat) if stat in _PREFERRED else len(_PREFERRED)
            key = (list(ModeKeys).index(mode), found.step, -round(score, 9), order, preferred, i)
            held = best.get((tensor, mode))
            if held is None or key < held[0]:
                best[(tensor, mode)] = (key, found)
        ordered = [found for _, found in sorted(best.values(), key=lambda kv: kv[0])]
        return ordered if top is None else ordered[:top]

    @property
    def diverging(self) -> int:
        """How many tensors diverge beyond the tolerance (each mode counted apart)."""
        return len({(t, m) for (t, _, m), i in self.keys.items() if self.onset[i] >= 0})


@dataclasses.dataclass
class Comparison:
    """What :func:`compare_runs` found. ``equal`` is True when nothing differs and nothing is one-sided."""

    a: str
    b: str
    rtol: float
    atol: float
    divergences: list[Divergence] = dataclasses.field(default_factory=list)
    steps_compared: int = 0
    steps_only_in_a: list[StepKey] = dataclasses.field(default_factory=list)
    steps_only_in_b: list[StepKey] = dataclasses.field(default_factory=list)
    tensors_only_in_a: list[str] = dataclasses.field(default_factory=list)
    tensors_only_in_b: list[str] = dataclasses.field(default_factory=list)
    stats_only_in_a: list[str] = dataclasses.field(default_factory=list)  # "tensor/stat" of tensors in both
    stats_only_in_b: list[str] = dataclasses.field(default_factory=list)
    tolerance: float = 0.01
    ranking: list[Divergent] = dataclasses.field(default_factory=list)  # the top of DivergenceRanking.ranked()
    diverging: int = 0  # tensors that diverge beyond the tolerance (ranked or not)

    @property
    def equal(self) -> bool:
        return not (self.divergences or self.steps_only_in_a or self.steps_only_in_b or self.tensors_only_in_a
                    or self.tensors_only_in_b or self.stats_only_in_a or self.stats_only_in_b)

    @property
    def first_divergence(self) -> Divergence | None:
        return min(self.divergences, key=lambda d: (d.step, list(ModeKeys).index(d.mode), d.mode_step), default=None)

    def divergence(self, tensor: str, stat: str = "", mode: ModeKeys | str = ModeKeys.TRAIN) -> Divergence | None:
        """The first divergence of one statistic of one tensor in one mode, or ``None``."""
        mode = ModeKeys.coerce(mode)
        return next((d for d in self.divergences if (d.tensor, d.stat, d.mode) == (tensor, stat, mode)), None)

    def summary(self, limit: int = 20, every: bool = False) -> str:
        """A human-readable account, as ``tensorlens compare`` prints it."""
        return "\n".join(self.summary_lines(limit, every))

    def summary_lines(self, limit: int = 20, every: bool = False) -> list[str]:
        """:meth:`summary` line by line: the ranking (at most ``limit`` tensors), then how many
        statistics differ at all, listed (first step of each, at most ``limit``) with ``every``.
        Names come from the runs' stores as they are (the CLI escapes each line, so a name's own
        newline or control characters stay in its line)."""
        lines = [f"compared {self.steps_compared} steps of {self.a} (a) and {self.b} (b), rtol={self.rtol:g} atol={self.atol:g}"]
        if self.equal:
            lines.append("no difference")
            return lines
        if self.ranking:
            lines.append(f"what differs: {self.diverging} tensors diverge by more than {self.tolerance:.2%} (relative "
                         f"difference |a-b|/(|a|+|b|)); the first {min(limit, len(self.ranking))} by first step, then score:")
            lines += ranking_table(self.ranking[:limit])
        elif self.divergences:
            lines.append(f"what differs: no tensor diverges by more than {self.tolerance:.2%} (relative difference "
                         "|a-b|/(|a|+|b|)); the differences are smaller")
        if self.divergences:
            if not every:
                lines.append(f"{len(self.divergences)} statistics differ beyond rtol={self.rtol:g} atol={self.atol:g} "
                             "(--all lists the first step of each)")
            else:
                lines.append(f"{len(self.divergences)} statistics differ beyond rtol={self.rtol:g} atol={self.atol:g}; "
                             "first step of each:")
                ordered = sorted(self.divergences, key=lambda d: (d.step, d.tensor, d.stat))
                lines += [f"  {d}" for d in ordered[:limit]]
                if len(ordered) > limit:
                    lines.append(f"  ... and {len(ordered) - limit} more")
        for label, items in (("steps only in a", self.steps_only_in_a), ("steps only in b", self.steps_only_in_b)):
            if items:
                shown = ", ".join(f"{k.mode.value} {k.mode_step}" for k in items[:limit])
                lines.append(f"{label} ({len(items)}): {shown}{' ...' if len(items) > limit else ''}")
        for label, items in (("tensors only in a", self.tensors_only_in_a), ("tensors only in b", self.tensors_only_in_b),
                             ("statistics only in a", self.stats_only_in_a), ("statistics only in b", self.stats_only_in_b)):
            if items:
                lines.append(f"{label} ({len(items)}): {', '.join(items[:limit])}{' ...' if len(items) > limit else ''}")
        return lines


def ranking_table(ranking: list[Divergent]) -> list[str]:
    """The ranking as aligned text lines (``tensorlens compare``)."""
    rows = [("#", "tensor", "statistic", "from step", "score", "a", "b")]
    for i, d in enumerate(ranking, 1):
        step = str(d.step) + ("" if d.mode == ModeKeys.TRAIN else f" ({d.mode.value} {d.mode_step})")
        rows.append((str(i), d.tensor, d.stat or "value", step, f"{d.score:.3f}", f"{d.a:.4g}", f"{d.b:.4g}"))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def _records_by_key(run: Run, mode: ModeKeys) -> Iterator[tuple[tuple[int, str], StepRecord]]:
    # within one mode the reader's order (step, mode step, worker) is the order of (mode step, worker)
    for record in run.records(mode=mode):
        yield (record.mode_step, record.worker), record


def compare_runs(a: str | Run, b: str | Run, rtol: float = 1e-6, atol: float = 0.0, *,
                 histograms: bool = True, tensors: bool = True, tolerance: float = 0.01, top: int = 20,
                 on_record: Callable[[StepRecord], object] | None = None) -> Comparison:
    """Compare two stored runs step by step; see the module docstring.

    ``rtol``/``atol``: two values agree when ``|a - b| <= atol + rtol * max(|a|, |b|)``; NaN
    agrees with NaN. Histogram counts must agree exactly; their edges and raw tensors within
    tolerance. ``on_record`` is called with each record read, of either run (a progress bar).

    ``ranking`` holds the ``top`` tensors that diverge by more than ``tolerance`` (a relative
    difference ``|a-b|/(|a|+|b|)``), ranked by how early and how far (see the module docstring).

    The runs are read one record at a time, never whole; each pair of records is compared with
    numpy over its whole arrays (:mod:`tensorlens.record_diff`), so the time grows with the
    data read and not with Python work per tensor.

    >>> tl.compare_runs("runs/seed0", "runs/seed0-again").equal          # doctest: +SKIP
    True
    >>> print(tl.compare_runs("runs/lr1e-3", "runs/lr1e-2").summary())     # doctest: +SKIP
    """
    for name, value in (("rtol", rtol), ("atol", atol)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise expected(name, "a number >= 0", value)
    ranking = DivergenceRanking(tolerance)
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise expected("top", "an integer >= 1", top)
    run_a = a if isinstance(a, Run) else open_run(str(a))
    run_b = b if isinstance(b, Run) else open_run(str(b))
    try:
        result = Comparison(str(run_a.path), str(run_b.path), float(rtol), float(atol), tolerance=ranking.tolerance)
        first: dict[tuple[str, str, ModeKeys, str], Divergence] = {}
        one_sided_a: set[tuple[str, str]] = set()
        one_sided_b: set[tuple[str, str]] = set()
        held: list[Alignment] = []
        reported: dict[tuple[ModeKeys, str, int], Reported] = {}
        advance = on_record or (lambda record: None)
        for mode in sorted(set(run_a.modes()) | set(run_b.modes()), key=list(ModeKeys).index):
            left, right = _records_by_key(run_a, mode), _records_by_key(run_b, mode)
            x, y = next(left, None), next(right, None)
            while x is not None or y is not None:
                if y is None or (x is not None and x[0] < y[0]):
                    result.steps_only_in_a.append(StepKey(mode, x[0][0], x[0][1], x[1].step))
                    advance(x[1])
                    x = next(left, None)
                    continue
                if x is None or y[0] < x[0]:
                    result.steps_only_in_b.append(StepKey(mode, y[0][0], y[0][1], y[1].step))
                    advance(y[1])
                    y = next(right, None)
                    continue
                ra, rb = x[1], y[1]
                result.steps_compared += 1
                aligned = alignment(ra, rb, histograms)
                key = (mode, ra.worker, id(aligned))
                seen = reported.get(key)
                if seen is None:  # new layouts: their one-sided names, once
                    seen = reported[key] = Reported(aligned)
                    one_sided_a |= aligned.only_a
                    one_sided_b |= aligned.only_b
                    held.append(aligned)  # its id stays its own while the comparison runs
                diffs, only_a, only_b = compare_aligned(aligned, ra, rb, rtol, atol, tensors, seen)
                ranking.add(ra, rb)
                if ra.tensors or rb.tensors:
                    one_sided_a |= only_a
                    one_sided_b |= only_b
                for d in diffs:
                    first.setdefault((d.tensor, d.stat, mode, ra.worker),
                                     Divergence(d.tensor, d.stat, ra.step, mode, ra.mode_step, ra.worker, d.a, d.b, d.index))
                advance(ra)
                advance(rb)
                del x, y, ra, rb  # one pair of records at a time
                x, y = next(left, None), next(right, None)
        result.ranking, result.diverging = ranking.ranked(top), ranking.diverging
        result.divergences = sorted(first.values(), key=lambda d: (d.step, list(ModeKeys).index(d.mode), d.mode_step, d.tensor, d.stat))
        names_a, names_b = set(run_a.tensor_names()), set(run_b.tensor_names())
        result.tensors_only_in_a = sorted(names_a - names_b)
        result.tensors_only_in_b = sorted(names_b - names_a)
        result.stats_only_in_a = sorted(f"{t}/{s}" if s else t for t, s in one_sided_a if t in names_b)
        result.stats_only_in_b = sorted(f"{t}/{s}" if s else t for t, s in one_sided_b if t in names_a)
        return result
    finally:
        if not isinstance(a, Run):
            run_a.close()
        if not isinstance(b, Run):
            run_b.close()


def paired_records(a: Run, b: Run, mode: ModeKeys | str | None = None,
                   worker: str | None = None) -> Iterator[tuple[StepRecord, StepRecord]]:
    """The records of ``a`` and ``b`` with the same (mode, mode step, worker), one pair at a time,
    of one ``mode`` (default: every mode) and one ``worker`` (default: every worker)."""
    modes = [ModeKeys.coerce(mode)] if mode is not None else sorted(set(a.modes()) | set(b.modes()), key=list(ModeKeys).index)
    for m in modes:
        left = ((k, r) for k, r in _records_by_key(a, m) if worker is None or r.worker == worker)
        right = ((k, r) for k, r in _records_by_key(b, m) if worker is None or r.worker == worker)
        x, y = next(left, None), next(right, None)
        while x is not None and y is not None:
            if x[0] < y[0]:
                x = next(left, None)
            elif y[0] < x[0]:
                y = next(right, None)
            else:
                yield x[1], y[1]
                x, y = next(left, None), next(right, None)


def rank_runs(a: str | Run, b: str | Run, tolerance: float = 0.01, top: int | None = 20, *,
              mode: ModeKeys | str | None = None, worker: str | None = None) -> list[Divergent]:
    """The tensors of two stored runs ranked by how early and how far they diverge (see the module
    docstring); what ``tensorlens compare`` prints first and the report's "What differs" section
    shows. Reads the runs once, a pair of records at a time.

    >>> tl.analysis.compare.rank_runs("runs/healthy", "runs/collapsed")[0].tensor      # doctest: +SKIP
    'activations/3'
    """
    ranking = DivergenceRanking(tolerance)
    run_a = a if isinstance(a, Run) else open_run(str(a))
    run_b = b if isinstance(b, Run) else open_run(str(b))
    try:
        for ra, rb in paired_records(run_a, run_b, mode, worker):
            ranking.add(ra, rb)
    finally:
        if not isinstance(a, Run):
            run_a.close()
        if not isinstance(b, Run):
            run_b.close()
    return ranking.ranked(top)


def compare_command(a: str, b: str, rtol: float = 1e-6, atol: float = 0.0, echo: Callable[[str], object] = print,
                    tolerance: float = 0.01, limit: int = 20, every: bool = False) -> int:
    """``tensorlens compare A B``: print the comparison; exit code 0 when equal, 1 otherwise."""
    result = compare_runs(a, b, rtol=rtol, atol=atol, tolerance=tolerance, top=limit)
    for line in result.summary_lines(limit, every):
        echo(line)
    return 0 if result.equal else 1
