"""SageMaker Debugger's ``Trial`` API over the tensorlens run store, readable while training writes.

Code written against ``smdebug.trials.create_trial`` runs with ``tl.create_trial``: the same
method names, arguments and exceptions. Every call reads the store as it is now, so a trial
follows a live run; the store records when its writer closed (``Run.ended``), so a step that
is not there yet raises :class:`StepNotYetAvailable` while training runs and :class:`NoMoreData`
once it has ended.

>>> trial = tl.create_trial("tensorlens_runs/exp1")                           # doctest: +SKIP
>>> trial.wait_for_steps([100], timeout=600)                                  # doctest: +SKIP
>>> trial.tensor("gradients/fc1.weight").reduction_value(100, "l2")           # doctest: +SKIP

Differences from SageMaker, because tensorlens counts steps differently: the global step is the
number of optimizer steps (an evaluation does not advance it), so several records (a train step
and the evaluation steps run before it) can share one global step. ``mode=modes.GLOBAL`` (the
default, as in SageMaker) means global steps across all modes; ``mode(step)`` and
``mode_step(step)`` answer for the train record of that step when there is one.
"""

from __future__ import annotations

import enum
import os
import re
import time
from collections.abc import Iterable
from typing import Any, NoReturn

import numpy as np

from tensorlens.modes import ModeKeys
from tensorlens.records import StepRecord
from tensorlens.rules.exceptions import (
    NoMoreData,
    StepNotYetAvailable,
    StepUnavailable,
    TensorUnavailable,
    TensorUnavailableForStep,
)
from tensorlens.store.reader import Run, StepKey
from tensorlens.store.schema import store_files

_TRAIN_LIKE = (ModeKeys.TRAIN, ModeKeys.GLOBAL)
_GLOBAL = ModeKeys.GLOBAL
_REDUCTIONS = {
    "min": np.min, "max": np.max, "mean": np.mean, "std": np.std, "variance": np.var, "sum": np.sum, "prod": np.prod,
    "median": np.median, "l1": lambda v: np.sum(np.abs(v)), "l2": lambda v: np.sqrt(np.sum(v * v)), "linf": lambda v: np.max(np.abs(v)),
}


class StepState(enum.Enum):
    """What :meth:`Trial.has_passed_step` answers (SageMaker's ``StepState``)."""

    UNAVAILABLE = 0  # not saved, and it never will be
    AVAILABLE = 1
    NOT_YET_AVAILABLE = 2  # training may still write it


def _global(mode: ModeKeys | str | None) -> bool:
    return mode is None or ModeKeys.coerce(mode) == _GLOBAL


