"""A recorder's step counters: the optimizer steps taken (``global_step``, Lightning's) and the
steps of each mode (train, eval, predict, global, and the epochs ``end_epoch`` closes).

The save schedule is asked about ``(mode, mode step)``; a resumed run goes on after the last steps
its store holds, so nothing stored is overwritten.
"""

from __future__ import annotations

import os

from tensorlens._checks import expected
from tensorlens.modes import ModeKeys
from tensorlens.store.files import last_steps


class StepCounters:
    """``global_step`` and ``mode_steps[mode]``, set, advanced and continued.

    >>> counters = StepCounters()
    >>> counters.advance(ModeKeys.TRAIN); counters.global_step, counters.mode_steps[ModeKeys.TRAIN]
    (1, 1)
    """

    def __init__(self) -> None:
        self.global_step = 0  # optimizer steps taken (Lightning's global_step)
        self.mode_steps = dict.fromkeys(ModeKeys, 0)

    def set(self, global_step: int, mode_steps: dict[ModeKeys | str, int] | None = None) -> None:
        """See :meth:`Recorder.set_step <tensorlens.engine.recorder.Recorder.set_step>`."""
        if isinstance(global_step, bool) or not isinstance(global_step, int) or global_step < 0:
            raise expected("global_step", "an integer >= 0", global_step)
        self.global_step = global_step
        self.mode_steps[ModeKeys.TRAIN] = global_step
        for mode, value in (mode_steps or {}).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise expected(f"mode_steps[{mode!r}]", "an integer >= 0", value)
            self.mode_steps[ModeKeys.coerce(mode)] = value

    def advance(self, mode: ModeKeys) -> None:
        """A step of ``mode`` is closed (a train or global step is an optimizer step)."""
        self.global_step += 1
        self.mode_steps[mode] += 1
        if mode != ModeKeys.TRAIN:
            self.mode_steps[ModeKeys.TRAIN] = self.global_step

    def end_epoch(self, epoch: int | None) -> int:
        """The epoch being closed (``None``: one more than the last), counted."""
        if epoch is None:
            epoch = self.mode_steps[ModeKeys.EPOCH]
        elif isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise expected("epoch", "None or an integer >= 0", epoch)
        self.mode_steps[ModeKeys.EPOCH] = epoch + 1
        return epoch

    def continue_stored(self, run_dir: str, store_file: str) -> None:
        """Go on after the last steps stored in ``run_dir``'s ``store_file``; ``set_step`` sets
        the true step (the Lightning callback does it from the trainer)."""
        found = {ModeKeys.coerce(m): last for m, last in last_steps(os.path.join(run_dir, store_file)).items()}
        if ModeKeys.TRAIN in found:
            self.global_step = found[ModeKeys.TRAIN] + 1
        self.mode_steps.update({mode: last + 1 for mode, last in found.items()})
        self.mode_steps[ModeKeys.TRAIN] = self.global_step
