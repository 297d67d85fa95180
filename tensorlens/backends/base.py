"""The backend base class and the name registry.

A backend only translates :class:`~tensorlens.records.StepRecord` objects for one destination;
it never computes statistics. Methods default to doing nothing so a backend overrides only what
it needs. Writes happen on a background thread, one thread per backend.

A backend is one class plus a registry line: the class says itself whether its tracker has an
active run in this process (:meth:`Backend.detect`, for ``backends="auto"``), what that run is
called (:meth:`Backend.active_run_name`) and how to come from a Lightning logger
(:meth:`Backend.from_logger`). The same class replays a stored run (``tensorlens sync RUN --to
NAME``): its ``replay_*`` class methods say which options a sync takes, where the records go, and
how the tracker run is opened or continued; their defaults make any backend replayable, and the
sync machinery (:mod:`tensorlens.sync`) keeps what was sent and the tracker run to continue.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from tensorlens._checks import expected
from tensorlens.backends.payload import Payload, PayloadSelector, resolve_tracker_stats, shared_selector
from tensorlens.findings import Finding
from tensorlens.records import StepRecord
from tensorlens.store.runs import folder_name


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What a backend learns when the hook opens it.

    ``metadata`` is the run's metadata (see :mod:`tensorlens.engine.metadata`), handed to
    :meth:`Backend.write_metadata` once, right after :meth:`Backend.open`; empty when there is
    none to send (a sync continuing a tracker run that has it already).
    """

    run_name: str
    run_dir: str
    rank: int = 0
    world_size: int = 1
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: the watched module tree (:func:`tensorlens.capture.modules.describe_modules`), built when
    #: called; the local store keeps it for the explorer
    modules: Callable[[], list[dict[str, Any]]] | None = None
    #: the run's ``tracker_stats`` option (:mod:`tensorlens.backends.payload`); ``None``: not given
    tracker_stats: str | Sequence[str] | None = None
    #: the run's ``tracker_histogram_interval`` option; ``None``: the payload's default
    tracker_histogram_interval: int | None = None


@dataclasses.dataclass
class ReplayRun:
    """The tracker run a sync replays a stored run into, as a backend's ``replay_*`` class methods
    see it. The sync machinery keeps :attr:`run_id` and :attr:`info` between sessions (in the sync
    state beside the run, :mod:`tensorlens.sync.state`), so a backend keeps no state of its own.
    """

    #: the name the backend is registered under (``--to``)
    to: str
    #: the sync's options for it, after :meth:`Backend.replay_settings`
    options: dict[str, Any]
    #: the tracker run: the one an earlier sync wrote (to continue) or ``None``, then the one opened
    run_id: str | None = None
    #: what the backend needs to continue the run next time (plain JSON values, read back untrusted)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: what :meth:`Backend.open_for_replay` opened for :meth:`Backend.finish_replay` and
    #: :meth:`Backend.describe_replay` (a W&B run, an MLflow client); this session only
    tracker: Any = None