class Trial:
    """A stored run seen through SageMaker Debugger's Trial API; create it with :func:`create_trial`."""

    def __init__(self, path: str | os.PathLike[str], name: str | None = None,
                 range_steps: tuple[int | None, int | None] | None = None) -> None:
        self.path = os.fspath(path)
        self.name = name or os.path.basename(os.path.normpath(self.path))
        if range_steps is not None and (not isinstance(range_steps, (tuple, list)) or len(range_steps) != 2):
            raise ValueError(f"Expected `range_steps` to be None or (start, end), but got {range_steps!r}")
        self.range_steps = tuple(range_steps) if range_steps is not None else (None, None)
        self._run: Run | None = None
        self._files: list[str] = []

    def __repr__(self) -> str:
        return f"Trial(name={self.name!r}, path={self.path!r})"

    # ------------------------------------------------------------------ the store, as it is now

    def _store(self) -> Run | None:
        """The run, (re)opened when a worker's file appeared; ``None`` before the first is written."""
        try:
            files = store_files(self.path) if os.path.exists(self.path) else []
        except OSError:
            files = []
        if files != self._files:
            if self._run is not None:
                self._run.close()
            self._run, self._files = (Run(self.path), files) if files else (None, [])
        return self._run

    def _keys(self) -> list[StepKey]:
        run = self._store()
        if run is None:
            return []
        start, end = self.range_steps
        return [k for k in run.step_keys() if (start is None or k.step >= start) and (end is None or k.step < end)]

    @property
    def ended(self) -> bool:
        """Whether training closed the run: no more steps will come."""
        run = self._store()
        return run is not None and run.ended

    def _records(self, step: int, mode: ModeKeys | str | None, worker: str | None = None) -> list[StepRecord]:
        """The records at a global step (``mode`` GLOBAL) or at a mode step, train-like first."""
        run = self._store()
        if run is None:
            return []
        if _global(mode):
            keys = [k for k in self._keys() if k.step == step and (worker is None or k.worker == worker)]
        else:
            mode = ModeKeys.coerce(mode)
            keys = [k for k in self._keys() if k.mode == mode and k.mode_step == step and (worker is None or k.worker == worker)]
        wanted = set(keys)
        out = []
        for s in sorted({k.step for k in keys}):
            out += [r for r in run.records(start_step=s, end_step=s + 1, worker=worker)
                    if StepKey(r.mode, r.mode_step, r.worker, r.step) in wanted]
        return sorted(out, key=lambda r: (r.mode not in _TRAIN_LIKE, list(ModeKeys).index(r.mode), r.mode_step))

    # ------------------------------------------------------------------ SageMaker's Trial API

    def steps(self, mode: ModeKeys | str | None = _GLOBAL, show_incomplete_steps: bool = False) -> list[int]:
        """Saved steps: global steps (``mode=GLOBAL``, the default) or the mode steps of ``mode``."""
        keys = self._keys()
        if _global(mode):
            return sorted({k.step for k in keys})
        mode = ModeKeys.coerce(mode)
        return sorted({k.mode_step for k in keys if k.mode == mode})

    def modes(self) -> list[ModeKeys]:
        return sorted({k.mode for k in self._keys()}, key=list(ModeKeys).index)

    def workers(self) -> list[str]:
        return sorted({k.worker for k in self._keys()})

    def mode(self, global_step: int) -> ModeKeys | None:
        """The mode of the record at ``global_step`` (its train record when there is one)."""
        found = self._first_at(global_step)
        return found.mode if found is not None else None

    def mode_step(self, global_step: int) -> int | None:
        """The mode step of the record at ``global_step`` (its train record when there is one)."""
        found = self._first_at(global_step)
        return found.mode_step if found is not None else None

    def _first_at(self, global_step: int) -> StepKey | None:
        keys = [k for k in self._keys() if k.step == global_step]
        return min(keys, key=lambda k: (k.mode not in _TRAIN_LIKE, list(ModeKeys).index(k.mode), k.mode_step), default=None)

    def global_step(self, mode: ModeKeys | str, mode_step: int) -> int | None:
        if _global(mode):
            return mode_step
        mode = ModeKeys.coerce(mode)
        return next((k.step for k in self._keys() if k.mode == mode and k.mode_step == mode_step), None)

    def tensor_names(self, step: int | None = None, mode: ModeKeys | str | None = _GLOBAL,
                     regex: str | Iterable[str] | None = None, collection: str | None = None) -> list[str]:
        """Names of the saved tensors, of one step (a global step, or a mode step with ``mode``),
        matching ``regex`` (a pattern or a list) or in ``collection`` (not both)."""
        if regex is not None and collection is not None:
            raise ValueError("Only one of `regex` or `collection` can be passed to this method")
        run = self._store()
        if run is None:
            return []
        if step is not None:
            names = {n for r in self._records(step, mode) for n in r.tensor_names()}
        elif not _global(mode):
            names = {n for k in {k.step for k in self._keys() if k.mode == ModeKeys.coerce(mode)}
                     for r in run.records(mode=mode, start_step=k, end_step=k + 1) for n in r.tensor_names()}
        else:
            names = set(run.tensor_names())
        if collection is not None:
            names = {n for n in names if n.split("/", 1)[0] == str(getattr(collection, "name", collection))}
        if regex is not None:
            patterns = [re.compile(p) for p in ([regex] if isinstance(regex, str) else regex)]
            names = {n for n in names if any(p.search(n) for p in patterns)}
        return sorted(names)

    def has_tensor(self, tname: str) -> bool:
        run = self._store()
        return run is not None and tname in run.tensor_names()

    def tensor(self, tname: str) -> TrialTensor:
        if not self.has_tensor(tname):
            raise TensorUnavailable(tname)
        return TrialTensor(self, tname)

    def collections(self) -> dict[str, list[str]]:
        """``{collection: [tensor names]}`` of what was saved."""
        out: dict[str, list[str]] = {}
        for name in self.tensor_names():
            out.setdefault(name.split("/", 1)[0], []).append(name)
        return out

    def has_passed_step(self, step: int, mode: ModeKeys | str | None = _GLOBAL) -> StepState:
        """Whether ``step`` (global, or a mode step) is complete, was skipped, or may still come.

        A step is complete when every worker has written a record past it, wrote its train record
        (the last one of a global step), or the run has ended. A step not saved is unavailable as
        soon as a later one exists: workers write their steps in order.
        """
        keys = self._keys()
        ended = self.ended
        by_mode_step = not _global(mode)
        if by_mode_step:
            mode = ModeKeys.coerce(mode)
            keys = [k for k in keys if k.mode == mode]

        def position(k: StepKey) -> int:
            return k.mode_step if by_mode_step else k.step

        workers = {k.worker for k in keys}
        if any(position(k) == step for k in keys):
            for worker in workers:
                mine = [k for k in keys if k.worker == worker]
                done = ended or any(position(k) > step for k in mine) or (
                    any(position(k) == step for k in mine) and (not _global(mode) or any(
                        k.step == step and k.mode in _TRAIN_LIKE for k in mine)))
                if not done:
                    return StepState.NOT_YET_AVAILABLE
            return StepState.AVAILABLE
        if ended or (workers and all(any(position(k) > step for k in keys if k.worker == w) for w in workers)):
            return StepState.UNAVAILABLE
        return StepState.NOT_YET_AVAILABLE

    def _missing_step(self, step: int, mode: ModeKeys | str | None) -> NoReturn:
        """Raise what SageMaker raises for a step with no record: :class:`StepNotYetAvailable`
        while training may still write it, :class:`NoMoreData` past the last step of a run that
        has ended, else :class:`StepUnavailable` (a later step exists: this one was not saved)."""
        state = self.has_passed_step(step, mode)
        if state == StepState.NOT_YET_AVAILABLE:
            raise StepNotYetAvailable(step, mode)
        saved = self.steps(mode)
        last = saved[-1] if saved else -1
        if self.ended and step > last:
            raise NoMoreData(step, mode, last)
        raise StepUnavailable(step, mode)

    def wait_for_steps(self, required_steps: Iterable[int], mode: ModeKeys | str | None = _GLOBAL,
                       timeout: float | None = None, poll: float = 0.1) -> None:
        """Return once every step of ``required_steps`` is available.

        Raises :class:`StepUnavailable` for a step that was not saved, :class:`NoMoreData` for one
        beyond the last step of a run that has ended, and :class:`StepNotYetAvailable` when
        ``timeout`` seconds pass first (``None``: wait as long as training runs, as SageMaker does).
        """
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        for step in required_steps:
            while True:
                state = self.has_passed_step(step, mode)
                if state == StepState.AVAILABLE:
                    break
                if state == StepState.UNAVAILABLE:
                    self._missing_step(step, mode)
                if deadline is not None and time.monotonic() >= deadline:
                    raise StepNotYetAvailable(step, mode)
                time.sleep(poll)


