"""Replay a stored run into W&B, MLflow or TensorBoard: ``tensorlens sync RUN --to wandb``.

>>> from tensorlens.sync import sync_run
>>> sync_run("tensorlens_runs/exp1", "tensorboard", logdir="tb")   # doctest: +SKIP

See :mod:`tensorlens.sync.replay` (what is sent, in which order, how a second sync continues),
:mod:`tensorlens.sync.state` (what is kept in the run store) and :mod:`tensorlens.sync.target`.
"""

from __future__ import annotations

from tensorlens.sync.replay import SyncError, SyncResult, sync_run
from tensorlens.sync.target import SyncTarget, register_sync_target, sync_target_names

__all__ = ["SyncError", "SyncResult", "SyncTarget", "register_sync_target", "sync_run", "sync_target_names"]
