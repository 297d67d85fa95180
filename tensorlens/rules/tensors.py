"""Built-in rules on the values of any tensor: ExplodingTensor, AllZero, TensorVariance,
UnchangedTensor and SimilarAcrossRuns (SageMaker Debugger's names, parameters and defaults).

Each reads the statistics of the record, or the raw tensor where ``save_raw_tensor`` saved one
(then the result is SageMaker's, computed on the values). See docs/rules.md for what each reads
and how it differs from SageMaker's.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import numpy as np

from tensorlens._checks import expected
from tensorlens.findings import Finding
from tensorlens.record_diff import compare_records
from tensorlens.records import StepRecord
from tensorlens.rules.base import Rule
from tensorlens.rules.columns import columns, count
from tensorlens.rules.params import Selection, tensor_stats, to_bool, to_float, to_int
from tensorlens.store.reader import Run

#: Statistics that describe a tensor's shape rather than its values.
_STRUCTURAL = frozenset({"numel"})


def _selected(record: StepRecord, selection: Selection) -> Iterator[tuple[str, dict[str, float]]]:
    yield from tensor_stats(record, selection).items()


def _raw(record: StepRecord) -> dict[str, np.ndarray]:
    return {t.tensor: t.value for t in record.tensors}


def _require_selection(rule: str, collection_names: Any, tensor_regex: Any) -> None:
    if collection_names is None and tensor_regex is None:
        raise ValueError(
            f"Expected `collection_names` or `tensor_regex` to be given to {rule} (as SageMaker Debugger requires), "
            "but got neither; e.g. collection_names='weights' or tensor_regex='fc1'"
        )


class ExplodingTensor(Rule):
    """Fires for a tensor holding NaN (or, unless ``only_nan``, an infinity).

    Reads the ``nan_count`` and ``inf_count`` recorded for every tensor (and the value of plain
    scalars such as losses): exact, whatever else is configured.

    >>> R.ExplodingTensor(collection_names="gradients,losses", action="stop")   # doctest: +SKIP
    """

    needs = "no tensor it selects was recorded"

    def __init__(self, collection_names: Any = None, tensor_regex: Any = None, only_nan: Any = False, **kwargs: Any) -> None:
        self.collection_names, self.tensor_regex = collection_names, tensor_regex
        self.only_nan = to_bool("only_nan", only_nan)
        self._selection = Selection(collection_names, tensor_regex)
        super().__init__(**kwargs)

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        cols = columns(record)
        chosen = cols.mask(self._selection, self._selection.matches)
        if not chosen.any():
            return []
        self.mark_evaluated()
        plain, value = cols.has(""), cols.column(record, "")  # a plain scalar: the value itself
        nan = np.where(plain, np.isnan(value), cols.column(record, "nan_count", fill=0.0))
        inf = np.zeros_like(nan) if self.only_nan else np.where(plain, np.isinf(value), cols.column(record, "inf_count", fill=0.0))
        has_numel, numel = cols.has("numel"), cols.column(record, "numel")
        out = []
        for i in np.flatnonzero(chosen & ((nan != 0) | (inf != 0))).tolist():
            of = f" of {count(numel[i])} values" if has_numel[i] else ""
            out.append(self.finding(record, cols.tensors[i], f"{count(nan[i])} NaN and {count(inf[i])} Inf{of}", nan[i] + inf[i]))
        return out


class AllZero(Rule):
    """Fires for a tensor of which at least ``threshold`` percent of the values are zero.

    Exact from ``zero_fraction`` (recorded for activations by default; add it elsewhere with
    ``ReductionConfig(counts=["zero_fraction"])``) or a raw tensor. Without them the default
    ``threshold=100`` is still exact (all zero <=> ``l2 == 0``); a lower threshold then needs
    ``zero_fraction`` and says so once. Give ``collection_names`` or ``tensor_regex``.
    """

    def __init__(self, collection_names: Any = None, tensor_regex: Any = None, threshold: Any = 100.0, **kwargs: Any) -> None:
        _require_selection("AllZero", collection_names, tensor_regex)
        self.collection_names, self.tensor_regex = collection_names, tensor_regex
        self.threshold = to_float("threshold", threshold, minimum=0.0, maximum=100.0)
        self._selection = Selection(collection_names, tensor_regex)
        super().__init__(**kwargs)

    def _zero_percent(self, tensor: str, stats: dict[str, float], raw: np.ndarray | None) -> float | None:
        if raw is not None and raw.size:
            return 100.0 * float(np.count_nonzero(raw == 0)) / raw.size
        if "zero_fraction" in stats:
            return 100.0 * stats["zero_fraction"]
        if "" in stats:
            return 100.0 if stats[""] == 0 else 0.0
        norm = stats.get("l2", stats.get("abs_l2", stats.get("abs_max")))
        if norm is None and "min" in stats and "max" in stats:
            norm = max(abs(stats["min"]), abs(stats["max"]))
        if norm is not None and norm == 0 and not stats.get("nan_count"):
            return 100.0
        if norm is not None and self.threshold >= 100.0:
            return 0.0 if norm == norm else None  # not all zero (a NaN norm proves nothing)
        self.note(f"zero_fraction:{tensor.split('/', 1)[0]}",
                  f"threshold={self.threshold:g} needs the share of zeros of {tensor!r}: record it with "
                  "ReductionConfig(counts=['zero_fraction']) for its collection (only all-zero tensors are detected now)")
        return None

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        out, raw = [], _raw(record)
        for tensor, stats in _selected(record, self._selection):
            percent = self._zero_percent(tensor, stats, raw.get(tensor))
            if percent is not None and percent >= self.threshold and (stats.get("numel", 1) > 0 or "" in stats):
                out.append(self.finding(record, tensor, f"{percent:.4g}% of values are zero (threshold {self.threshold:g}%)", percent))
        return out


class TensorVariance(Rule):
    """Fires for a tensor whose variance is above ``max_threshold`` or below ``min_threshold``.

    Exact: ``variance``, else ``std**2`` (population variance, numpy's ``ddof=0``), else the raw
    tensor. Give ``collection_names`` or ``tensor_regex``, and at least one threshold.
    """

    def __init__(self, collection_names: Any = None, tensor_regex: Any = None, max_threshold: Any = None,
                 min_threshold: Any = None, **kwargs: Any) -> None:
        _require_selection("TensorVariance", collection_names, tensor_regex)
        self.collection_names, self.tensor_regex = collection_names, tensor_regex
        self.max_threshold = to_float("max_threshold", max_threshold, optional=True)
        self.min_threshold = to_float("min_threshold", min_threshold, optional=True)
        if self.max_threshold is None and self.min_threshold is None:
            raise expected("max_threshold or min_threshold", "set (TensorVariance checks nothing without one)", None)
        self._selection = Selection(collection_names, tensor_regex)
        super().__init__(**kwargs)

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        out, raw = [], _raw(record)
        for tensor, stats in _selected(record, self._selection):
            if "variance" in stats:
                variance = stats["variance"]
            elif "std" in stats:
                variance = stats["std"] ** 2
            elif tensor in raw and raw[tensor].size:
                variance = float(np.var(raw[tensor], dtype=np.float64))
            else:
                if "" not in stats:
                    self.note(f"variance:{tensor.split('/', 1)[0]}", f"reads std or variance of {tensor!r}, which is not recorded")
                continue
            if variance != variance:
                continue  # NaN: ExplodingTensor's business
            if self.max_threshold is not None and variance > self.max_threshold:
                out.append(self.finding(record, tensor, f"variance {variance:.6g} > max_threshold {self.max_threshold:g}", variance))
            elif self.min_threshold is not None and variance < self.min_threshold:
                out.append(self.finding(record, tensor, f"variance {variance:.6g} < min_threshold {self.min_threshold:g}", variance))
        return out


class UnchangedTensor(Rule):
    """Fires for a tensor that did not change over its last ``num_steps`` saved steps
    (``numpy.allclose`` with ``rtol``, ``atol``, ``equal_nan``).

    On the raw tensor when saved (SageMaker's check); otherwise on every statistic recorded for it
    (``min``, ``max``, ``mean``, ``std``, ``l2``, ...): an unchanged tensor always fires, and a
    changed one fires only if all its statistics stayed within tolerance. Steps are those at which
    the tensor was saved, not necessarily consecutive. Give ``collection_names`` or ``tensor_regex``.
    """

    def __init__(self, collection_names: Any = None, tensor_regex: Any = None, num_steps: Any = 3, rtol: Any = 1e-5,
                 atol: Any = 1e-8, equal_nan: Any = False, **kwargs: Any) -> None:
        _require_selection("UnchangedTensor", collection_names, tensor_regex)
        self.collection_names, self.tensor_regex = collection_names, tensor_regex
        self.num_steps = to_int("num_steps", num_steps, minimum=2)
        self.rtol = to_float("rtol", rtol, minimum=0.0)
        self.atol = to_float("atol", atol, minimum=0.0)
        self.equal_nan = to_bool("equal_nan", equal_nan)
        self._selection = Selection(collection_names, tensor_regex)
        super().__init__(**kwargs)

    def reset(self) -> None:
        self._history: dict[tuple[str, str, str], collections.deque[tuple[Any, np.ndarray]]] = {}

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        out, raw = [], _raw(record)
        for tensor, stats in _selected(record, self._selection):
            if tensor in raw:
                signature: Any = ("raw", raw[tensor].shape)
                values = np.asarray(raw[tensor], dtype=np.float64).ravel()
            else:
                names = tuple(sorted(s for s in stats if s not in _STRUCTURAL))
                if not names:
                    continue
                signature, values = names, np.array([stats[s] for s in names], dtype=np.float64)
            history = self._history.setdefault((record.worker, record.mode.value, tensor), collections.deque(maxlen=self.num_steps))
            if history and history[-1][0] != signature:
                history.clear()  # other statistics or another shape: not comparable
            history.append((signature, values))
            if len(history) == self.num_steps and all(
                np.allclose(previous, values, rtol=self.rtol, atol=self.atol, equal_nan=self.equal_nan) for _, previous in history
            ):
                what = "values" if tensor in raw else f"statistics ({', '.join(signature)})"
                out.append(self.finding(record, tensor, f"unchanged over its last {self.num_steps} saved steps ({what} allclose)"))
        return out


class SimilarAcrossRuns(Rule):
    """Fires for a tensor whose statistics differ from those of another run at the same step
    (same mode, mode step and worker); ``rtol``/``atol`` as in :func:`tensorlens.rules.compare_runs`.

    ``other_trials``: the other run's folder (SageMaker's name; a ``Run`` works too). Steps the
    other run did not save are skipped.

    >>> R.SimilarAcrossRuns(other_trials="tensorlens_runs/baseline", collection_names="losses")  # doctest: +SKIP
    """

    def __init__(self, other_trials: Any, collection_names: Any = None, tensor_regex: Any = None, rtol: Any = 1e-5,
                 atol: Any = 1e-8, **kwargs: Any) -> None:
        if isinstance(other_trials, (list, tuple)) and len(other_trials) == 1:
            other_trials = other_trials[0]
        if not isinstance(other_trials, (str, Run)) and not hasattr(other_trials, "__fspath__"):
            raise expected("other_trials", "the path of another run (or a tl.Run)", other_trials)
        self.other_trials = other_trials
        self.collection_names, self.tensor_regex = collection_names, tensor_regex
        self.rtol = to_float("rtol", rtol, minimum=0.0)
        self.atol = to_float("atol", atol, minimum=0.0)
        self._selection = Selection(collection_names, tensor_regex)
        self._other: Any = other_trials if isinstance(other_trials, Run) else None
        super().__init__(**kwargs)

    def reset(self) -> None:
        self._cursors: dict[tuple[str, str], Any] = {}
        self._pending: dict[tuple[str, str], StepRecord | None] = {}

    def finish(self) -> list[Finding]:
        """Close the other run if this rule opened it (it is opened again when needed)."""
        self.reset()
        if self._other is not None and not isinstance(self.other_trials, Run):
            self._other.close()
            self._other = None
        return []

    def _other_record(self, record: StepRecord) -> StepRecord | None:
        if self._other is None:
            self._other = Run(str(self.other_trials))
        key = (record.mode.value, record.worker)
        if key not in self._cursors:
            self._cursors[key] = iter(self._other.records(mode=record.mode, worker=record.worker))
            self._pending[key] = next(self._cursors[key], None)
        # both runs go up in mode step: walk the other run's records along, never back
        found = self._pending[key]
        while found is not None and found.mode_step < record.mode_step:
            found = next(self._cursors[key], None)
        self._pending[key] = found
        return found if found is not None and found.mode_step == record.mode_step else None

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        other = self._other_record(record)
        if other is None:
            return []
        differences, _, _ = compare_records(record, other, self.rtol, self.atol)
        out, seen = [], set()
        for d in differences:
            if d.tensor in seen or not self._selection.matches(d.tensor):
                continue
            seen.add(d.tensor)
            stat = f"{d.stat} " if d.stat else ""
            out.append(self.finding(record, d.tensor, f"{stat}differs from {self.other_trials}: {d.a!r} vs {d.b!r}", d.a))
        return out