class TrialTensor:
    """One tensor of a :class:`Trial` (SageMaker's ``smdebug.core.tensor.Tensor``)."""

    def __init__(self, trial: Trial, name: str) -> None:
        self.trial = trial
        self.name = name

    def __repr__(self) -> str:
        return f"TrialTensor({self.name!r})"

    def steps(self, mode: ModeKeys | str | None = _GLOBAL, show_incomplete_steps: bool = False) -> list[int]:
        """Steps at which this tensor was saved: global steps (any mode) or mode steps of ``mode``."""
        run = self.trial._store()
        if run is None or self.name not in run.tensor_names():
            return []
        view, keys = run.tensor(self.name), self.trial._keys()
        if not _global(mode):
            allowed = {k.mode_step for k in keys if k.mode == ModeKeys.coerce(mode)}
            return [s for s in view.steps(mode) if s in allowed]
        found: set[int] = set()
        for m in {k.mode for k in keys}:
            mode_steps = set(view.steps(m))
            found |= {k.step for k in keys if k.mode == m and k.mode_step in mode_steps}
        return sorted(found)

    def _record(self, step: int, mode: ModeKeys | str | None, worker: str | None) -> StepRecord:
        records = self.trial._records(step, mode, worker)
        if not records:
            if worker is not None and self.trial.has_passed_step(step, mode) == StepState.AVAILABLE:
                raise TensorUnavailableForStep(self.name, step, mode)  # saved, by other workers
            self.trial._missing_step(step, mode)
        for record in records:
            if self.name in record.tensor_names():
                return record
        raise TensorUnavailableForStep(self.name, step, mode)

    def _raw(self, record: StepRecord) -> np.ndarray | None:
        return next((np.asarray(t.value) for t in record.tensors if t.tensor == self.name), None)

    def value(self, step_num: int, mode: ModeKeys | str | None = _GLOBAL, worker: str | None = None) -> np.ndarray:
        """The saved value at a step: the raw tensor (``save_raw_tensor``) or a plain scalar."""
        record = self._record(step_num, mode, worker)
        raw = self._raw(record)
        if raw is not None:
            return raw
        plain = record.scalar(self.name, "")
        if plain is not None:
            return np.asarray(plain)
        raise TensorUnavailableForStep(self.name, step_num, mode, has_reductions=True)

    def reduction_value(self, step_num: int, reduction_name: str, mode: ModeKeys | str | None = _GLOBAL,
                        worker: str | None = None, abs: bool = False) -> float:
        """One statistic at a step (``abs=True``: of ``|x|``), recorded or computed from the raw tensor."""
        record = self._record(step_num, mode, worker)
        stat = f"abs_{reduction_name}" if abs and not reduction_name.startswith("abs_") else reduction_name
        found = record.scalar(self.name, stat)
        if found is None and stat in ("abs_l1", "abs_l2", "abs_linf"):
            found = record.scalar(self.name, stat[4:])  # the norms of |x| are those of x
        if found is not None:
            return np.float64(found)
        raw = self._raw(record)
        name = stat[4:] if stat.startswith("abs_") else stat
        if raw is not None and name in _REDUCTIONS and raw.size:
            values = np.abs(raw.astype(np.float64)) if stat.startswith("abs_") else raw.astype(np.float64)
            return np.float64(_REDUCTIONS[name](values))
        raise TensorUnavailableForStep(self.name, step_num, mode, has_reductions=bool(self.reduction_values(step_num, mode, worker)))

    def reduction_values(self, step_num: int, mode: ModeKeys | str | None = _GLOBAL, worker: str | None = None) -> dict[tuple[str, bool], float]:
        """Every recorded statistic at a step as ``{(name, abs): value}``."""
        record = self._record(step_num, mode, worker)
        out = {}
        for (tensor, stat), value in zip(record.scalar_names, record.scalar_values.tolist(), strict=True):
            if tensor == self.name and stat:
                out[(stat[4:], True) if stat.startswith("abs_") else (stat, False)] = value
        return out

    def values(self, mode: ModeKeys | str | None = _GLOBAL, worker: str | None = None) -> dict[int, np.ndarray]:
        out = {}
        for step in self.steps(mode):
            try:
                out[step] = self.value(step, mode, worker)
            except TensorUnavailableForStep:
                continue
        return out

    def workers(self, step_num: int, mode: ModeKeys | str | None = _GLOBAL) -> list[str]:
        return sorted({r.worker for r in self.trial._records(step_num, mode) if self.name in r.tensor_names()})

    def prev_steps(self, step: int, n: int, mode: ModeKeys | str | None = _GLOBAL) -> list[int]:
        """The last ``n`` steps before ``step`` at which this tensor was saved."""
        return [s for s in self.steps(mode) if s < step][-n:] if n > 0 else []

    def shape(self, step_num: int, mode: ModeKeys | str | None = _GLOBAL, worker: str | None = None) -> tuple[int, ...]:
        record = self._record(step_num, mode, worker)
        raw = self._raw(record)
        if raw is not None:
            return tuple(raw.shape)
        if self.name in record.shapes:
            return tuple(record.shapes[self.name])
        raise TensorUnavailableForStep(self.name, step_num, mode)


def create_trial(path: str | os.PathLike[str], name: str | None = None, range_steps: Any = None) -> Trial:
    """A :class:`Trial` over the run at ``path`` (it need not exist yet: training may be starting).

    >>> trial = create_trial("tensorlens_runs/exp1")          # doctest: +SKIP
    >>> trial.steps(), trial.tensor_names(collection="gradients")   # doctest: +SKIP
    """
    return Trial(path, name=name, range_steps=range_steps)
