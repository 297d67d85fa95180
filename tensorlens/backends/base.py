"""The backend base class and the name registry.

A backend only translates :class:`~tensorlens.records.StepRecord` objects for one destination;
it never computes statistics. Methods default to doing nothing so a backend overrides only what
it needs. Writes happen on a background thread, one thread per backend.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any, ClassVar

from tensorlens.config import expected
from tensorlens.records import StepRecord


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What a backend learns when the hook opens it."""

    run_name: str
    run_dir: str
    rank: int = 0
    world_size: int = 1
    config: dict[str, Any] = dataclasses.field(default_factory=dict)


class Backend:
    """Base class for destinations of records.

    Capability flags:

    - ``supports_histograms``: histograms are sent (else skipped by the dispatcher).
    - ``supports_tensors``: raw tensors are sent.
    - ``main_process_only``: created only on rank 0 of a distributed run.
    - ``critical``: the dispatcher waits for it instead of dropping records when it falls behind
      (the local store is critical; a tracker is not).
    """

    name: ClassVar[str] = "backend"
    supports_histograms: ClassVar[bool] = True
    supports_tensors: ClassVar[bool] = False
    main_process_only: ClassVar[bool] = True
    critical: ClassVar[bool] = False

    def open(self, run: RunInfo) -> None:  # noqa: B027 - optional hook
        """Called once, on the dispatcher's thread, before the first write."""

    def write(self, record: StepRecord) -> None:
        raise NotImplementedError

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
