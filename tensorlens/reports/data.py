"""What a report or an explorer needs from a stored run, read in one pass over ``Run.records()``.

One streaming pass keeps, per run: full-resolution series that are cheap (the global gradient
norm, every plain scalar such as a loss, NaN/Inf counts per collection), every statistic at up to
``columns`` evenly spread steps (for layer x step heatmaps and per-tensor series), the histograms
at up to ``histogram_columns`` steps, and the last step whole. A 10,000-step run of 200 tensors is
never held in memory: only the thinned steps are.

>>> data = load_run("tensorlens_runs/my-run")           # doctest: +SKIP
>>> data.grad_norm                                       # doctest: +SKIP
(array([0, 100, ...]), array([0.52, 0.48, ...]))
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from tensorlens.modes import ModeKeys
from tensorlens.records import StepRecord
from tensorlens.stats.views import thin_indices
from tensorlens.store.errors import CorruptRunError
from tensorlens.store.reader import Run, open_run
from tensorlens.store.schema import store_files

#: Preferred when recorded: the exact global gradient norm of another issue's derived statistics.
GLOBAL_GRAD_NORM = ("dynamics/global/grad_norm", "")
_TRAIN_MODES = (ModeKeys.TRAIN, ModeKeys.GLOBAL)


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """How much of a run is kept: ``columns`` steps of every statistic, ``histogram_columns``
    steps of every histogram; ``worker`` picks one worker of a distributed run (default: the
    first of ``worker_0``, ``reduced`` or the first in sorted order)."""

    columns: int = 150
    histogram_columns: int = 100
    worker: str | None = None


class RunData:
    """The parts of one run a report draws (see the module docstring)."""

    def __init__(self, run: Run, name: str, worker: str | None, workers: list[str]) -> None:
        self.run = run
        self.path = run.path
        self.name = name
        self.worker = worker
        self.workers = workers
        self.meta = run.meta
        self.steps: list[int] = []  # every train/global step of the worker, in order
        self.tensors: dict[str, None] = {}  # tensors in record order (first appearance)
        self.stats: dict[str, dict[str, None]] = defaultdict(dict)  # tensor -> stats in record order
        self.plain: dict[tuple[str, str], tuple[list[int], list[float]]] = {}  # (tensor, mode) -> series
        self.grad_norm_steps: list[int] = []
        self.grad_norm_values: list[float] = []
        self.grad_norm_source = ""
        self.nonfinite: dict[str, tuple[list[int], list[float]]] = {}  # collection -> (steps, NaN + Inf)
        self.nonfinite_tensors: dict[str, list[float]] = {}  # tensor -> [first step, last step, max count]
        self.column_records: list[StepRecord] = []  # every statistic at the thinned steps
        self.histogram_records: list[StepRecord] = []  # histograms at the thinned steps
        self.latest: StepRecord | None = None
        self.modes: list[str] = []

    @property
    def grad_norm(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.grad_norm_steps, dtype=np.int64), np.asarray(self.grad_norm_values, dtype=np.float64)

    @property
    def column_steps(self) -> np.ndarray:
        return np.asarray([r.step for r in self.column_records], dtype=np.int64)

    def column_matrix(self, tensors: list[str], stat: str) -> np.ndarray:
        """``[len(tensors), columns]`` values of ``stat`` at the column steps (NaN where absent)."""
        return self.column_values(tensors, stat)[0]

    def column_values(self, tensors: list[str], stat: str) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`column_matrix` and where a value was recorded (a recorded NaN is told apart from
        an absent one: a heatmap draws the first as a NaN cell, leaves the second blank)."""
        out = np.full((len(tensors), len(self.column_records)), np.nan)
        present = np.zeros(out.shape, dtype=bool)
        for j, record in enumerate(self.column_records):
            for i, tensor in enumerate(tensors):
                value = record.scalar(tensor, stat)
                if value is not None:
                    out[i, j] = value
                    present[i, j] = True
        return out, present

    def modules(self) -> list[dict[str, Any]] | None:
        """The model's modules as the recorder stored them (meta ``modules``), or ``None`` when
        there is none or it is damaged (see :func:`read_modules`; warned about once)."""
        if not hasattr(self, "_modules"):
            self._modules = read_modules(self.run)
        return self._modules


