"""Built-in rules on the progress of training: LossNotDecreasing, Overfit, Overtraining and
StalledTraining (SageMaker Debugger's names, parameters and defaults; SageMaker calls the last
one ``StalledTrainingRule``).

Losses are plain scalars: the ``losses`` collection (``criterion=`` / ``hook.register_loss``),
or any plain scalar chosen with ``collection_names`` / ``tensor_regex`` (``hook.save_scalar``).
Steps are counted in mode steps (the optimizer step in train mode, the evaluation step in eval).
"""

from __future__ import annotations

import time
from typing import Any

from tensorlens.findings import Finding
from tensorlens.modes import ModeKeys
from tensorlens.records import StepRecord
from tensorlens.rules.base import Rule
from tensorlens.rules.columns import columns
from tensorlens.rules.params import Selection, to_bool, to_float, to_int


def _losses(record: StepRecord, selection: Selection) -> list[tuple[str, float]]:
    """The plain scalars of a record that ``selection`` picks (NaN left out), in record order."""
    cols = columns(record)
    rows, at = cols.positions("")
    picked = cols.mask(selection, selection.matches)[rows]
    values = record.scalar_values[at[picked]].tolist()
    return [(cols.tensors[r], v) for r, v in zip(rows[picked].tolist(), values, strict=True) if v == v]


def _loss_selection(collection_names: Any, tensor_regex: Any, use_losses_collection: bool = True) -> Selection:
    chosen = Selection(collection_names, tensor_regex)
    if not use_losses_collection:
        return chosen
    losses = Selection("losses", None)
    return Selection(None, None, default=lambda t: losses.matches(t) or (chosen.given and chosen.matches(t)))


class LossNotDecreasing(Rule):
    """Fires when the loss did not go down over ``num_steps`` steps.

    Every ``num_steps`` steps (at the first saved step at least ``num_steps`` after the last
    check) the loss is compared with the loss at the newest saved step at least ``num_steps``
    earlier. It fires when it decreased by less than ``diff_percent`` percent, or when it rose by
    more than ``increase_threshold_percent`` percent; a rise up to that much is allowed (a noisy
    loss), as SageMaker's parameter describes. ``mode``: only records of that mode; ``None``
    checks each mode's loss on its own.
    """

    def __init__(self, collection_names: Any = None, tensor_regex: Any = None, use_losses_collection: Any = True,
                 num_steps: Any = 10, diff_percent: Any = 0.1, increase_threshold_percent: Any = 5,
                 mode: ModeKeys | str | None = None, **kwargs: Any) -> None:
        self.collection_names, self.tensor_regex = collection_names, tensor_regex
        self.use_losses_collection = to_bool("use_losses_collection", use_losses_collection)
        self.num_steps = to_int("num_steps", num_steps, minimum=1)
        self.diff_percent = to_float("diff_percent", diff_percent, minimum=0.0, maximum=100.0)
        self.increase_threshold_percent = to_float("increase_threshold_percent", increase_threshold_percent, minimum=0.0)
        self.mode = None if mode is None else ModeKeys.coerce(mode)
        self._selection = _loss_selection(collection_names, tensor_regex, self.use_losses_collection)
        super().__init__(**kwargs)

    def reset(self) -> None:
        # (worker, mode, tensor) -> saved (mode step, loss) and the mode step of the last check
        self._history: dict[tuple[str, str, str], list[tuple[int, float]]] = {}
        self._checked: dict[tuple[str, str, str], int] = {}

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        if self.mode is not None and record.mode != self.mode:
            return []
        out = []
        for tensor, loss in _losses(record, self._selection):
            key = (record.worker, record.mode.value, tensor)
            history = self._history.setdefault(key, [])
            step = record.mode_step
            if key not in self._checked:
                self._checked[key] = step
            elif step >= self._checked[key] + self.num_steps:
                base = [(s, v) for s, v in history if s <= step - self.num_steps]
                if base:
                    found = self._compare(record, tensor, base[-1], loss)
                    if found is not None:
                        out.append(found)
                    self._checked[key] = step
                    del history[: history.index(base[-1])]  # older steps can never be the base again
            history.append((step, loss))
        return out

    def _compare(self, record: StepRecord, tensor: str, base: tuple[int, float], loss: float) -> Finding | None:
        base_step, base_loss = base
        if base_loss == 0:
            return None if loss <= 0 else self.finding(record, tensor, f"loss rose from 0 at step {base_step} to {loss:.6g}", loss)
        decrease = 100.0 * (base_loss - loss) / abs(base_loss)
        span = f"from {base_loss:.6g} at step {base_step} to {loss:.6g}"
        if 0.0 <= decrease < self.diff_percent:
            return self.finding(record, tensor, f"loss decreased by only {decrease:.3g}% {span} (< diff_percent {self.diff_percent:g}%)", loss)
        if -decrease > self.increase_threshold_percent:
            return self.finding(record, tensor, f"loss increased by {-decrease:.3g}% {span} "
                                                f"(> increase_threshold_percent {self.increase_threshold_percent:g}%)", loss)
        return None