class Backend:
    """Base class for destinations of records.

    Capability flags:

    - ``supports_histograms``: histograms are sent (else skipped by the dispatcher).
    - ``supports_tensors``: raw tensors are sent.
    - ``main_process_only``: created only on rank 0 of a distributed run.
    - ``critical``: the dispatcher waits for it instead of dropping records when it falls behind
      (the local store is critical; a tracker is not).
    - ``produces_findings``: it emits rule findings (the rule runner); the dispatcher hands it a
      sink with :meth:`bind_findings`, sends what it emits to every other backend's
      :meth:`write_finding`, and flushes and closes it before the others so nothing it finds
      at the end is lost.
    - ``supports_replay``: ``tensorlens sync RUN --to NAME`` can replay a stored run into it.

    Replay (``tensorlens sync``, :func:`tensorlens.sync_run`): :attr:`replay_options` names the
    options a sync takes; :meth:`replay_settings` checks them, :meth:`replay_destination` names
    where the records go (what the sync state is kept under), :meth:`open_for_replay` opens a new
    tracker run or continues ``replay.run_id`` and returns the backend writing into it, then the
    backend gets ``open``, ``write_metadata``, ``restore``/``write``/``write_finding``, ``flush``
    and ``close`` as in a live run, and :meth:`finish_replay` ends the tracker run. The defaults
    replay into ``cls(**options)`` with the destination named after the backend.
    """

    name: ClassVar[str] = "backend"
    supports_histograms: ClassVar[bool] = True
    supports_tensors: ClassVar[bool] = False
    main_process_only: ClassVar[bool] = True
    critical: ClassVar[bool] = False
    produces_findings: ClassVar[bool] = False
    supports_replay: ClassVar[bool] = True
    #: the options a sync takes for it (``sync_run(..., key=value)``, ``--option KEY=VALUE``);
    #: the default :meth:`open_for_replay` passes them to ``__init__``
    replay_options: ClassVar[tuple[str, ...]] = ()
    #: send the run metadata in every sync session, not only when the tracker run is created
    #: (each W&B offline session is a folder of its own, uploaded on its own)
    replay_metadata_every_session: ClassVar[bool] = False

    @classmethod
    def detect(cls) -> bool:
        """Whether this tracker has an active run in this process, for ``backends="auto"``.
        Must not import the tracker's library (look in ``sys.modules``)."""
        return False

    @classmethod
    def active_run_name(cls) -> str | None:
        """The active tracker run's name, used as the default run name (``None``: none)."""
        return None

    @classmethod
    def from_logger(cls, logger: Any) -> Backend | None:
        """A backend writing into a Lightning logger's own run, or ``None`` if ``logger`` is not
        this tracker's logger (called for every logger of a trainer)."""
        return None

    # ------------------------------------------------------------------ replay (tensorlens sync)

    @classmethod
    def replay_settings(cls, options: dict[str, Any]) -> dict[str, Any]:
        """The options of a sync, checked (eagerly: the usual "Expected ..." errors) and with
        defaults filled in. Only names in :attr:`replay_options` reach it, none ``None``.
        Default: as given."""
        return dict(options)

    @classmethod
    def replay_destination(cls, replay: ReplayRun) -> str:
        """Where the records go, as a stable string: what a sync keeps its progress under (one
        tracker run per stored run and destination). Default: the name, and the options."""
        if not replay.options:
            return replay.to
        return replay.to + ":" + ",".join(
            f"{k}={json.dumps(v, default=str) if not isinstance(v, str) else v}" for k, v in sorted(replay.options.items())
        )

    @classmethod
    def replay_environment(cls, replay: ReplayRun) -> dict[str, str]:
        """Environment variables to set while the sync runs (those the user set are kept), such
        as a tracker client's network timeouts. Default: none."""
        return {}

    @classmethod
    def check_replay_state(cls, replay: ReplayRun) -> str | None:
        """What is wrong with ``replay.run_id`` and ``replay.info`` kept by an earlier sync (read
        from a file, so untrusted: the id may name folders and URLs), or ``None``. The default
        takes ids of word characters, ``.``, ``-`` and ``%`` that do not start with ``.``: one
        path component, never ``..``."""
        return run_id_problem(replay.run_id)

    @classmethod
    def open_for_replay(cls, replay: ReplayRun, run_name: str) -> tuple[Backend, str]:
        """Open the tracker run (a new one named ``run_name`` when ``replay.run_id`` is ``None``,
        else continue ``replay.run_id``); returns the backend writing into it (not yet opened)
        and the run's id. Default: ``cls(**replay.options)``; the id is the stored run's name
        (made one path component), and a later sync continues it."""
        return cls(**replay.options), replay.run_id or folder_name(run_name)

    @classmethod
    def finish_replay(cls, replay: ReplayRun) -> None:  # noqa: B027 - optional hook
        """After the backend was closed: end the tracker run (W&B ``finish``, MLflow
        ``FINISHED``). Default: nothing."""

    @classmethod
    def describe_replay(cls, replay: ReplayRun) -> list[str]:
        """Lines for the user: where the run went, what to do next (``wandb sync ...``); also
        called when there was nothing new to send (``replay.tracker`` is then ``None``)."""
        return []

    # ------------------------------------------------------------------ payload

    #: What this backend sends of each record (:mod:`tensorlens.backends.payload`): ``None`` takes
    #: the run's ``tracker_stats`` option, then ``$TENSORLENS_TRACKER_STATS``, then ``"default"``.
    #: A tracker backend takes it as a keyword (``WandbBackend(tracker_stats="all")``).
    tracker_stats: str | Sequence[str] | None = None
    #: Train steps between the records whose histograms this backend sends: ``None`` takes the
    #: run's ``tracker_histogram_interval``, else 100 for the ``"default"`` payload and every saved
    #: step for the others (:data:`tensorlens.backends.payload.DEFAULT_HISTOGRAM_INTERVAL`).
    tracker_histogram_interval: int | None = None

    def open_payload(self, run: RunInfo | None = None) -> PayloadSelector:
        """Choose this backend's payload for ``run`` (call it from :meth:`open`); returns the
        selector :meth:`payload` uses, shared by the backends of ``run`` that send the same
        ``tracker_stats`` and histogram interval (each record's payload is chosen once for all of them)."""
        tracker_stats = resolve_tracker_stats(self.tracker_stats, run.tracker_stats if run else None)
        interval = self.tracker_histogram_interval
        if interval is None and run is not None:
            interval = run.tracker_histogram_interval
        selector = PayloadSelector(tracker_stats, interval) if run is None else shared_selector(tracker_stats, run, interval)
        self._payload_selector = selector
        return selector

    def payload(self, record: StepRecord) -> Payload:
        """What this backend sends of ``record``: the global values, the chosen statistics and
        histograms, and the per-layer panels (see :mod:`tensorlens.backends.payload`).

        >>> payload = self.payload(record)   # doctest: +SKIP
        >>> payload.scalars, payload.globals, payload.histograms, payload.panels  # doctest: +SKIP
        """
        selector = self.__dict__.get("_payload_selector")
        if selector is None:  # opened without open_payload (a backend driven by hand)
            selector = self.open_payload(None)
        return selector.select(record)

    def memo_key(self, make: Callable[..., str], *parts: Any) -> str:
        """``make(*parts)`` (``tracker_key``, ``histogram_key``, ... of :mod:`tensorlens.backends.keys`),
        worked out once per backend: a record names the same few hundred series at every saved
        step, and building each key again cost a tracker ~1.5 ms per record on a thread that
        shares the GIL with training.

        >>> self.memo_key(tracker_key, self.prefix, record.mode, record.worker, "gradients/fc1.weight/l2")  # doctest: +SKIP
        """
        cache: dict[tuple[Any, ...], str] | None = self.__dict__.get("_memo_keys")
        if cache is None:
            cache = self._memo_keys = {}
        found = cache.get((make, *parts))
        if found is None:
            found = cache[(make, *parts)] = make(*parts)
        return found

    # ------------------------------------------------------------------ recording

    def open(self, run: RunInfo) -> None:  # noqa: B027 - optional hook
        """Called once, on the dispatcher's thread, before the first write."""

    def write_metadata(self, metadata: Mapping[str, Any]) -> None:  # noqa: B027 - optional hook
        """The run's metadata (configuration, model, versions, git commit: a nested dict of
        plain values), once, after :meth:`open` and before the first :meth:`write`. Trackers keep
        it as their run config or parameters. Default: ignore it."""

    def write(self, record: StepRecord) -> None:
        raise NotImplementedError

    def write_finding(self, finding: Finding) -> None:  # noqa: B027 - optional hook
        """A rule fired (see :mod:`tensorlens.rules`): show or store it. Default: ignore it."""

    def bind_findings(self, sink: Callable[[Finding], None]) -> None:  # noqa: B027 - optional hook
        """Called once by the dispatcher: where a backend that ``produces_findings`` sends them."""

    def restore(self, item: StepRecord | Finding) -> None:  # noqa: B027 - optional hook
        """A record or rule finding that this backend's destination holds already (``tensorlens
        sync`` continuing a tracker run): rebuild what is derived across them (custom charts,
        heatmaps, histogram files, finding counts) as if it had been written, without sending
        it. Default: nothing."""

    def flush(self) -> None:  # noqa: B027
        """Make everything written so far durable or visible."""

    def close(self) -> None:  # noqa: B027
        """Flush and release resources. Called once."""


