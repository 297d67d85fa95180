"""``tl.summarize_scalar`` and ``tl.summarize_tensor``: record values from inside ``forward``.

Both are no-ops when no hook is watching (one list lookup), so they can stay in model code.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tensorlens.capture.hook import Hook

_active: list[weakref.ref[Hook]] = []
_lock = threading.Lock()


def activate(hook: Hook) -> None:
    with _lock:
        _active.append(weakref.ref(hook))


def deactivate(hook: Hook) -> None:
    with _lock:
        _active[:] = [ref for ref in _active if ref() is not None and ref() is not hook]


def _hooks() -> list[Hook]:
    return [hook for hook in (ref() for ref in list(_active)) if hook is not None]


def summarize_scalar(name: str, value: float | torch.Tensor) -> None:
    """Record a number under ``summaries/<name>`` for the current step (if it is saved).

    A tensor stays on its device until the step's single host copy; several calls in one step
    are averaged.

    >>> summarize_scalar("attn_entropy", torch.tensor(0.7))  # no-op without a hook
    """
    if not _active:
        return
    for hook in _hooks():
        hook._summary(name, value, is_tensor=False)


def summarize_tensor(name: str, tensor: torch.Tensor) -> None:
    """Record statistics (and the raw tensor, if the ``summaries`` collection saves raw tensors)
    of ``tensor`` under ``summaries/<name>`` for the current step.

    >>> summarize_tensor("logits", torch.zeros(2, 3))  # no-op without a hook
    """
    if not _active:
        return
    for hook in _hooks():
        hook._summary(name, tensor, is_tensor=True)
