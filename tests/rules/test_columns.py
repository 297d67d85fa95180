"""The default rules read a record's statistics as columns (numpy over every tensor at once):
each is checked here against the tensor-by-tensor code it replaced, on random records."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pytest

import tensorlens as tl
from tensorlens import rules as R
from tensorlens.rules import bounds
from tensorlens.rules.columns import columns
from tensorlens.rules.losses import _loss_selection, _losses
from tensorlens.rules.params import Selection, kind_of


def stats_of(record: tl.StepRecord) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for (tensor, stat), value in zip(record.scalar_names, record.scalar_values.tolist(), strict=True):
        out.setdefault(tensor, {})[stat] = value
    return out


def exploding(record: tl.StepRecord, selection: Selection, only_nan: bool) -> list[tuple[str, str, float]]:
    out = []
    for tensor, stats in stats_of(record).items():
        if not selection.matches(tensor):
            continue
        if "" in stats:
            value = stats[""]
            nan, inf = float(value != value), float(value in (float("inf"), float("-inf")))
        else:
            nan, inf = stats.get("nan_count", 0.0), stats.get("inf_count", 0.0)
        if only_nan:
            inf = 0.0
        if nan or inf:
            of = f" of {int(stats['numel'])} values" if "numel" in stats else ""
            out.append((tensor, f"{int(nan)} NaN and {int(inf)} Inf{of}", nan + inf))
    return out


def gradients(record: tl.StepRecord, selection: Selection) -> dict[str, dict[str, float]]:
    return {t: s for t, s in stats_of(record).items() if kind_of(t) == "gradients" and selection.matches(t)}


def non_finite(record: tl.StepRecord, selection: Selection) -> list[tuple[str, str, float]]:
    out = []
    for tensor, stats in gradients(record, selection).items():
        nan, inf = int(stats.get("nan_count", 0)), int(stats.get("inf_count", 0))
        if nan or inf:
            numel = int(stats.get("numel", 0))
            out.append((tensor, f"{nan} NaN and {inf} Inf in the gradient ({numel} values)", nan + inf))
    return out


def vanishing(record: tl.StepRecord, selection: Selection, threshold: float) -> list[tuple[str, str, float]]:
    out = []
    for tensor, stats in gradients(record, selection).items():
        if not stats.get("numel"):
            continue
        found = bounds.abs_mean(stats)
        if found is None:
            continue
        value, exact = found
        exact = exact or value == 0
        if value < threshold:
            what = "mean of |gradient|" if exact else "root mean square of the gradient (>= mean of |gradient|)"
            out.append((tensor, f"{what} {value:.3g} < threshold {threshold:g}", value))
    return out


def global_norm(record: tl.StepRecord) -> float | None:
    found = record.scalar("dynamics/global", "grad_norm")
    if found is not None:
        return found
    squares = [v * v for (t, s), v in zip(record.scalar_names, record.scalar_values.tolist(), strict=True)
               if s == "l2" and t.startswith("gradients/")]
    return math.sqrt(math.fsum(squares)) if squares else None


TENSORS = ["gradients/a", "gradients/b.weight", "attn/gradients/q", "weights/a", "losses/mse", "scalars/lr",
           "dynamics/global", "gradients/c"]
STATS = ["", "nan_count", "inf_count", "numel", "abs_mean", "l1", "abs_sum", "l2", "abs_l2", "grad_norm", "min"]
VALUES = [0.0, 1.0, 2.0, 1e-9, 1e-30, 64.0, np.nan, np.inf, -np.inf, -1.0]


def random_record(rng: np.random.Generator, step: int) -> tl.StepRecord:
    names = [(t, s) for t in TENSORS for s in STATS if rng.random() < 0.4]
    rng.shuffle(names)
    values = rng.choice(VALUES, size=len(names))
    return tl.StepRecord.from_arrays(step, "train", step, "worker_0", 0.0, scalar_names=tuple(map(tuple, names)),
                                     scalar_values=values)


def found(findings: list[R.Finding]) -> list[tuple[str | None, str, Any]]:
    return [(f.tensor, f.message, f.value) for f in findings]


def same(got: list[tuple[Any, ...]], want: list[tuple[Any, ...]]) -> bool:
    return [(*x[:2], repr(float(x[2]))) for x in got] == [(*x[:2], repr(float(x[2]))) for x in want]


@pytest.mark.parametrize("seed", range(4))
def test_the_default_rules_agree_with_their_tensor_by_tensor_form(seed: int) -> None:
    rng = np.random.default_rng(seed)
    warnings.simplefilter("ignore")
    fired = 0
    for step in range(150):
        record = random_record(rng, step)
        if step % 3 == 0:  # the same layout again: the columns come from the cache
            record = tl.StepRecord.from_arrays(step, "train", step, "worker_0", 0.0, scalar_names=record.scalar_names,
                                               scalar_values=rng.choice(VALUES, size=len(record.scalar_names)))
        for regex in (None, "a$"):
            for only_nan in (False, True):
                rule = R.ExplodingTensor(tensor_regex=regex, only_nan=only_nan)
                got = found(rule.evaluate(record))  # never raises, whatever a damaged store holds
                try:
                    want = exploding(record, rule._selection, only_nan)
                except (ValueError, OverflowError):  # int() of a NaN or infinite count: the old form failed
                    assert any("nan" in m or "inf " in m for _, m, _ in got)
                    continue
                assert same(got, want)
            rule = R.NonFiniteGradient(tensor_regex=regex)
            got = found(rule.evaluate(record))
            try:
                assert same(got, non_finite(record, rule._selection))
            except (ValueError, OverflowError):
                assert any("nan" in m or "inf " in m for _, m, _ in got)
            for threshold in (1e-7, 1.5):
                rule = R.VanishingGradient(threshold=threshold, tensor_regex=regex)
                got = found(rule.evaluate(record))
                try:
                    want = vanishing(record, rule._selection, threshold)
                except ValueError:  # sqrt of a negative size: the old form failed, the new one finds a NaN mean
                    continue
                assert same(got, want)
                fired += len(got)
        norm, want = R.GradientNormSpike.global_norm(record), global_norm(record)
        assert repr(norm) == repr(want)
        selection = _loss_selection(None, None)
        assert repr(_losses(record, selection)) == repr(
            [(t, v) for (t, s), v in zip(record.scalar_names, record.scalar_values.tolist(), strict=True)
             if not s and v == v and selection.matches(t)])
    assert fired > 50  # the random records make the rules fire, not only stay quiet


def test_tensor_stats_of_a_selection_are_those_of_the_whole_record_it_picks() -> None:
    from tensorlens.rules.params import tensor_stats

    rng = np.random.default_rng(7)
    for step in range(50):
        record = random_record(rng, step)
        everything = tensor_stats(record)
        assert repr(everything) == repr(stats_of(record))
        selection = Selection("gradients", "mse")
        assert repr(tensor_stats(record, selection)) == repr({t: s for t, s in everything.items() if selection.matches(t)})


def test_a_layout_is_indexed_once_and_found_again_by_identity_or_equality() -> None:
    record = random_record(np.random.default_rng(1), 0)
    cols = columns(record)
    assert columns(record) is cols
    copy = tl.StepRecord.from_arrays(1, "train", 1, "worker_0", 0.0, scalar_names=tuple(list(record.scalar_names)),
                                     scalar_values=record.scalar_values)
    assert copy.scalar_names is not record.scalar_names and columns(copy) is cols  # a live run's new tuple each step
    other = random_record(np.random.default_rng(2), 0)
    assert columns(other) is not cols and columns(other).names is other.scalar_names
    # a live run alternating between two layouts (train and eval records), each step a new tuple
    again = tl.StepRecord.from_arrays(2, "train", 2, "worker_0", 0.0, scalar_names=tuple(list(record.scalar_names)),
                                      scalar_values=record.scalar_values)
    assert columns(again) is cols