_RUN_ID = re.compile(r"[A-Za-z0-9_%\-][A-Za-z0-9_.%\-]{0,254}")

# name -> class, or "module:attribute" for integrations so the core never imports a vendor library
_REGISTRY: dict[str, type[Backend] | str] = {
    "local": "tensorlens.backends.local:LocalBackend",
    "memory": "tensorlens.backends.memory:MemoryBackend",
    "wandb": "tensorlens.integrations.wandb:WandbBackend",
    "mlflow": "tensorlens.integrations.mlflow:MLflowBackend",
    "tensorboard": "tensorlens.integrations.tensorboard:TensorBoardBackend",
}
# `supports_replay` of the classes above, so `tensorlens sync --help` lists the replaying backends
# without importing a tracker (a test checks these against the classes)
_LAZY_REPLAYS = {
    "tensorlens.backends.local:LocalBackend": False,  # the stored run itself: not a destination
    "tensorlens.backends.memory:MemoryBackend": False,  # its records would end with the sync
    "tensorlens.integrations.wandb:WandbBackend": True,
    "tensorlens.integrations.mlflow:MLflowBackend": True,
    "tensorlens.integrations.tensorboard:TensorBoardBackend": True,
}


def run_id_problem(run_id: str | None) -> str | None:
    """Why ``run_id`` (read back from a sync state) is not one path component, or ``None``."""
    if run_id is None or not _RUN_ID.fullmatch(run_id):
        return f"the tracker run id {run_id!r} is not one (it would name a folder or URL outside the tracker's)"
    return None


