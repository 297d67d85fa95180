"""Deprecated: the sync targets of the built-in trackers, kept so code that built one goes on working.

A tracker replays through its backend class now (one extension point per tracker): the
``replay_*`` class methods of :class:`~tensorlens.integrations.wandb.WandbBackend`,
:class:`~tensorlens.integrations.mlflow.MLflowBackend` and
:class:`~tensorlens.integrations.tensorboard.TensorBoardBackend`, used by ``sync_run(run, "wandb",
project=...)``. Each class here is a :class:`~tensorlens.sync.target.SyncTarget` bound to one of
them, ``MLflowTarget(tracking_uri=...)`` being ``SyncTarget("mlflow", tracking_uri=...)``, with
the options readable as attributes (``target.tracking_uri``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from tensorlens.integrations._mlflow_replay import DEFAULT_EXPERIMENT as DEFAULT_MLFLOW_EXPERIMENT
from tensorlens.integrations._mlflow_replay import SYNC_ENVIRONMENT as MLFLOW_SYNC_ENVIRONMENT
from tensorlens.integrations._wandb_replay import DEFAULT_PROJECT as DEFAULT_WANDB_PROJECT
from tensorlens.sync.target import SyncTarget

__all__ = [
    "DEFAULT_MLFLOW_EXPERIMENT", "DEFAULT_WANDB_PROJECT", "MLFLOW_SYNC_ENVIRONMENT", "MLflowTarget", "TensorBoardTarget",
    "WandbTarget",
]


class _BoundTarget(SyncTarget):
    def __init__(self, **options: Any) -> None:
        super().__init__(None, **options)

    def __getattr__(self, attribute: str) -> Any:
        # only for names that are not attributes: the options (target.logdir, target.project)
        options = self.__dict__.get("replay")
        if options is not None and attribute in options.options:
            return options.options[attribute]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {attribute!r}")


class WandbTarget(_BoundTarget):
    backend: ClassVar[str | None] = "wandb"


class MLflowTarget(_BoundTarget):
    backend: ClassVar[str | None] = "mlflow"


class TensorBoardTarget(_BoundTarget):
    backend: ClassVar[str | None] = "tensorboard"