class Overfit(Rule):
    """Fires when the validation loss exceeds the training loss by more than ``ratio_threshold``
    (``(mean eval loss - mean train loss) / mean train loss``) for ``patience`` evaluations in a row.

    An evaluation is a run of consecutive eval records; it is compared, when it ends (the next
    train record, or the end of the run), with the train losses saved since the previous one.
    Steps before ``start_step`` are left out. Train and eval losses are paired by tensor name.
    """

    def __init__(self, tensor_regex: Any = None, start_step: Any = 0, patience: Any = 1, ratio_threshold: Any = 0.1,
                 **kwargs: Any) -> None:
        self.tensor_regex = tensor_regex
        self.start_step = to_int("start_step", start_step)
        self.patience = to_int("patience", patience, minimum=1)
        self.ratio_threshold = to_float("ratio_threshold", ratio_threshold)
        self._selection = _loss_selection(None, tensor_regex)
        super().__init__(**kwargs)

    def reset(self) -> None:
        self._train: dict[tuple[str, str], list[float]] = {}
        self._last_train: dict[tuple[str, str], float] = {}
        self._eval: dict[tuple[str, str], tuple[list[float], StepRecord]] = {}
        self._exceeded: dict[tuple[str, str], int] = {}

    def _close(self, key: tuple[str, str]) -> Finding | None:
        losses, last = self._eval.pop(key)
        train = self._train.pop(key, [])
        if train:
            self._last_train[key] = sum(train) / len(train)
        mean_train = self._last_train.get(key)
        if mean_train is None or mean_train == 0:
            return None
        mean_eval = sum(losses) / len(losses)
        ratio = (mean_eval - mean_train) / abs(mean_train)
        self._exceeded[key] = self._exceeded.get(key, 0) + 1 if ratio > self.ratio_threshold else 0
        if self._exceeded[key] >= self.patience:
            return self.finding(last, key[1], f"validation loss {mean_eval:.6g} exceeds training loss {mean_train:.6g} by "
                                              f"{ratio:.1%} (> {self.ratio_threshold:g}) for {self._exceeded[key]} evaluation(s)", ratio)
        return None

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        out = []
        if record.mode in (ModeKeys.TRAIN, ModeKeys.GLOBAL):
            for key in [k for k in self._eval if k[0] == record.worker]:
                found = self._close(key)
                if found is not None:
                    out.append(found)
        if record.step < self.start_step:
            return out
        for tensor, loss in _losses(record, self._selection):
            key = (record.worker, tensor)
            if record.mode in (ModeKeys.TRAIN, ModeKeys.GLOBAL):
                self._train.setdefault(key, []).append(loss)
            elif record.mode == ModeKeys.EVAL:
                losses, _ = self._eval.get(key, ([], record))
                self._eval[key] = ([*losses, loss], record)
        return out

    def finish(self) -> list[Finding]:
        return [f for f in (self._close(key) for key in list(self._eval)) if f is not None]


