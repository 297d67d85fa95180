"""Built-in rules on the progress of training: LossNotDecreasing, Overfit, Overtraining and
StalledTraining (SageMaker Debugger's names, parameters and defaults; SageMaker calls the last
one ``StalledTrainingRule``), and LossSpike, which tensorlens adds.

Losses are plain scalars: the ``losses`` collection (``criterion=`` / ``hook.register_loss``),
or any plain scalar chosen with ``collection_names`` / ``tensor_regex`` (``hook.save_scalar``).
Steps are counted in mode steps (the optimizer step in train mode, the evaluation step in eval).
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from typing import Any

from tensorlens._checks import expected
from tensorlens.findings import Finding
from tensorlens.modes import ModeKeys
from tensorlens.records import StepRecord
from tensorlens.rules.base import Rule
from tensorlens.rules.columns import columns
from tensorlens.rules.params import Selection, to_bool, to_float, to_int

#: What the loss rules say when a run recorded no loss.
NO_LOSS = ("no loss was recorded (pass the loss function: tl.watch(model, loss_fn) or hook.register_loss(loss_fn); "
           "the Lightning and Hugging Face callbacks record the loss their trainer reports)")

#: Modes whose losses follow training progress: a loss over eval steps compares batches of one
#: evaluation (the model does not change within it), so eval is read only when asked for.
_PROGRESS_MODES = (ModeKeys.TRAIN, ModeKeys.GLOBAL)


def _losses(record: StepRecord, selection: Selection, keep_nan: bool = False) -> list[tuple[str, float]]:
    """The plain scalars of a record that ``selection`` picks (NaN left out unless ``keep_nan``), in record order."""
    cols = columns(record)
    rows, at = cols.positions("")
    picked = cols.mask(selection, selection.matches)[rows]
    values = record.scalar_values[at[picked]].tolist()
    return [(cols.tensors[r], v) for r, v in zip(rows[picked].tolist(), values, strict=True) if keep_nan or v == v]


def _loss_selection(collection_names: Any, tensor_regex: Any, use_losses_collection: bool = True) -> Selection:
    chosen = Selection(collection_names, tensor_regex)
    if not use_losses_collection:
        return chosen
    losses = Selection("losses", None)
    return Selection(None, None, default=lambda t: losses.matches(t) or (chosen.given and chosen.matches(t)))


def _wanted(mode: ModeKeys | None, record: StepRecord) -> bool:
    """Whether a rule of ``mode`` (``None``: the modes that follow training) reads ``record``."""
    return record.mode == mode if mode is not None else record.mode in _PROGRESS_MODES


class _Window:
    """The losses of one window of ``num_steps`` mode steps: their sum, count and step span."""

    __slots__ = ("index", "total", "count", "first", "last")

    def __init__(self, index: int, step: int, loss: float) -> None:
        self.index, self.total, self.count, self.first, self.last = index, loss, 1, step, step

    def add(self, step: int, loss: float) -> None:
        self.total += loss
        self.count += 1
        self.last = step

    @property
    def mean(self) -> float:
        return self.total / self.count

    def describe(self) -> str:
        steps = f"step {self.first}" if self.first == self.last else f"steps {self.first}-{self.last}"
        return f"{self.mean:.6g} ({steps}, {self.count} value{'s' if self.count > 1 else ''})"


class LossNotDecreasing(Rule):
    """Fires when the mean loss of a window of ``num_steps`` steps did not go down enough from the
    previous window's: by less than ``diff_percent`` percent, or it rose by more than
    ``increase_threshold_percent`` percent (a smaller rise of a noisy loss is allowed).

    Windows tile the mode steps: ``[0, num_steps)``, ``[num_steps, 2 num_steps)``, ...; each holds
    the losses saved in it (a window without one is skipped). When a loss of a later window
    arrives, the window before is complete and its mean is compared with the mean of the last
    earlier window that holds a loss; the finding is made at that arriving record. A mean over a
    window is steadier than the single loss SageMaker compares, and is that loss when a window
    holds one save (``save_interval >= num_steps``).

    A rise must also stand out of the loss's own noise: exceed ``noise_tolerance`` standard errors
    of the difference of the two means, with the loss's noise estimated from the changes between
    consecutive saved losses (robustly: 1.4826 times their median absolute deviation, over
    ``sqrt(2)``; the last 32: the noise of the loss now, not of an earlier phase). A minibatch
    loss varies by tens of percent from batch to batch, so without this a healthy run fires; ``noise_tolerance=0`` compares the means alone, as SageMaker.
    Until five changes are known a rise is not judged (a noise read from fewer is a guess; a
    diverging loss rises by far more than 4 standard errors). Likewise a decrease below
    ``diff_percent`` counts only when the means resolve it: when ``noise_tolerance`` standard
    errors are below ``diff_percent`` of the loss (a stuck loss, the same at every step, has no
    noise; a noisy one that lands in the band by chance is not judged). ``mode``: only records of that mode;
    ``None``: train losses (global ones for records without a mode); eval losses only with
    ``mode="eval"``, as a window of eval steps compares batches of one evaluation.
    """

    needs = NO_LOSS

    def __init__(self, collection_names: Any = None, tensor_regex: Any = None, use_losses_collection: Any = True,
                 num_steps: Any = 10, diff_percent: Any = 0.1, increase_threshold_percent: Any = 5,
                 mode: ModeKeys | str | None = None, noise_tolerance: Any = 4.0, **kwargs: Any) -> None:
        self.collection_names, self.tensor_regex = collection_names, tensor_regex
        self.use_losses_collection = to_bool("use_losses_collection", use_losses_collection)
        self.num_steps = to_int("num_steps", num_steps, minimum=1)
        self.diff_percent = to_float("diff_percent", diff_percent, minimum=0.0, maximum=100.0)
        self.increase_threshold_percent = to_float("increase_threshold_percent", increase_threshold_percent, minimum=0.0)
        self.mode = None if mode is None else ModeKeys.coerce(mode)
        self.noise_tolerance = to_float("noise_tolerance", noise_tolerance, minimum=0.0)
        self._selection = _loss_selection(collection_names, tensor_regex, self.use_losses_collection)
        super().__init__(**kwargs)

    def reset(self) -> None:
        # (worker, mode, tensor) -> the window being filled, the last complete one, the last loss
        # and the latest changes between consecutive saved losses (the loss's noise)
        self._open: dict[tuple[str, str, str], _Window] = {}
        self._done: dict[tuple[str, str, str], _Window] = {}
        self._last: dict[tuple[str, str, str], float] = {}
        self._changes: dict[tuple[str, str, str], collections.deque[float]] = {}

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        if not _wanted(self.mode, record):
            return []
        out = []
        for tensor, loss in _losses(record, self._selection):
            self.mark_evaluated()
            if not math.isfinite(loss):
                continue  # an infinite loss is LossSpike's and ExplodingTensor's business, not a window's mean
            key = (record.worker, record.mode.value, tensor)
            if key in self._last:
                self._changes.setdefault(key, collections.deque(maxlen=32)).append(loss - self._last[key])
            self._last[key] = loss
            index = record.mode_step // self.num_steps
            window = self._open.get(key)
            if window is not None and index == window.index:
                window.add(record.mode_step, loss)
                continue
            if window is not None:  # the window before this loss is complete
                before = self._done.get(key)
                if before is not None:
                    found = self._compare(record, tensor, before, window, self._noise(key))
                    if found is not None:
                        out.append(found)
                self._done[key] = window
            self._open[key] = _Window(index, record.mode_step, loss)
        return out

    def _noise(self, key: tuple[str, str, str]) -> float | None:
        """The standard deviation of one saved loss around its trend, or ``None`` while unknown."""
        changes = self._changes.get(key, ())
        if len(changes) < 5:
            return None
        middle = statistics.median(changes)
        return 1.4826 * statistics.median(abs(c - middle) for c in changes) / math.sqrt(2.0)

    def _compare(self, record: StepRecord, tensor: str, before: _Window, now: _Window, noise: float | None) -> Finding | None:
        span = f"from {before.describe()} to {now.describe()}"
        if before.mean == 0:
            return None if now.mean <= 0 else self.finding(record, tensor, f"mean loss rose from 0: {span}", now.mean)
        decrease = 100.0 * (before.mean - now.mean) / abs(before.mean)
        error = None if noise is None else noise * math.sqrt(1.0 / now.count + 1.0 / before.count)
        if 0.0 <= decrease < self.diff_percent:
            band = self.diff_percent / 100.0 * abs(before.mean)
            if self.noise_tolerance > 0 and error is not None and self.noise_tolerance * error >= band:
                return None  # the means are too noisy to resolve diff_percent: landing below it is luck
            return self.finding(record, tensor, f"mean loss decreased by only {decrease:.3g}% {span} "
                                                f"(< diff_percent {self.diff_percent:g}%)", now.mean)
        if -decrease > self.increase_threshold_percent:
            rise = now.mean - before.mean
            if self.noise_tolerance > 0 and (error is None or rise <= self.noise_tolerance * error):
                return None  # within the loss's noise (or its noise is not known yet)
            beyond = "" if error is None else f", {rise / error:.3g} standard errors" if error > 0 else ", the loss had no noise"
            return self.finding(record, tensor, f"mean loss increased by {-decrease:.3g}% {span} "
                                                f"(> increase_threshold_percent {self.increase_threshold_percent:g}%{beyond})",
                                now.mean)
        return None


class LossSpike(Rule):
    """Fires when a loss jumps far above its own recent values, or stops being finite.

    Per loss, the last ``window`` finite saved values are its trailing behaviour: their median
    ``m`` and median absolute deviation ``MAD``. A loss ``x`` spikes when its robust z-score
    ``(x - m) / (1.4826 MAD)`` exceeds ``threshold`` *and* ``x > factor * m``: the z-score alone
    fires on a loss that barely moves (a MAD near 0), the ratio alone on a noisy one. Checked once
    ``min_history`` values are known. A NaN or infinite loss fires at once (ExplodingTensor sees
    it too; this finding marks the event, as ``tl.explain`` reads it). Once per spike: it fires
    again only after a loss back below the bar. ``mode`` as in :class:`LossNotDecreasing`.

    >>> R.LossSpike(window=50, threshold=8.0)   # doctest: +SKIP
    """

    needs = NO_LOSS

    def __init__(self, collection_names: Any = None, tensor_regex: Any = None, use_losses_collection: Any = True,
                 window: Any = 20, min_history: Any = 5, threshold: Any = 6.0, factor: Any = 2.0,
                 mode: ModeKeys | str | None = None, **kwargs: Any) -> None:
        self.collection_names, self.tensor_regex = collection_names, tensor_regex
        self.use_losses_collection = to_bool("use_losses_collection", use_losses_collection)
        self.window = to_int("window", window, minimum=2)
        self.min_history = to_int("min_history", min_history, minimum=2)
        if self.min_history > self.window:
            raise expected("min_history", f"<= window ({self.window})", min_history)
        self.threshold = to_float("threshold", threshold, minimum=0.0)
        self.factor = to_float("factor", factor, minimum=1.0)
        self.mode = None if mode is None else ModeKeys.coerce(mode)
        self._selection = _loss_selection(collection_names, tensor_regex, self.use_losses_collection)
        super().__init__(**kwargs)

    def reset(self) -> None:
        self._history: dict[tuple[str, str, str], collections.deque[float]] = {}
        self._spiking: set[tuple[str, str, str]] = set()

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        if not _wanted(self.mode, record):
            return []
        out = []
        for tensor, loss in _losses(record, self._selection, keep_nan=True):
            self.mark_evaluated()
            key = (record.worker, record.mode.value, tensor)
            history = self._history.setdefault(key, collections.deque(maxlen=self.window))
            found = self._check(record, tensor, loss, history)
            if found is None:
                self._spiking.discard(key)
            elif key not in self._spiking:
                self._spiking.add(key)
                out.append(found)
            if math.isfinite(loss):
                history.append(loss)
        return out

    def _check(self, record: StepRecord, tensor: str, loss: float, history: collections.deque[float]) -> Finding | None:
        if not math.isfinite(loss):
            before = f" (median {statistics.median(history):.4g} over the previous {len(history)} saved steps)" if history else ""
            return self.finding(record, tensor, f"loss is {loss}{before}", loss)
        if len(history) < self.min_history:
            return None
        median = statistics.median(history)
        mad = statistics.median(abs(v - median) for v in history)
        scale = 1.4826 * mad
        z = (loss - median) / scale if scale > 0 else (math.inf if loss > median else 0.0)
        if z > self.threshold and loss > self.factor * median:
            return self.finding(record, tensor, f"loss {loss:.4g} is {z:.3g} robust standard deviations above the median "
                                                f"{median:.4g} of the previous {len(history)} saved steps (> {self.threshold:g}, "
                                                f"and > {self.factor:g} x the median)", loss)
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

    needs = NO_LOSS

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
            self.mark_evaluated()
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

