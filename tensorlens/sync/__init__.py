"""Replay a stored run into W&B, MLflow or TensorBoard: ``tensorlens sync RUN --to wandb``.

>>> from tensorlens.sync import sync_run
>>> sync_run("tensorlens_runs/exp1", "tensorboard", logdir="tb")   # doctest: +SKIP

See :mod:`tensorlens.sync.replay` (what is sent, in which order, how a second sync continues),
:mod:`tensorlens.sync.state` (what was sent where, kept beside the run store, which sync only
reads), :mod:`tensorlens.sync.lock` (one sync per run and destination),
:mod:`tensorlens.sync.signals` (SIGTERM, Ctrl-C) and :mod:`tensorlens.sync.target`.
"""

from __future__ import annotations

from tensorlens.sync.errors import SyncBusyError, SyncError, SyncTerminated
from tensorlens.sync.replay import SyncResult, sync_run
from tensorlens.sync.target import SyncTarget, register_sync_target, sync_target_names

__all__ = [
    "SyncBusyError", "SyncError", "SyncResult", "SyncTarget", "SyncTerminated", "register_sync_target", "sync_run",
    "sync_target_names",
]