class Overtraining(Rule):
    """Fires when the training loss has not improved by more than ``delta`` for ``patience_train``
    saved train steps, or the validation loss for ``patience_validation`` saved eval steps: the
    model has stopped improving, so more training risks overfitting. Once per plateau: it fires
    again only after the loss improved and stalled anew.
    """

    def __init__(self, patience_train: Any = 5, patience_validation: Any = 10, delta: Any = 0.01, tensor_regex: Any = None,
                 **kwargs: Any) -> None:
        self.patience_train = to_int("patience_train", patience_train, minimum=1)
        self.patience_validation = to_int("patience_validation", patience_validation, minimum=1)
        self.delta = to_float("delta", delta, minimum=0.0)
        self.tensor_regex = tensor_regex
        self._selection = _loss_selection(None, tensor_regex)
        super().__init__(**kwargs)

    def reset(self) -> None:
        self._best: dict[tuple[str, str, str], tuple[float, int, bool]] = {}  # (best, steps since, fired)

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        if record.mode == ModeKeys.EVAL:
            patience, what = self.patience_validation, "validation"
        elif record.mode in (ModeKeys.TRAIN, ModeKeys.GLOBAL):
            patience, what = self.patience_train, "training"
        else:
            return []
        out = []
        for tensor, loss in _losses(record, self._selection):
            key = (record.worker, record.mode.value, tensor)
            best, since, fired = self._best.get(key, (None, 0, False))
            if best is None or best - loss > self.delta:
                best, since, fired = loss, 0, False
            else:
                since += 1
                if since >= patience and not fired:
                    fired = True
                    out.append(self.finding(record, tensor, f"{what} loss has not improved by more than {self.delta:g} "
                                                            f"for {since} saved steps (best {best:.6g})", loss))
            self._best[key] = (best, since, fired)
        return out


class StalledTraining(Rule):
    """Fires when no record has arrived for ``threshold`` seconds: online, while training is
    silent (checked between records), and offline, at the first record after such a gap.

    Records come only on saved steps, so ``threshold`` must exceed the time between two saves.
    ``stop_training_on_fire=True`` sets ``action="stop"``. (SageMaker's
    ``training_job_name_prefix``, used to find the job to stop, has no use here: the hook is the job.)
    """

    def __init__(self, threshold: Any = 1800, stop_training_on_fire: Any = False, **kwargs: Any) -> None:
        self.threshold = to_float("threshold", threshold, minimum=0.0)
        self.stop_training_on_fire = to_bool("stop_training_on_fire", stop_training_on_fire)
        if self.stop_training_on_fire:
            kwargs["action"] = "stop"
        self.idle_poll = max(0.01, min(self.threshold / 4.0, 10.0))
        super().__init__(**kwargs)

    def reset(self) -> None:
        self._last: StepRecord | None = None
        self._fired = False  # for the current silence

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        out = []
        last = self._last
        if last is not None and not self._fired and record.wall_time - last.wall_time > self.threshold:
            gap = record.wall_time - last.wall_time
            out.append(self.finding(record, None, f"no record for {gap:.3g} s before this step (threshold {self.threshold:g} s)", gap))
        self._last, self._fired = record, False
        return out

    def check_idle(self, now: float | None = None) -> list[Finding]:
        last = self._last
        now = time.time() if now is None else now
        if last is None or self._fired or now - last.wall_time <= self.threshold:
            return []
        self._fired = True
        gap = now - last.wall_time
        return [self.finding(last, None, f"no record for {gap:.3g} s since this step (threshold {self.threshold:g} s): "
                                         "training looks stalled", gap)]