def read_modules(run: Run) -> list[dict[str, Any]] | None:
    """The run's meta entry ``modules`` (a JSON list of ``{"name", "type", "extra_repr",
    "parameters": {name: shape}, "call_order"}``), read checked by the store reader (``NaN``,
    ``Infinity``, too deep: a :class:`~tensorlens.CorruptRunError` naming the file and the entry).
    A damaged entry gives ``None``, so that the explorer builds its tree from the tensor names, and
    one warning that says so with the reader's reason; fields of the wrong type are left out of
    their module (see :func:`module_list`)."""
    try:
        found = run.meta_json("modules")
    except CorruptRunError as err:
        warnings.warn(f"tensorlens: {err}; the module tree is built from the tensor names instead", stacklevel=3)
        return None
    return module_list(found, run.path)


def module_list(found: Any, run: str) -> list[dict[str, Any]] | None:
    """``found`` (the parsed ``modules`` entry of the run at ``run``) with only what the page can
    show: modules with a text ``name``; ``type`` and ``extra_repr`` when texts, ``parameters``
    whose shapes are lists of integers, ``call_order`` when an integer (an older writer stored
    ``NaN`` as the text ``"NaN"``). Not a list: ``None`` and a warning naming the run and the entry."""
    if found is None:
        return None
    if not isinstance(found, list):
        warnings.warn(f"tensorlens: run {run!r}: its meta entry 'modules' is not a JSON list of modules; the module "
                      "tree is built from the tensor names instead", stacklevel=4)
        return None
    modules = []
    for entry in found:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            continue
        kept: dict[str, Any] = {"name": entry["name"]}
        for key in ("type", "extra_repr"):
            if isinstance(entry.get(key), str):
                kept[key] = entry[key]
        parameters = entry.get("parameters")
        if isinstance(parameters, dict):
            kept["parameters"] = {k: v for k, v in parameters.items() if isinstance(v, list)
                                  and all(isinstance(d, int) and not isinstance(d, bool) for d in v)}
        order = entry.get("call_order")
        if isinstance(order, int) and not isinstance(order, bool):
            kept["call_order"] = order
        modules.append(kept)
    return modules


class _Layout:
    """Positions in one scalar layout (shared by every record with the same names), computed once."""

    def __init__(self, names: tuple[tuple[str, str], ...]) -> None:
        self.names = names
        self.gradient_l2 = np.array([i for i, (t, s) in enumerate(names) if s == "l2" and t.startswith("gradients/")], dtype=np.int64)
        self.global_norm = next((i for i, n in enumerate(names) if n == GLOBAL_GRAD_NORM), None)
        self.plain = [(i, t) for i, (t, s) in enumerate(names) if not s]
        by_collection: dict[str, list[int]] = defaultdict(list)
        self.nonfinite_tensors: list[tuple[str, list[int]]] = []
        per_tensor: dict[str, list[int]] = defaultdict(list)
        for i, (t, s) in enumerate(names):
            if s in ("nan_count", "inf_count"):
                by_collection[t.split("/", 1)[0]].append(i)
                per_tensor[t].append(i)
        self.nonfinite = {c: np.array(v, dtype=np.int64) for c, v in by_collection.items()}
        self.nonfinite_tensors = [(t, v) for t, v in per_tensor.items()]
        self.nonfinite_all = np.array(sorted(i for v in by_collection.values() for i in v), dtype=np.int64)
        self.seen = False  # its tensor names were added to the run's list


def _pick_worker(workers: list[str], wanted: str | None) -> str | None:
    if wanted is not None:
        if wanted not in workers:
            raise ValueError(f"Expected `worker` to be one of {workers}, but got {wanted!r}")
        return wanted
    for preferred in ("worker_0", "reduced"):
        if preferred in workers:
            return preferred
    return workers[0] if workers else None


