"""A run's name taken from the user's own run: the W&B or MLflow run it is recorded beside, the
Lightning logger, the Hugging Face ``TrainingArguments.run_name``.

``wandb.init(name="healthy")`` makes a tensorlens run called ``healthy`` (its folder
``tensorlens_runs/healthy``, or ``healthy-2`` when that is taken, as any derived name), so the
store, the report and every CLI listing show the name the user chose. The W&B and MLflow run ids
are kept in the run metadata (``run.metadata()["trackers"]``), where the name alone would be
ambiguous. A ``run_name=`` given to tensorlens still wins.

Who knows the user's run:

- ``tl.watch`` / ``Hook`` / ``Recorder``: the active runs, read here without importing a
  tracker: ``wandb.run`` and ``mlflow.active_run()`` (this thread's), then any registered
  backend's :meth:`~tensorlens.backends.base.Backend.active_run_name`;
- the callbacks, which know their framework's loggers and arguments: they name the runs with
  :func:`lightning_logger_runs` / :func:`TrackerRun` and hand them, with the folder that holds
  their runs, to the recorder they create (:func:`named_after`), since a ``WandbLogger``'s or
  ``MLFlowLogger``'s run is not necessarily the active one.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from tensorlens.backends.base import Backend, active_run_name
from tensorlens.backends.optional import is_lightning_logger

#: Trackers whose run ids are kept in the metadata (their active runs are read here).
ID_TRACKERS = ("wandb", "mlflow")


@dataclasses.dataclass(frozen=True)
class TrackerRun:
    """One run of the user's tracker or logger: ``tracker`` (``"wandb"``, ``"mlflow"``, or the
    logger's or framework's name), its ``name`` (``None``: unnamed) and ``run_id``.

    >>> TrackerRun("wandb", "healthy", "t68zdow0").metadata()
    {'run_name': 'healthy', 'run_id': 't68zdow0'}
    """

    tracker: str
    name: str | None
    run_id: str | None = None

    def metadata(self) -> dict[str, str | None]:
        return {"run_name": self.name, "run_id": self.run_id}


@dataclasses.dataclass(frozen=True)
class Naming:
    """What a callback tells the recorder it creates: the user's ``runs`` (the first named one
    names the tensorlens run) and ``runs_dir``, the folder a run folder of a derived name goes
    into (``None``: ``./tensorlens_runs``)."""

    runs: tuple[TrackerRun, ...] = ()
    runs_dir: str | None = None


_given: contextvars.ContextVar[Naming | None] = contextvars.ContextVar("tensorlens_naming", default=None)


@contextlib.contextmanager
def named_after(naming: Naming) -> Iterator[None]:
    """Recorders created inside take their name and ids from ``naming`` instead of the active runs.

    >>> with named_after(Naming((TrackerRun("wandb", "healthy", "abc"),), runs_dir="logs/tensorlens_runs")):  # doctest: +SKIP
    ...     recorder = tl.Recorder(...)
    """
    token = _given.set(naming)
    try:
        yield
    finally:
        _given.reset(token)


def current_naming() -> Naming:
    """The callback's :class:`Naming` while it creates a recorder, else the active runs'."""
    given = _given.get()
    return given if given is not None else Naming(active_tracker_runs())


def run_name_from(naming: Naming, backends: Sequence[Backend] = ()) -> str | None:
    """The name the user's run gives a tensorlens run: the first named run of ``naming``, else
    the active run of a backend's tracker (a user's registered tracker included), else ``None``."""
    for run in naming.runs:
        if run.name:
            return run.name
    return active_run_name(backends)


def tracker_metadata(runs: Iterable[TrackerRun]) -> dict[str, dict[str, str | None]]:
    """``{"wandb": {"run_name": ..., "run_id": ...}, "mlflow": {...}}``: the runs of trackers with
    ids (the first of each), kept in the run metadata.

    >>> tracker_metadata([TrackerRun("mlflow", "base", "9f2c"), TrackerRun("TensorBoardLogger", "lightning_logs-0", "0")])
    {'mlflow': {'run_name': 'base', 'run_id': '9f2c'}}
    """
    out: dict[str, dict[str, str | None]] = {}
    for run in runs:
        if run.tracker in ID_TRACKERS and run.tracker not in out:
            out[run.tracker] = run.metadata()
    return out


# ---------------------------------------------------------------------------------------- the runs


def active_tracker_runs() -> tuple[TrackerRun, ...]:
    """The active W&B run and this thread's active MLflow run (neither library is imported here)."""
    wandb = sys.modules.get("wandb")
    found = [wandb_run(getattr(wandb, "run", None))] if wandb is not None else []
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None:
        try:
            found.append(mlflow_run(mlflow.active_run()))
        except Exception:  # a half-imported or broken mlflow names nothing
            pass
    return tuple(run for run in found if run is not None)


def wandb_run(run: Any) -> TrackerRun | None:
    """A W&B run (what ``wandb.init`` returns, a ``WandbLogger``'s ``experiment``), or ``None``."""
    run_id = _text(getattr(run, "id", None)) if run is not None else None
    if run_id is None:  # no run, or a disabled run / Lightning's dummy on ranks > 0
        return None
    return TrackerRun("wandb", _text(getattr(run, "name", None)), run_id)


def mlflow_run(run: Any) -> TrackerRun | None:
    """An MLflow run (``mlflow.active_run()``, ``client.get_run(id)``), or ``None``."""
    info = getattr(run, "info", None)
    run_id = _text(getattr(info, "run_id", None))
    return TrackerRun("mlflow", _text(getattr(info, "run_name", None)), run_id) if run_id is not None else None


def lightning_logger_runs(loggers: Sequence[Any]) -> tuple[TrackerRun, ...]:
    """The runs of a Lightning trainer's loggers, in their order: a ``WandbLogger``'s W&B run
    (``WandbLogger(name=...)``) and an ``MLFlowLogger``'s MLflow run (``run_name=...``) by their own
    names and ids; any other logger as ``<name>-<version>`` (``lightning_logs-0``). Runs with a
    name the user chose come first."""
    named: list[TrackerRun] = []
    others: list[TrackerRun] = []
    for logger in loggers:
        found = None
        try:
            if is_lightning_logger(logger, "WandbLogger"):
                found = wandb_run(logger.experiment)
            elif is_lightning_logger(logger, "MLFlowLogger"):
                run_id = _text(logger.run_id)
                if run_id is not None:
                    found = mlflow_run(logger.experiment.get_run(run_id)) or TrackerRun("mlflow", None, run_id)
        except Exception:  # a logger that cannot say: named by name/version below
            found = None
        if found is not None and found.name:
            named.append(found)
            continue
        try:
            version = _text(getattr(logger, "version", None))
            label = "-".join(p for p in (_text(getattr(logger, "name", None)), version) if p)
        except Exception:  # a logger whose name or version cannot be read names nothing
            version, label = None, ""
        tracker = found.tracker if found else type(logger).__name__
        others.append(TrackerRun(tracker, label or None, found.run_id if found else version))
    return (*named, *others)


def _text(value: Any) -> str | None:
    """A non-empty string of ``value`` (ints become strings), else ``None``."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    return value if isinstance(value, str) and value else None
