"""Built-in rules on gradients and updates: VanishingGradient and WeightUpdateRatio (SageMaker
Debugger's names, parameters and defaults), and NonFiniteGradient, UpdateRatioOutOfRange and
GradientNormSpike, which no peer has but tensorlens' exact statistics allow.
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Any

import numpy as np

from tensorlens._checks import expected
from tensorlens.findings import Finding
from tensorlens.records import StepRecord
from tensorlens.rules import bounds
from tensorlens.rules.base import Rule
from tensorlens.rules.columns import Columns, columns, count
from tensorlens.rules.params import Selection, kind_of, tensor_stats, to_float, to_int

_UPDATES_HINT = (
    "enable the 'updates' collection (include_collections=[..., 'updates']): its l2 over the weight's l2 is the "
    "ratio; or record dynamics/<param>/update_ratio"
)


#: What the gradient rules say when a run recorded no gradient.
NO_GRADIENT = ("no gradient was recorded (the 'gradients' collection, recorded by default: check collections= / "
               "include_collections=, and that the optimizer stepped on a saved step)")
#: What the update-ratio rules say when a run recorded no update size.
NO_UPDATE = ("no update size was recorded (tl.watch(model, dynamics=True) records dynamics/<param> update_ratio; "
             "or add the 'updates' collection)")

_GRADIENTS_KIND, _GRADIENTS_PREFIX = ("kind", "gradients"), ("prefix", "gradients/")


def _in_gradients(tensor: str) -> bool:
    return tensor.startswith("gradients/")


def _is_gradient(tensor: str) -> bool:
    return kind_of(tensor) == "gradients"


def _chosen_gradients(cols: Columns, selection: Selection) -> np.ndarray:
    """Which tensors of a layout are gradients that ``selection`` picks (a fresh array)."""
    return cols.mask(_GRADIENTS_KIND, _is_gradient) & cols.mask(selection, selection.matches)


def update_ratios(record: StepRecord, kinds: tuple[str, ...] = ("weights",)) -> dict[str, tuple[float, float, str]]:
    """``{parameter: (update l2, weight l2, source)}`` of the parameters of ``kinds`` in a record:
    ``dynamics/<p>``'s ``update_l2`` and ``update_ratio`` when recorded, else ``updates/<p>`` l2
    and ``<kind>/<p>`` l2 (the weight as read before the optimizer step, the update that step made)."""
    stats = tensor_stats(record)
    out: dict[str, tuple[float, float, str]] = {}
    for tensor, values in stats.items():
        kind, _, param = tensor.partition("/")
        if kind not in kinds or "l2" not in values:
            continue
        dynamics = stats.get(f"dynamics/{param}", {})
        if "update_ratio" in dynamics:
            ratio = dynamics["update_ratio"]
            out[param] = (ratio * values["l2"], values["l2"], "dynamics update_ratio")
        elif "l2" in stats.get(f"updates/{param}", {}):
            out[param] = (stats[f"updates/{param}"]["l2"], values["l2"], "updates l2 / weights l2")
    return out


class VanishingGradient(Rule):
    """Fires for a gradient whose mean of absolute values is below ``threshold``.

    Exact when ``abs_mean`` or ``l1`` is recorded for gradients (``ReductionConfig(abs_reductions=["mean"])``
    or ``norms=["l1", "l2"]``). With the defaults (``l2``) it uses the root mean square
    ``l2 / sqrt(numel)``, which is never below the mean of absolute values: it fires only when the
    mean of absolute values is surely below ``threshold`` (and may miss a gradient whose root mean
    square is just above it).
    """

    needs = NO_GRADIENT

    def __init__(self, threshold: Any = 0.0000001, tensor_regex: Any = None, **kwargs: Any) -> None:
        self.threshold = to_float("threshold", threshold, minimum=0.0)
        self.tensor_regex = tensor_regex
        self._selection = Selection(None, tensor_regex)
        super().__init__(**kwargs)

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        cols = columns(record)
        chosen = _chosen_gradients(cols, self._selection)
        if not chosen.any():
            return []
        self.mark_evaluated()
        numel = cols.column(record, "numel", fill=0.0)
        value, exact, known = bounds.abs_means(lambda name: (cols.column(record, name), cols.has(name)), numel)
        chosen &= numel != 0  # an empty gradient (or one of unknown size) has no mean
        missing = np.flatnonzero(chosen & ~known)
        if missing.size:
            tensor = cols.tensors[int(missing[0])]
            self.note("abs_mean", f"reads abs_mean, l1 or l2 of gradients; none is recorded for {tensor!r}")
        exact |= value == 0  # a zero root mean square: every value is zero
        out = []
        with np.errstate(invalid="ignore"):
            fired = chosen & known & (value < self.threshold)  # NaN compares False: ExplodingTensor's business
        for i in np.flatnonzero(fired).tolist():
            what = "mean of |gradient|" if exact[i] else "root mean square of the gradient (>= mean of |gradient|)"
            out.append(self.finding(record, cols.tensors[i], f"{what} {value[i]:.3g} < threshold {self.threshold:g}", value[i]))
        return out


class NonFiniteGradient(Rule):
    """Fires for a gradient holding NaN or Inf, from the ``nan_count`` and ``inf_count`` recorded
    for every tensor (exact, in any configuration): the step the optimizer took with it is
    already suspect, so ``action="raise"`` or ``"stop"`` suits it.
    """

    needs = NO_GRADIENT

    def __init__(self, tensor_regex: Any = None, **kwargs: Any) -> None:
        self.tensor_regex = tensor_regex
        self._selection = Selection(None, tensor_regex)
        super().__init__(**kwargs)

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        cols = columns(record)
        chosen = _chosen_gradients(cols, self._selection)
        if not chosen.any():
            return []
        self.mark_evaluated()
        # counts are whole numbers: a fraction (a damaged store) is cut as int() cuts it
        nan, inf = np.trunc(cols.column(record, "nan_count", fill=0.0)), np.trunc(cols.column(record, "inf_count", fill=0.0))
        numel = cols.column(record, "numel", fill=0.0)
        out = []
        for i in np.flatnonzero(chosen & ((nan != 0) | (inf != 0))).tolist():
            out.append(self.finding(record, cols.tensors[i], f"{count(nan[i])} NaN and {count(inf[i])} Inf in the gradient "
                                                             f"({count(numel[i])} values)", nan[i] + inf[i]))
        return out


class GradientNormSpike(Rule):
    """Fires when a step's global gradient norm exceeds ``factor`` times the median of the norms of
    the previous ``window`` saved steps (once ``min_history`` of them are known).

    The global norm is ``dynamics/global``'s ``grad_norm`` when recorded, else exactly
    ``sqrt(sum of l2**2)`` over the ``gradients`` collection (what ``clip_grad_norm_`` computes
    for the recorded parameters). Non-finite norms are left to NonFiniteGradient.
    """

    needs = NO_GRADIENT

    def __init__(self, factor: Any = 10.0, window: Any = 50, min_history: Any = 5, **kwargs: Any) -> None:
        self.factor = to_float("factor", factor, minimum=1.0)
        self.window = to_int("window", window, minimum=1)
        self.min_history = to_int("min_history", min_history, minimum=1)
        if self.min_history > self.window:
            raise expected("min_history", f"<= window ({self.window})", min_history)
        super().__init__(**kwargs)

    def reset(self) -> None:
        self._norms: dict[tuple[str, str], collections.deque[float]] = {}

    @staticmethod
    def global_norm(record: StepRecord) -> float | None:
        """The global gradient norm of a record, or ``None`` if it holds no gradient norm."""
        cols = columns(record)
        found = cols.scalar(record, "dynamics/global", "grad_norm")
        if found is not None:
            return found
        rows, at = cols.positions("l2")
        values = record.scalar_values[at[cols.mask(_GRADIENTS_PREFIX, _in_gradients)[rows]]]
        return math.sqrt(math.fsum((values * values).tolist())) if values.size else None

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        norm = self.global_norm(record)
        if norm is None:
            if record.mode.value == "train":
                self.note("grad_norm", "reads the l2 of gradients (the 'gradients' collection) or dynamics/global grad_norm")
            return []
        self.mark_evaluated()
        if not math.isfinite(norm):
            return []
        history = self._norms.setdefault((record.worker, record.mode.value), collections.deque(maxlen=self.window))
        out = []
        if len(history) >= self.min_history:
            median = statistics.median(history)
            if norm > self.factor * median:
                out.append(self.finding(record, None, f"global gradient norm {norm:.4g} > {self.factor:g} x median {median:.4g} "
                                                      f"of the previous {len(history)} saved steps", norm))
        history.append(norm)
        return out


class _UpdateRatioRule(Rule):
    """Shared by the two update-ratio rules: the ratio per parameter, or a note on what to enable."""

    needs = NO_UPDATE

    def _ratios(self, record: StepRecord) -> dict[str, tuple[float, float, str]]:
        found = update_ratios(record)
        if found:
            self.mark_evaluated()
        if not found and record.mode.value == "train" and any(kind_of(t) == "weights" for t, _ in record.scalar_names):
            self.note("updates", f"reads the size of each optimizer update: {_UPDATES_HINT}")
        return found


class WeightUpdateRatio(_UpdateRatioRule):
    """Fires for a weight whose update is larger than ``large_threshold`` or smaller than
    ``small_threshold`` times its size: ``||update||_2 / (||weight||_2 + epsilon)``.

    With raw weights saved it compares the weights at a saved step with those at the previous
    saved step (``num_steps=None``) or with the last saved step at least ``num_steps`` earlier,
    as SageMaker does. Otherwise it reads one optimizer step's update (``updates/<p>`` l2, or
    ``dynamics/<p>`` ``update_ratio``) at every saved step.
    """

    def __init__(self, num_steps: Any = None, large_threshold: Any = 10.0, small_threshold: Any = 0.00000001,
                 epsilon: Any = 0.000000001, **kwargs: Any) -> None:
        self.num_steps = to_int("num_steps", num_steps, minimum=1, optional=True)
        self.large_threshold = to_float("large_threshold", large_threshold, minimum=0.0)
        self.small_threshold = to_float("small_threshold", small_threshold, minimum=0.0)
        self.epsilon = to_float("epsilon", epsilon, minimum=0.0)
        super().__init__(**kwargs)

    def reset(self) -> None:
        self._raw: dict[tuple[str, str], list[tuple[int, np.ndarray]]] = {}

    def _check(self, record: StepRecord, param: str, update: float, weight: float, source: str) -> Finding | None:
        ratio = update / (weight + self.epsilon)
        tensor = f"weights/{param}"
        if ratio > self.large_threshold:
            return self.finding(record, tensor, f"update/weight ratio {ratio:.3g} > large_threshold {self.large_threshold:g} ({source})", ratio)
        if ratio < self.small_threshold:
            return self.finding(record, tensor, f"update/weight ratio {ratio:.3g} < small_threshold {self.small_threshold:g} ({source})", ratio)
        return None

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        out = []
        raw = {t.tensor: t.value for t in record.tensors if kind_of(t.tensor) == "weights"}
        if raw:
            self.mark_evaluated()
        for tensor, value in raw.items():
            history = self._raw.setdefault((record.worker, tensor), [])
            history.append((record.step, np.asarray(value, dtype=np.float64)))
            back = record.step - (self.num_steps or 1)
            positions = [i for i, (s, _) in enumerate(history[:-1]) if s <= back]
            if positions:
                del history[: positions[-1]]  # older ones are never needed again
                before_step, before = history[0]
                if before.shape == history[-1][1].shape:
                    found = self._check(record, tensor.partition("/")[2], float(np.linalg.norm(history[-1][1] - before)),
                                        float(np.linalg.norm(before)), f"raw weights, step {before_step} to {record.step}")
                    if found is not None:
                        out.append(found)
        for param, (update, weight, source) in self._ratios(record).items():
            if f"weights/{param}" in raw:
                continue
            found = self._check(record, param, update, weight, source)
            if found is not None:
                out.append(found)
        return out


class UpdateRatioOutOfRange(_UpdateRatioRule):
    """Fires for a weight whose optimizer update, relative to the weight, lies outside ``[low, high]``:
    ``||update||_2 / ||weight||_2`` of one optimizer step, from ``dynamics/<p>`` ``update_ratio``
    or ``updates/<p>`` l2 and ``weights/<p>`` l2 (exact).

    The defaults bracket the usual 1e-3 by three decades below (a frozen or starved layer, an
    update of exactly 0, fires) and two above (a learning rate that makes each step move a weight
    by more than a tenth of its size). Weights of norm 0 have no ratio and are skipped. Without
    ``tensor_regex``, parameters named like biases (``in_proj_bias`` of attention is recorded
    among weights) are left out: they start at 0, so their ratio starts near 1 with every
    optimizer and says nothing about the learning rate.
    """

    def __init__(self, low: Any = 1e-6, high: Any = 0.1, tensor_regex: Any = None, **kwargs: Any) -> None:
        self.low = to_float("low", low, minimum=0.0)
        self.high = to_float("high", high, minimum=0.0)
        if self.high < self.low:
            raise expected("high", f">= low ({self.low:g})", high)
        self.tensor_regex = tensor_regex
        self._selection = Selection(None, tensor_regex, default=lambda t: "bias" not in t.rpartition(".")[2])
        super().__init__(**kwargs)

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        out = []
        for param, (update, weight, source) in self._ratios(record).items():
            tensor = f"weights/{param}"
            if weight == 0 or not self._selection.matches(tensor):
                continue
            ratio = update / weight
            if ratio < self.low:
                out.append(self.finding(record, tensor, f"update/weight ratio {ratio:.3g} < low {self.low:g} ({source})", ratio))
            elif ratio > self.high:
                out.append(self.finding(record, tensor, f"update/weight ratio {ratio:.3g} > high {self.high:g} ({source})", ratio))
        return out