def check_run_folder(path: str) -> str:
    """``path`` as a run folder whose store files all lie inside it (a symbolic link out of the
    folder is refused: a report reads nothing outside the run folders it is given)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no run at {path!r} (expected a folder holding tensorlens.sqlite)")
    folder = os.path.realpath(path if os.path.isdir(path) else os.path.dirname(path) or ".")
    for file in store_files(path):
        real = os.path.realpath(file)
        if os.path.dirname(real) != folder:
            raise PermissionError(f"{file!r} points outside its run folder ({real!r}); refusing to read it")
    return path


def load_run(
    run_or_path: Run | str | os.PathLike[str],
    options: LoadOptions | None = None,
    progress: Callable[[int], None] | None = None,
    reader: Callable[[RunData, Callable[[StepRecord], None]], None] | None = None,
) -> RunData:
    """Read what a report needs from a run (an open :class:`~tensorlens.Run` or a folder).

    ``progress(n)`` is called with the number of records read since the last call. ``reader(data,
    take)``, when given, reads the run's records in step order itself and hands each to ``take``
    (records of other workers are skipped): the report's health summary runs the rules in the same
    pass (:func:`tensorlens.reports.health.rules_reader`), so that the store is read once.
    """
    options = options or LoadOptions()
    run = run_or_path if isinstance(run_or_path, Run) else open_run(check_run_folder(os.fspath(run_or_path)))
    workers = run.workers()
    worker = _pick_worker(workers, options.worker)
    name = run.meta.get("run_name") or os.path.basename(os.path.normpath(run.path))
    data = RunData(run, name, worker, workers)
    data.modes = [str(m) for m in run.modes()]
    all_steps = sorted({s for s in run.steps()})
    columns = {all_steps[i] for i in thin_indices(len(all_steps), options.columns)}
    histogram_steps = {all_steps[i] for i in thin_indices(len(all_steps), options.histogram_columns)}
    layouts: dict[int, _Layout] = {}
    last_histogram_names: tuple[tuple[str, int], ...] | None = None
    pending = 0

    def take(record: StepRecord) -> None:
        nonlocal pending, last_histogram_names
        if worker is not None and record.worker != worker:
            return
        pending += 1
        if progress is not None and pending >= 200:
            progress(pending)
            pending = 0
        names = record.scalar_names
        layout = layouts.get(id(names))
        if layout is None or layout.names is not names:
            layout = layouts[id(names)] = _Layout(names)
        values = record.scalar_values
        train = record.mode in _TRAIN_MODES
        mode = "train" if train else str(record.mode)
        for i, tensor in layout.plain:
            series = data.plain.setdefault((tensor, mode), ([], []))
            series[0].append(record.step)
            series[1].append(float(values[i]))
        if not train:
            return
        data.steps.append(record.step)
        if not layout.seen:  # once per layout: the names of every later record with it are known
            layout.seen = True
            for tensor, stat in names:
                data.tensors.setdefault(tensor)
                if stat:
                    data.stats[tensor].setdefault(stat)
        if record.histogram_names is not last_histogram_names:
            last_histogram_names = record.histogram_names
            for tensor, _ in last_histogram_names:
                data.tensors.setdefault(tensor)
        if layout.global_norm is not None:
            data.grad_norm_steps.append(record.step)
            data.grad_norm_values.append(float(values[layout.global_norm]))
            data.grad_norm_source = "dynamics/global/grad_norm"
        elif len(layout.gradient_l2):
            data.grad_norm_steps.append(record.step)
            data.grad_norm_values.append(float(np.sqrt(np.sum(np.square(values[layout.gradient_l2])))))
            data.grad_norm_source = data.grad_norm_source or "sqrt of the sum of squared gradients/*/l2"
        for collection, positions in layout.nonfinite.items():
            series = data.nonfinite.setdefault(collection, ([], []))
            series[0].append(record.step)
            series[1].append(float(np.sum(values[positions])))
        if len(layout.nonfinite_all) and np.any(values[layout.nonfinite_all] > 0):
            for tensor, positions in layout.nonfinite_tensors:
                count = float(np.sum(values[positions]))
                if count > 0:
                    seen = data.nonfinite_tensors.setdefault(tensor, [record.step, record.step, count])
                    seen[1] = record.step
                    seen[2] = max(seen[2], count)
        if record.step in columns:
            data.column_records.append(record.without(histograms=True, tensors=True))
            columns.discard(record.step)  # one record per step, even with several GLOBAL and TRAIN records
        if record.step in histogram_steps and record.histogram_names:
            data.histogram_records.append(record.without(tensors=True))
            histogram_steps.discard(record.step)
        data.latest = record

    if reader is None:
        for record in run.records(worker=worker):
            take(record)
    else:
        reader(data, take)
    if progress is not None and pending:
        progress(pending)
    if data.latest is not None and data.column_records and data.column_records[-1].step != data.latest.step:
        data.column_records.append(data.latest.without(histograms=True, tensors=True))
    return data
