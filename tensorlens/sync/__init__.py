"""Replay a stored run into any registered backend that replays: ``tensorlens sync RUN --to NAME``.

>>> from tensorlens.sync import sync_run
>>> sync_run("tensorlens_runs/exp1", "tensorboard", logdir="tb")   # doctest: +SKIP

A tracker is one :class:`~tensorlens.backends.base.Backend` class, registered once with
``tl.register_backend(name, cls)``: it records live and replays (its ``replay_*`` class methods;
the defaults make any backend replayable). See :mod:`tensorlens.sync.replay` (what is sent, in
which order, how a second sync continues), :mod:`tensorlens.sync.state` (what was sent where and
the tracker run to continue, kept beside the run store, which sync only reads),
:mod:`tensorlens.sync.lock` (one sync per run and destination), :mod:`tensorlens.sync.signals`
(SIGTERM, Ctrl-C) and :mod:`tensorlens.sync.target` (one destination: a backend and its options;
``register_sync_target`` is a deprecated alias of ``tl.register_backend``).
"""

from __future__ import annotations

from tensorlens.sync.errors import SyncBusyError, SyncError, SyncTerminated
from tensorlens.sync.replay import SyncResult, sync_run
from tensorlens.sync.target import SyncTarget, register_sync_target, sync_target_names

__all__ = [
    "SyncBusyError", "SyncError", "SyncResult", "SyncTarget", "SyncTerminated", "register_sync_target", "sync_run",
    "sync_target_names",
]