def register_backend(name: str, backend: type[Backend]) -> None:
    """Make ``backends=[name]`` create ``backend()``, and ``tensorlens sync RUN --to name`` (and
    ``sync_run(run, name)``) replay into it unless it sets ``supports_replay = False``.

    >>> class Printer(Backend):
    ...     def write(self, record): print(record.step)
    >>> register_backend("printer", Printer)
    """
    if not isinstance(name, str) or not name:
        raise expected("name", "a non-empty string", name)
    if not (isinstance(backend, type) and issubclass(backend, Backend)):
        raise expected("backend", "a subclass of tensorlens.Backend", backend)
    if name == "local":  # the run store is what the reader, the CLI and every guarantee rely on
        raise expected("name", 'a name other than "local" (the run store cannot be replaced)', name)
    _REGISTRY[name] = backend


def registered_backends() -> list[str]:
    return sorted(_REGISTRY)


def replaying_backends() -> list[str]:
    """The registered names ``tensorlens sync --to`` takes (``supports_replay``), found without
    importing a tracker."""
    return sorted(
        name for name, entry in _REGISTRY.items()
        if (_LAZY_REPLAYS.get(entry, True) if isinstance(entry, str) else entry.supports_replay)
    )


def backend_class(name: str) -> type[Backend]:
    """The class registered under ``name``, importing an integration on first use."""
    try:
        entry = _REGISTRY[name]
    except KeyError:
        raise expected("backends", f"names from {registered_backends()} or Backend instances", name) from None
    if isinstance(entry, str):
        module_name, attribute = entry.split(":")
        entry = getattr(importlib.import_module(module_name), attribute)
        _REGISTRY[name] = entry
    return entry


def create_backend(spec: str | Backend | Callable[[], Backend]) -> Backend:
    if isinstance(spec, Backend):
        return spec
    if isinstance(spec, str):
        return backend_class(spec)()
    if isinstance(spec, type) and issubclass(spec, Backend):
        return spec()
    raise expected("backends", "names, Backend classes or Backend instances", spec)


def resolve_backends(spec: str | Sequence[str | Backend | type[Backend]], rank: int = 0) -> list[Backend]:
    """The backends for ``spec``: ``"auto"`` is the local store plus every registered tracker with
    an active run (:meth:`Backend.detect`); names, classes and instances otherwise. The local
    store is always there; ranks other than 0 keep only backends that are not ``main_process_only``."""
    if isinstance(spec, str):
        spec = auto_backends() if spec == "auto" else [spec]
    elif not isinstance(spec, Sequence):
        raise expected("backends", '"auto" or a list of names, Backend classes or instances', spec)
    backends = [create_backend(s) for s in spec]
    if not any(b.name == "local" for b in backends):
        backends.insert(0, create_backend("local"))
    if rank != 0:  # trackers are rank 0's in every mode; "all" gives each rank its local store
        backends = [b for b in backends if not b.main_process_only]
    return backends


def auto_backends() -> list[str]:
    """``backends="auto"``: ``"local"`` and every registered tracker with an active run."""
    found = ["local"]
    for name in list(_REGISTRY):
        if name in ("local", "memory"):
            continue
        try:
            if backend_class(name).detect():
                found.append(name)
        except Exception:  # a broken third-party backend must not stop the hook
            continue
    return found


def active_run_name(backends: Sequence[Backend] = ()) -> str | None:
    """The name of the first active tracker run: the given backends' trackers first, then every
    registered one (a run is named after its W&B or MLflow run even with ``backends=["local"]``)."""
    classes: list[type[Backend]] = [type(b) for b in backends]
    for name in list(_REGISTRY):
        try:
            classes.append(backend_class(name))
        except Exception:
            continue
    for cls in dict.fromkeys(classes):
        try:
            found = cls.active_run_name()
        except Exception:
            found = None
        if found:
            return found
    return None
