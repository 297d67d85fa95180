"""``tl.summarize_scalar`` and ``tl.summarize_tensor``: record values from inside ``forward``.

Both are no-ops when no hook is watching (one list lookup), so they can stay in model code.
Every live recorder registers in :mod:`tensorlens.engine.summary_targets` when it is created and
leaves when it is closed; values go to its public ``add_summary``. This module imports nothing of
the recorder (no import cycle).
"""

from __future__ import annotations

import torch

from tensorlens.engine import summary_targets


def summarize_scalar(name: str, value: float | torch.Tensor) -> None:
    """Record a number under ``summaries/<name>`` for the current step (if it is saved).

    A tensor stays on its device until the step's single host copy; several calls in one step
    are averaged.

    >>> summarize_scalar("attn_entropy", torch.tensor(0.7))  # no-op without a hook
    """
    if not summary_targets.any_live():
        return
    for target in summary_targets.live():
        target.add_summary(name, value, is_tensor=False)


def summarize_tensor(name: str, tensor: torch.Tensor) -> None:
    """Record statistics (and the raw tensor, if the ``summaries`` collection saves raw tensors)
    of ``tensor`` under ``summaries/<name>`` for the current step.

    >>> summarize_tensor("logits", torch.zeros(2, 3))  # no-op without a hook
    """
    if not summary_targets.any_live():
        return
    for target in summary_targets.live():
        target.add_summary(name, tensor, is_tensor=True)
