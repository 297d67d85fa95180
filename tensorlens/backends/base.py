"""The backend base class and the name registry.

A backend only translates :class:`~tensorlens.records.StepRecord` objects for one destination;
it never computes statistics. Methods default to doing nothing so a backend overrides only what
it needs. Writes happen on a background thread, one thread per backend.

A backend is one class plus a registry line: the class says itself whether its tracker has an
active run in this process (:meth:`Backend.detect`, for ``backends="auto"``), what that run is
called (:meth:`Backend.active_run_name`) and how to come from a Lightning logger
(:meth:`Backend.from_logger`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from tensorlens._checks import expected
from tensorlens.findings import Finding
from tensorlens.records import StepRecord


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
    """

    name: ClassVar[str] = "backend"
    supports_histograms: ClassVar[bool] = True
    supports_tensors: ClassVar[bool] = False
    main_process_only: ClassVar[bool] = True
    critical: ClassVar[bool] = False
    produces_findings: ClassVar[bool] = False

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


# name -> class, or "module:attribute" for integrations so the core never imports a vendor library
_REGISTRY: dict[str, type[Backend] | str] = {
    "local": "tensorlens.backends.local:LocalBackend",
    "memory": "tensorlens.backends.memory:MemoryBackend",
    "wandb": "tensorlens.integrations.wandb:WandbBackend",
    "mlflow": "tensorlens.integrations.mlflow:MLflowBackend",
    "tensorboard": "tensorlens.integrations.tensorboard:TensorBoardBackend",
}


def register_backend(name: str, backend: type[Backend]) -> None:
    """Make ``backends=[name]`` create ``backend()``.

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
