"""Training modes. Each mode keeps its own step counter (the *mode step*)."""

from __future__ import annotations

import enum


class ModeKeys(str, enum.Enum):
    """The phase a record belongs to, as in SageMaker Debugger's ``modes``."""

    TRAIN = "train"
    EVAL = "eval"
    PREDICT = "predict"
    GLOBAL = "global"
    #: Epoch aggregates (``hook.end_epoch()``): ``mode_step`` is the epoch, ``step`` the optimizer
    #: step at which the epoch ended. Never a mode to train in (``set_mode`` refuses it).
    EPOCH = "epoch"

    def __str__(self) -> str:  # "train", not "ModeKeys.TRAIN", in keys and messages
        return self.value

    @classmethod
    def coerce(cls, value: ModeKeys | str) -> ModeKeys:
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        raise ValueError(f"Expected `mode` to be one of {[m.value for m in cls]}, but got {value!r}")


TRAIN = ModeKeys.TRAIN
EVAL = ModeKeys.EVAL
PREDICT = ModeKeys.PREDICT
GLOBAL = ModeKeys.GLOBAL
EPOCH = ModeKeys.EPOCH
