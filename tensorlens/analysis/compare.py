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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

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

__all__ = ["HISTOGRAM", "VALUE", "Comparison", "Difference", "Divergence", "compare_records", "compare_runs"]


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

    def summary(self, limit: int = 20) -> str:
        """A human-readable account, as ``tensorlens compare`` prints it."""
        return "\n".join(self.summary_lines(limit))

    def summary_lines(self, limit: int = 20) -> list[str]:
        """:meth:`summary` line by line: names come from the runs' stores as they are (the CLI
        escapes each line, so a name's own newline or control characters stay in its line)."""
        lines = [f"compared {self.steps_compared} steps of {self.a} (a) and {self.b} (b), rtol={self.rtol:g} atol={self.atol:g}"]
        if self.equal:
            lines.append("no difference")
            return lines
        if self.divergences:
            lines.append(f"{len(self.divergences)} statistics differ; first step of each:")
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


def _records_by_key(run: Run, mode: ModeKeys) -> Iterator[tuple[tuple[int, str], StepRecord]]:
    # within one mode the reader's order (step, mode step, worker) is the order of (mode step, worker)
    for record in run.records(mode=mode):
        yield (record.mode_step, record.worker), record


def compare_runs(a: str | Run, b: str | Run, rtol: float = 1e-6, atol: float = 0.0, *,
                 histograms: bool = True, tensors: bool = True,
                 on_record: Callable[[StepRecord], object] | None = None) -> Comparison:
    """Compare two stored runs step by step; see the module docstring.

    ``rtol``/``atol``: two values agree when ``|a - b| <= atol + rtol * max(|a|, |b|)``; NaN
    agrees with NaN. Histogram counts must agree exactly; their edges and raw tensors within
    tolerance. ``on_record`` is called with each record read, of either run (a progress bar).

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
    run_a = a if isinstance(a, Run) else open_run(str(a))
    run_b = b if isinstance(b, Run) else open_run(str(b))
    try:
        result = Comparison(str(run_a.path), str(run_b.path), float(rtol), float(atol))
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


def compare_command(a: str, b: str, rtol: float = 1e-6, atol: float = 0.0, echo: Callable[[str], object] = print) -> int:
    """``tensorlens compare A B``: print the comparison; exit code 0 when equal, 1 otherwise."""
    result = compare_runs(a, b, rtol=rtol, atol=atol)
    for line in result.summary_lines():
        echo(line)
    return 0 if result.equal else 1
