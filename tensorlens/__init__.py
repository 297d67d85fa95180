"""tensorlens: exact, compact statistics of a PyTorch model's tensors while it trains, sent to
the trackers you already use (W&B, MLflow, TensorBoard) and to a local run store.

>>> import tensorlens as tl
>>> hook = tl.watch(model)   # doctest: +SKIP
"""

from __future__ import annotations

from tensorlens import modes, rules
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
from tensorlens.records import HistogramEntry, ScalarEntry, StepRecord, TensorEntry
from tensorlens.reports import explore, report
from tensorlens.rules.compare import compare_runs
from tensorlens.rules.trial import create_trial
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

__version__ = "0.1.0"

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
    # `tl.integrations` is imported on first use so `import tensorlens` never touches a vendor library
    if name == "integrations":
        import importlib

        return importlib.import_module("tensorlens.integrations")
    raise AttributeError(f"module 'tensorlens' has no attribute {name!r}")
