"""The losses a framework hands its callbacks, and the names they are recorded under.

A loss is recorded as ``losses/<name>`` in the mode of its record (train or eval), the way
``tl.watch(model, loss_fn)`` records one loss module in both modes: a framework's training loss
is ``losses/loss`` in train records, its validation loss ``losses/loss`` in eval records, so
the rules that pair them (:class:`~tensorlens.rules.Overfit`) and the report find them under one
name. A validation loss logged under a name of its own (``val_recon_loss``) keeps that name
without the evaluation's prefix (``recon_loss``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

#: The loss a training step returns (Lightning's ``"loss"`` key, the Trainer's logged ``loss``).
LOSS_NAME = "loss"
# "val_loss", "val/loss", "validation-loss", "test_loss", "eval_loss" ... and "loss/val", "loss_val"
_EVALUATION_AFFIX = re.compile(r"^(?:val|valid|validation|test|eval)(?:[_/.\-]+|(?=[A-Z]))|[_/.\-]+(?:val|valid|validation|test|eval)$")


def returned_loss(outputs: Any) -> torch.Tensor | None:
    """The loss a step returned: a tensor of one value, or a mapping's ``"loss"`` (Lightning's
    convention); ``None`` for anything else (no loss, predictions).

    >>> float(returned_loss({"loss": torch.tensor(0.5), "acc": 1.0}))
    0.5
    """
    if isinstance(outputs, Mapping):
        outputs = outputs.get(LOSS_NAME)
    if isinstance(outputs, torch.Tensor) and outputs.numel() == 1 and outputs.is_floating_point():
        return outputs
    return None


def eval_loss_name(key: str) -> str | None:
    """The name an evaluation's logged metric ``key`` is recorded under, or ``None`` when it is no
    loss: a name holding ``loss``, without its evaluation prefix or suffix. Lightning's per-batch
    copy of a metric logged on both step and epoch (``val_loss_step``) is left out; its epoch
    aggregate (``val_loss_epoch``) is the loss.

    >>> [eval_loss_name(k) for k in ("val_loss", "val/loss", "loss/val", "val_recon_loss", "val_acc", "val_loss_epoch")]
    ['loss', 'loss', 'loss', 'recon_loss', None, 'loss']
    """
    if "loss" not in key.lower() or key.endswith("_step"):
        return None
    name = _EVALUATION_AFFIX.sub("", key.removesuffix("_epoch"))
    return name or LOSS_NAME
