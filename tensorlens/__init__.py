"""tensorlens: exact, compact statistics of a PyTorch model's tensors while it trains, sent to
the trackers you already use (W&B, MLflow, TensorBoard) and to a local run store.

>>> import tensorlens as tl
>>> hook = tl.watch(model)   # doctest: +SKIP
"""

from __future__ import annotations

from tensorlens import modes
from tensorlens.backends.base import Backend, RunInfo, register_backend, registered_backends
from tensorlens.backends.memory import MemoryBackend
from tensorlens.capture.hook import Hook
from tensorlens.capture.summaries import summarize_scalar, summarize_tensor
from tensorlens.collection import Collection, Kind
from tensorlens.config import DynamicsConfig, HistogramConfig, ReductionConfig, SaveConfig, SaveConfigMode
from tensorlens.engine.recorder import Recorder
from tensorlens.file_limit import setup
from tensorlens.modes import ModeKeys
from tensorlens.records import HistogramEntry, ScalarEntry, StepRecord, TensorEntry
from tensorlens.store.reader import Run, TensorDescriptor, TensorView, open_run
from tensorlens.watch import watch

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "Collection",
    "DynamicsConfig",
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
    "modes",
    "open_run",
    "register_backend",
    "registered_backends",
    "setup",
    "summarize_scalar",
    "summarize_tensor",
    "watch",
]


def __getattr__(name: str) -> object:
    # `tl.integrations` is imported on first use so `import tensorlens` never touches a vendor library
    if name == "integrations":
        import importlib

        return importlib.import_module("tensorlens.integrations")
    raise AttributeError(f"module 'tensorlens' has no attribute {name!r}")
