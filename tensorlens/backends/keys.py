"""The one key scheme of every tracker: ``<prefix>/[<mode>/][<worker>/]<collection>/<tensor>/<stat>``.

Train records need no mode part and the run's own worker (``worker_0``, or ``reduced`` for
statistics merged across ranks) no worker part, so a single-process run reads
``tensorlens/gradients/fc1.weight/l2``; an eval record ``tensorlens/eval/...``; rank 1 of a run
recorded with ``include_workers="all"`` (replayed by ``tensorlens sync``) ``tensorlens/worker_1/...``.
"""

from __future__ import annotations

from tensorlens.modes import ModeKeys

#: Workers whose records are the run's own (no worker part in their keys).
PRIMARY_WORKERS = ("worker_0", "reduced")


def key_parts(prefix: str, mode: ModeKeys | str, worker: str | None) -> list[str]:
    """The parts before a record's keys.

    >>> key_parts("tensorlens", "eval", "worker_1")
    ['tensorlens', 'eval', 'worker_1']
    """
    parts = [prefix] if prefix else []
    mode = ModeKeys.coerce(mode)
    if mode != ModeKeys.TRAIN:
        parts.append(str(mode))
    if worker is not None and worker not in PRIMARY_WORKERS:
        parts.append(worker)
    return parts


def tracker_key(prefix: str, mode: ModeKeys | str, worker: str | None, key: str) -> str:
    """The full tracker key of a record key (``"gradients/fc1.weight/l2"``).

    >>> tracker_key("tensorlens", "train", "worker_0", "gradients/fc1.weight/l2")
    'tensorlens/gradients/fc1.weight/l2'
    """
    return "/".join([*key_parts(prefix, mode, worker), key])
