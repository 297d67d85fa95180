"""Built-in rules on activations: DeadRelu, SaturatedActivation and PoorWeightInitialization
(SageMaker Debugger's names, parameters and defaults).

SageMaker's versions count *units* (elements of a layer's output, over the batch) that are
inactive or saturated in nearly every sample. With a raw tensor saved the same count is made
here. From reductions alone it cannot be, so these rules use a bound that the recorded
statistics prove (:mod:`tensorlens.rules.bounds`): they fire only when the share of such units
is certainly above ``threshold_layer``.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from tensorlens.findings import Finding
from tensorlens.records import StepRecord
from tensorlens.rules import bounds
from tensorlens.rules.base import Rule
from tensorlens.rules.params import Selection, collection_of, kind_of, tensor_stats, to_float, to_int


def _unit_activity(raw: np.ndarray, active: np.ndarray) -> np.ndarray:
    """Per unit (every element but the batch axis), the share of samples where it is active."""
    if raw.ndim < 2:
        return active.reshape(-1).astype(np.float64)
    return active.reshape(raw.shape[0], -1).mean(axis=0, dtype=np.float64)


class DeadRelu(Rule):
    """Fires for a layer in which more than ``threshold_layer`` percent of the ReLU units are
    active in less than ``threshold_inactivity`` percent of the samples.

    Reads, per activation tensor (the ``activations`` collection unless ``tensor_regex`` says
    otherwise; enable it with ``tl.watch(model, activations=True)``):
    the raw tensor when saved (SageMaker's per-unit count, exact); else ``dead_fraction`` (units
    inactive in every sample, a lower bound) and ``zero_fraction`` (recorded for activations by
    default), from which a share ``z`` of zero values proves at least
    ``(z - (1 - t)) / t`` of the units dead (``t`` = ``threshold_inactivity`` / 100): with the
    defaults the rule fires from ``zero_fraction`` > 0.995.
    """

    needs = ("no activation statistic was recorded (tl.watch(model, activations=True), or the 'activations' "
             "collection; dynamics=True adds dead_fraction)")

    def __init__(self, tensor_regex: Any = None, threshold_inactivity: Any = 1.0, threshold_layer: Any = 50.0,
                 **kwargs: Any) -> None:
        self.tensor_regex = tensor_regex
        self.threshold_inactivity = to_float("threshold_inactivity", threshold_inactivity, minimum=0.0, maximum=100.0)
        self.threshold_layer = to_float("threshold_layer", threshold_layer, minimum=0.0, maximum=100.0)
        self._selection = Selection(None, tensor_regex, default=lambda t: kind_of(t) == "activations")
        super().__init__(**kwargs)

    def _dead_share(self, stats: dict[str, float], raw: np.ndarray | None) -> tuple[float, str] | None:
        if raw is not None and raw.size:
            activity = _unit_activity(raw, np.asarray(raw) > 0)
            return float(np.mean(activity * 100.0 < self.threshold_inactivity)), "raw values"
        found = []
        if "dead_fraction" in stats:
            found.append((stats["dead_fraction"], f"dead_fraction {stats['dead_fraction']:.4g}"))
        if "zero_fraction" in stats:
            share = bounds.units_below_activity(stats["zero_fraction"], self.threshold_inactivity)
            found.append((share, f"zero_fraction {stats['zero_fraction']:.4g}"))
        return max(found) if found else None

    @staticmethod
    def _held_nonfinite(record: StepRecord, tensor: str, stats: dict[str, float]) -> bool:
        # NaN compares inactive (monitorch's rule), so a layer whose outputs turned NaN reads as
        # 100 % dead: that is the NaN's story (NonFiniteGradient, ExplodingTensor), not a dead ReLU
        counts = [stats.get("nan_count"), stats.get("inf_count"), record.scalar(f"{tensor}/sample_norm", "nan_count")]
        return any(c is not None and (c != 0) for c in counts)  # NaN: uncounted, the norm was not finite

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        out, raw, usable = [], {t.tensor: t.value for t in record.tensors}, False
        for tensor, stats in tensor_stats(record, self._selection).items():
            if "" in stats or self._held_nonfinite(record, tensor, stats):
                continue
            found = self._dead_share(stats, raw.get(tensor))
            if found is None:
                continue
            usable = True
            self.mark_evaluated()
            share, source = found
            if share * 100.0 > self.threshold_layer:
                out.append(self.finding(record, tensor, f"at least {share:.1%} of units active in < {self.threshold_inactivity:g}% "
                                                        f"of samples (> {self.threshold_layer:g}%; from {source})", 100.0 * share))
        if not usable and record.mode.value == "train":
            self.note("zero_fraction", "reads zero_fraction (or raw values) of activations: record them with "
                                       "tl.watch(model, activations=True) or include_collections=[..., 'activations']")
        return out


class SaturatedActivation(Rule):
    """Fires for a tanh or sigmoid layer in which more than ``threshold_layer`` percent of the units
    have their input outside ``(threshold_<f>_min, threshold_<f>_max)`` in all but less than
    ``threshold_inactivity`` percent of the samples.

    Reads the *inputs* of tanh/sigmoid modules: enable the ``inputs`` collection and select them,
    e.g. ``tensor_regex=R.modules_regex(model, nn.Tanh, collection="inputs")``. The function is
    ``activation`` (``"tanh"`` or ``"sigmoid"``), else read from the tensor name (one holding
    ``tanh``/``sigmoid``). With a raw input saved the count is SageMaker's; otherwise the share of
    saturated values is bounded from ``min``, ``max``, ``mean``, ``l2`` and an unsampled
    histogram, and the rule fires only when that bound proves the condition.
    """

    def __init__(self, collection_names: Any = None, tensor_regex: Any = None, threshold_tanh_min: Any = -9.4999,
                 threshold_tanh_max: Any = 9.4999, threshold_sigmoid_min: Any = -23, threshold_sigmoid_max: Any = 16.99999,
                 threshold_inactivity: Any = 1.0, threshold_layer: Any = 50.0, activation: str | None = None,
                 **kwargs: Any) -> None:
        self.collection_names, self.tensor_regex = collection_names, tensor_regex
        self.threshold_tanh_min = to_float("threshold_tanh_min", threshold_tanh_min)
        self.threshold_tanh_max = to_float("threshold_tanh_max", threshold_tanh_max)
        self.threshold_sigmoid_min = to_float("threshold_sigmoid_min", threshold_sigmoid_min)
        self.threshold_sigmoid_max = to_float("threshold_sigmoid_max", threshold_sigmoid_max)
        for f in ("tanh", "sigmoid"):
            if not getattr(self, f"threshold_{f}_min") < getattr(self, f"threshold_{f}_max"):
                raise ValueError(f"Expected `threshold_{f}_min` < `threshold_{f}_max`, but got "
                                 f"{getattr(self, f'threshold_{f}_min')} and {getattr(self, f'threshold_{f}_max')}")
        self.threshold_inactivity = to_float("threshold_inactivity", threshold_inactivity, minimum=0.0, maximum=100.0)
        self.threshold_layer = to_float("threshold_layer", threshold_layer, minimum=0.0, maximum=100.0)
        if activation not in (None, "tanh", "sigmoid"):
            raise ValueError(f"Expected `activation` to be None, 'tanh' or 'sigmoid', but got {activation!r}")
        self.activation = activation
        self._selection = Selection(collection_names, tensor_regex,
                                    default=lambda t: kind_of(t) == "inputs" and re.search(r"(?i)tanh|sigmoid", t) is not None)
        super().__init__(**kwargs)

    def _function(self, tensor: str) -> str | None:
        if self.activation is not None:
            return self.activation
        lowered = tensor.lower()
        return "sigmoid" if "sigmoid" in lowered else "tanh" if "tanh" in lowered else None

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        out, raw, usable = [], {t.tensor: t.value for t in record.tensors}, False
        for tensor, stats in tensor_stats(record, self._selection).items():
            if "" in stats:
                continue
            function = self._function(tensor)
            if function is None:
                self.note(f"function:{tensor}", f"cannot tell whether {tensor!r} feeds a tanh or a sigmoid: pass activation='tanh' or 'sigmoid'")
                continue
            low, high = getattr(self, f"threshold_{function}_min"), getattr(self, f"threshold_{function}_max")
            usable = True
            values = raw.get(tensor)
            if values is not None and values.size:
                values = np.asarray(values, dtype=np.float64)
                activity = _unit_activity(values, (values > low) & (values < high))
                share, source = float(np.mean(activity * 100.0 < self.threshold_inactivity)), "raw values"
            else:
                saturated = bounds.fraction_outside(stats, low, high, record.histogram(tensor))
                share = bounds.units_below_activity(saturated, self.threshold_inactivity)
                source = f"at least {saturated:.4g} of values outside ({low:g}, {high:g})"
            if share * 100.0 > self.threshold_layer:
                out.append(self.finding(record, tensor, f"{function}: at least {share:.1%} of units saturated in > "
                                                        f"{100 - self.threshold_inactivity:g}% of samples ({source})", 100.0 * share))
        if not usable and record.mode.value == "train":
            self.note("inputs", "reads the inputs of tanh/sigmoid modules: enable the 'inputs' collection and pass "
                                "tensor_regex=R.modules_regex(model, nn.Tanh, nn.Sigmoid, collection='inputs')")
        return out


class PoorWeightInitialization(Rule):
    """Fires during the first ``steps`` steps when initialization looks poor, by any of three checks:

    - the largest variance of the activation inputs across layers exceeds ``threshold`` times
      the smallest (exact: ``std**2``), for the tensors matching ``activation_inputs_regex``
      (default: the ``inputs`` collection, else the ``activations`` collection);
    - a gradient's 5th-to-95th percentile spread is below ``distribution_range`` (an upper bound
      of the spread from ``max - min`` and an unsampled histogram: fires only when certain);
    - the loss did not reach a new minimum for ``patience`` saved steps.

    All three need saved steps among the first ``steps`` (``save_interval=1`` for them).
    """

    def __init__(self, activation_inputs_regex: Any = None, threshold: Any = 10.0, distribution_range: Any = 0.001,
                 patience: Any = 5, steps: Any = 10, **kwargs: Any) -> None:
        self.activation_inputs_regex = activation_inputs_regex
        self.threshold = to_float("threshold", threshold, minimum=1.0)
        self.distribution_range = to_float("distribution_range", distribution_range, minimum=0.0)
        self.patience = to_int("patience", patience, minimum=1)
        self.steps = to_int("steps", steps, minimum=1)
        self._selection = Selection(None, activation_inputs_regex)
        super().__init__(**kwargs)

    def reset(self) -> None:
        self._loss: dict[tuple[str, str], tuple[float, int]] = {}  # (worker, tensor) -> (best, steps since)

    def _variance_check(self, record: StepRecord, stats: dict[str, dict[str, float]]) -> Finding | None:
        if self._selection.given:
            chosen = {t: s for t, s in stats.items() if self._selection.matches(t)}
        else:
            chosen = {t: s for t, s in stats.items() if kind_of(t) == "inputs"} or \
                     {t: s for t, s in stats.items() if kind_of(t) == "activations"}
        variances = {t: s["std"] ** 2 for t, s in chosen.items() if "std" in s and s["std"] == s["std"] and s["std"] > 0}
        if len(variances) < 2:
            return None
        low, high = min(variances, key=variances.get), max(variances, key=variances.get)
        ratio = variances[high] / variances[low]
        if ratio > self.threshold:
            return self.finding(record, None, f"variance of activation inputs varies {ratio:.3g}x across layers (> {self.threshold:g}): "
                                              f"{high} {variances[high]:.3g}, {low} {variances[low]:.3g}", ratio)
        return None

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        if record.step >= self.steps or record.mode.value not in ("train", "global"):
            return []
        stats = tensor_stats(record)
        out = [f for f in [self._variance_check(record, stats)] if f is not None]
        for tensor, values in stats.items():
            if kind_of(tensor) == "gradients" and values.get("numel", 0) > 1:
                spread = bounds.percentile_spread_upper(values, record.histogram(tensor))
                if spread is not None and spread < self.distribution_range:
                    out.append(self.finding(record, tensor, f"5th-95th percentile spread of the gradient <= {spread:.3g} "
                                                            f"< distribution_range {self.distribution_range:g}", spread))
            elif collection_of(tensor) == "losses" and "" in values and values[""] == values[""]:
                best, since = self._loss.get((record.worker, tensor), (float("inf"), 0))
                best, since = (values[""], 0) if values[""] < best else (best, since + 1)
                self._loss[(record.worker, tensor)] = (best, since)
                if since >= self.patience:
                    out.append(self.finding(record, tensor, f"loss has not improved for {since} saved steps "
                                                            f"(patience {self.patience}) within the first {self.steps} steps", values[""]))
        return out
