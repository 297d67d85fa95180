"""Adapters for optional libraries, installed as ``tensorlens.integrations``.

Each submodule imports its vendor library lazily and, if it is missing, raises an ImportError
naming the extra to install (``pip install 'tensorlens[wandb]'``). Submodules are imported on
first attribute access, so ``tl.integrations.mlflow.MLflowBackend`` works without an import.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_SUBMODULES = ("wandb", "mlflow", "tensorboard", "lightning", "pytorch_lightning", "transformers")


def __getattr__(name: str) -> ModuleType:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_SUBMODULES])
