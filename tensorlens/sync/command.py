"""The ``tensorlens sync`` command's behaviour, whatever parses its arguments: run the sync and
say in a few lines what went where and what to do next (``wandb sync ...`` for an offline run).

>>> print("\\n".join(run_sync("tensorlens_runs/exp1", "tensorboard", logdir="tb")))   # doctest: +SKIP
tensorlens sync: 40 new records of tensorlens_runs/exp1 sent to tensorboard:/abs/tb (run exp1), 0 there already
TensorBoard events in /abs/tb/exp1
  tensorboard --logdir /abs/tb
"""

from __future__ import annotations

import os
from typing import Any

from tensorlens.sync.replay import SyncError, sync_run


class SyncFailed(Exception):
    """An error to show as one line, without a traceback (a wrong path or option, a tracker
    that is not installed or not reachable)."""


def run_sync(run: str, to: str, **options: Any) -> list[str]:
    """Run :func:`tensorlens.sync.sync_run` and describe the result; expected failures become
    :class:`SyncFailed` with the reason."""
    try:
        result = sync_run(run, to, **options)
    except (SyncError, FileNotFoundError, PermissionError, ImportError, ValueError) as err:
        raise SyncFailed(str(err)) from err
    what = f"{result.records_sent} new record{'s' if result.records_sent != 1 else ''}"
    if result.findings_sent:
        what += f" and {result.findings_sent} rule finding{'s' if result.findings_sent != 1 else ''}"
    verb = "created" if result.new_run else "continued"
    lines = [
        f"tensorlens sync: {what} of {os.path.normpath(run)} sent to {result.target} "
        f"({verb} run {result.run_id}); {result.already_sent} were there already"
    ]
    if result.sent:
        lines.append("  " + ", ".join(f"{mode}/{worker}: {n}" for (mode, worker), n in sorted(result.sent.items())))
    return lines + result.lines
