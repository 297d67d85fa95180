"""The one key scheme of every tracker: one section per collection, the run's global values first.

Trackers group panels by a key's first path component (W&B's workspace sections, TensorBoard's
time-series groups, MLflow's chart groups), so that component is chosen to group well:

=============================================  ===============================================
what                                           key (``prefix="tensorlens"``, a train record)
=============================================  ===============================================
global dynamics (``dynamics/global``)          ``tensorlens/dynamics/global/grad_norm``
the step axis, derived global values           ``tensorlens/step``, ``tensorlens/nonfinite_count``
a statistic of a tensor                        ``tensorlens-gradients/fc1.weight/l2``
a tensor's histogram                           ``tensorlens-gradients/fc1.weight/histogram``
a plain value (loss, summary)                  ``tensorlens-losses/train_loss``
one panel holding every layer                  ``tensorlens-gradients/per-layer/l2``
=============================================  ===============================================

The section (first component) is ``<prefix>`` for the run's global values, so it sorts ahead of
every ``<prefix>-<collection>`` section, and ``<prefix>-<collection>`` for everything of one
collection: a user's own sections (``train/loss``) are never mixed with ours. Records of another
mode or of a single worker name both in the section: ``tensorlens-eval-activations/fc1/max``,
``tensorlens-worker_1-gradients/...``, ``tensorlens-epoch/dynamics/global/grad_norm_mean``
(an epoch record's ``epochs/<collection>/...`` tensors go into that collection's epoch section).
Train records need no mode part and the run's own worker (``worker_0``, or ``reduced`` for
statistics merged across ranks) no worker part. The documented name of every global and derived
statistic is therefore the key queried in a tracker (``tensorlens/dynamics/global/grad_norm``).

Parameter names and module paths never hold ``-``, so ``per-layer`` cannot collide with a tensor.
"""

from __future__ import annotations

from tensorlens.modes import ModeKeys

#: Workers whose records are the run's own (no worker part in their keys).
PRIMARY_WORKERS = ("worker_0", "reduced")
#: The tensor of the run's global dynamics: its keys go into the global section.
GLOBAL_TENSOR = "dynamics/global"
#: Joins the prefix, mode, worker and collection in a section name.
SECTION_SEPARATOR = "-"
#: The path part of a panel that holds one statistic of every layer of a collection.
PER_LAYER = "per-layer"
#: Epoch records name their tensors ``epochs/<tensor>`` (see :mod:`tensorlens.dispatch.epochs`).
_EPOCHS = "epochs/"


def key_parts(prefix: str, mode: ModeKeys | str, worker: str | None) -> list[str]:
    """The prefix, mode and worker parts of a record's section, in order.

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


def section(prefix: str, mode: ModeKeys | str, worker: str | None, collection: str | None = None) -> str:
    """The first path component of a record's keys: ``collection``'s section, or (``None``) the
    global one.

    >>> section("tensorlens", "train", "worker_0", "gradients"), section("tensorlens", "eval", None)
    ('tensorlens-gradients', 'tensorlens-eval')
    """
    parts = key_parts(prefix, mode, worker)
    if collection:
        parts.append(collection)
    return SECTION_SEPARATOR.join(parts)


def split_key(key: str) -> tuple[str | None, str]:
    """A record key as ``(collection, rest)``; the collection is ``None`` for the global dynamics.
    An epoch record's ``epochs/`` is dropped (its mode names it).

    >>> split_key("gradients/fc1.weight/l2"), split_key("dynamics/global/grad_norm")
    (('gradients', 'fc1.weight/l2'), (None, 'dynamics/global/grad_norm'))
    """
    if key.startswith(_EPOCHS):
        key = key[len(_EPOCHS):]
    if key == GLOBAL_TENSOR or key.startswith(GLOBAL_TENSOR + "/"):
        return None, key
    collection, _, rest = key.partition("/")
    return (collection, rest) if rest else (None, key)


def tracker_key(prefix: str, mode: ModeKeys | str, worker: str | None, key: str) -> str:
    """The full tracker key of a record key (``"gradients/fc1.weight/l2"``) or tensor name.

    >>> tracker_key("tensorlens", "train", "worker_0", "gradients/fc1.weight/l2")
    'tensorlens-gradients/fc1.weight/l2'
    >>> tracker_key("tensorlens", "train", "worker_0", "dynamics/global/grad_norm")
    'tensorlens/dynamics/global/grad_norm'
    """
    collection, rest = split_key(key)
    head = section(prefix, mode, worker, collection)
    return f"{head}/{rest}" if head else rest


def global_key(prefix: str, mode: ModeKeys | str, worker: str | None, name: str) -> str:
    """A key in the global section: the step axis, rule summaries, derived global values.

    >>> global_key("tensorlens", "train", None, "step"), global_key("tensorlens", "eval", None, "step")
    ('tensorlens/step', 'tensorlens-eval/step')
    """
    head = section(prefix, mode, worker)
    return f"{head}/{name}" if head else name


def panel_key(prefix: str, mode: ModeKeys | str, worker: str | None, collection: str, stat: str) -> str:
    """The key of the panel holding ``stat`` of every layer of ``collection``.

    >>> panel_key("tensorlens", "train", "worker_0", "gradients", "l2")
    'tensorlens-gradients/per-layer/l2'
    """
    return f"{section(prefix, mode, worker, collection)}/{PER_LAYER}/{stat}"


def histogram_key(prefix: str, mode: ModeKeys | str, worker: str | None, tensor: str) -> str:
    """The key of a tensor's histogram (``tensor`` as ``"gradients/fc1.weight"``).

    >>> histogram_key("tensorlens", "train", None, "gradients/fc1.weight")
    'tensorlens-gradients/fc1.weight/histogram'
    """
    return tracker_key(prefix, mode, worker, f"{tensor}/histogram")
