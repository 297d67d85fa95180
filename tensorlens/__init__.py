"""tensorlens: exact, compact statistics of a PyTorch model's tensors while it trains, sent to
the trackers you already use (W&B, MLflow, TensorBoard) and to a local run store.

>>> import tensorlens as tl
>>> hook = tl.watch(model)   # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

# The public names are bound on first use (PEP 562), not here: the commands that only read a
# stored run (ls, show, export, report, ...) import tensorlens.<something> and must not pay for
# torch (about 2 s) through this file. Each name maps to the module that defines it.
_LAZY: dict[str, str] = {
    "compare_runs": "tensorlens.analysis.compare",
    "explain": "tensorlens.analysis.explain",
    "create_trial": "tensorlens.analysis.trial",
    "Backend": "tensorlens.backends.base",
    "RunInfo": "tensorlens.backends.base",
    "register_backend": "tensorlens.backends.base",
    "registered_backends": "tensorlens.backends.base",
    "MemoryBackend": "tensorlens.backends.memory",
    "Hook": "tensorlens.capture.hook",
    "summarize_scalar": "tensorlens.capture.summaries",
    "summarize_tensor": "tensorlens.capture.summaries",
    "Collection": "tensorlens.collection",
    "Kind": "tensorlens.collection",
    "DynamicsConfig": "tensorlens.config",
    "HistogramConfig": "tensorlens.config",
    "ReductionConfig": "tensorlens.config",
    "SaveConfig": "tensorlens.config",
    "SaveConfigMode": "tensorlens.config",
    "Recorder": "tensorlens.engine.recorder",
    "setup": "tensorlens.file_limit",
    "Finding": "tensorlens.findings",
    "ModeKeys": "tensorlens.modes",
    "HistogramEntry": "tensorlens.records",
    "ScalarEntry": "tensorlens.records",
    "StepRecord": "tensorlens.records",
    "TensorEntry": "tensorlens.records",
    "explore": "tensorlens.reports",
    "report": "tensorlens.reports",
    "plot_scales": "tensorlens.scales",
    "prune_non_float_tensors": "tensorlens.scales",
    "prune_same_scale_tensors": "tensorlens.scales",
    "prune_selected_nodes": "tensorlens.scales",
    "track_scales": "tensorlens.scales",
    "CorruptRunError": "tensorlens.store.errors",
    "Run": "tensorlens.store.reader",
    "TensorDescriptor": "tensorlens.store.reader",
    "TensorView": "tensorlens.store.reader",
    "open_run": "tensorlens.store.reader",
    "Options": "tensorlens.options",
    "sync_run": "tensorlens.sync.replay",
    "watch": "tensorlens.watch",
}
#: Subpackages reachable as attributes (``tl.rules.DeadRelu``); ``integrations`` imports a vendor
#: library only when used.
_SUBMODULES = ("modes", "rules", "integrations")

if TYPE_CHECKING:  # what type checkers and editors see: the same names, imported eagerly
    from tensorlens import modes, rules
    from tensorlens.analysis.compare import compare_runs
    from tensorlens.analysis.explain import explain
    from tensorlens.analysis.trial import create_trial
    from tensorlens.backends.base import Backend, RunInfo, register_backend, registered_backends
    from tensorlens.backends.memory import MemoryBackend
    from tensorlens.capture.hook import Hook
    from tensorlens.capture.summaries import summarize_scalar, summarize_tensor
    from tensorlens.collection import Collection, Kind
    from tensorlens.config import DynamicsConfig, HistogramConfig, ReductionConfig, SaveConfig, SaveConfigMode
    from tensorlens.engine.recorder import Recorder
    from tensorlens.file_limit import setup
    from tensorlens.findings import Finding
    from tensorlens.modes import ModeKeys
    from tensorlens.options import Options
    from tensorlens.records import HistogramEntry, ScalarEntry, StepRecord, TensorEntry
    from tensorlens.reports import explore, report
    from tensorlens.scales import (
        plot_scales,
        prune_non_float_tensors,
        prune_same_scale_tensors,
        prune_selected_nodes,
        track_scales,
    )
    from tensorlens.store.errors import CorruptRunError
    from tensorlens.store.reader import Run, TensorDescriptor, TensorView, open_run
    from tensorlens.sync.replay import sync_run
    from tensorlens.watch import watch

from tensorlens._version import __version__ as __version__  # noqa: E402 (a leaf module: imports nothing)

__all__ = [
    "Backend",
    "Collection",
    "CorruptRunError",
    "DynamicsConfig",
    "Finding",
    "HistogramConfig",
    "HistogramEntry",
    "Hook",
    "Kind",
    "MemoryBackend",
    "ModeKeys",
    "Options",
    "Recorder",
    "ReductionConfig",
    "Run",
    "RunInfo",
    "SaveConfig",
    "SaveConfigMode",
    "ScalarEntry",
    "StepRecord",
    "TensorDescriptor",
    "TensorEntry",
    "TensorView",
    "compare_runs",
    "create_trial",
    "explain",
    "explore",
    "modes",
    "open_run",
    "plot_scales",
    "prune_non_float_tensors",
    "prune_same_scale_tensors",
    "prune_selected_nodes",
    "register_backend",
    "registered_backends",
    "report",
    "rules",
    "setup",
    "summarize_scalar",
    "summarize_tensor",
    "sync_run",
    "track_scales",
    "watch",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # once bound, later look-ups do not come here
        return value
    if name in _SUBMODULES or not name.startswith("_") and _is_submodule(name):
        # tl.scales.render_scales_png, tl.store.reader...: reachable as when this file imported them
        return importlib.import_module(f"tensorlens.{name}")
    raise AttributeError(f"module 'tensorlens' has no attribute {name!r}")


def _is_submodule(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(f"tensorlens.{name}") is not None
    except (ImportError, ValueError):
        return False


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))


class _Package(types.ModuleType):
    """The package's module type: importing the submodule ``tensorlens.watch`` binds the module
    as the package's attribute ``watch``, where ``tl.watch`` must stay the function (as it was
    when this file imported everything eagerly). A submodule named like a public name it
    defines is bound as that name instead."""

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == value.__name__ and hasattr(value, name):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
