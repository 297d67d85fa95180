"""How far a statistic left its own trailing behaviour, and where in a training step a tensor is
computed: the numbers behind :func:`tensorlens.analysis.explain.explain` (its docstring and
``docs/explain.md`` give the method). Plain numpy over a matrix of saved steps x series.

>>> onset, jump, baseline = departures(values, present, kinds, window=20, lookback=20, threshold=6.0)   # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

#: Statistics that measure a tensor's size (never negative): read on a log scale, so that a
#: change by a factor counts the same on a weight's norm and on a gradient's.
SIZE_STATISTICS = frozenset(
    {
        "l1",
        "l2",
        "linf",
        "std",
        "abs_mean",
        "abs_max",
        "update_l2",
        "update_ratio",
        "grad_to_weight",
        "distance_from_init",
    }
)
#: Per-sample norms (``.../sample_norm``) are sizes too: their mean and max are read as such.
SAMPLE_NORM_STATISTICS = frozenset({"mean", "max"})
#: Counts of non-finite values: any value above 0 is a departure (and, by default, the event).
NONFINITE_COUNTS = frozenset({"nan_count", "inf_count", "grad_nonfinite_count"})
#: The robust scale is never below this: 2 % on the log scale of a size (a factor 1.02), 2 % of
#: the median's size for a plain value.
SCALE_FLOOR = 0.02
#: The least number of finite values before a step for it to have a trailing behaviour.
MIN_HISTORY = 10
#: |z| counted for a non-finite value (or a size fallen to exactly 0).
Z_NONFINITE = 1000.0
#: 1.4826 * MAD estimates the standard deviation of normally distributed values.
_MAD_TO_STD = 1.4826
#: Collections read as the state a step starts from, the forward pass, the backward pass, the update.
_STATE = ("weights", "biases", "optimizer")
_FORWARD = ("inputs", "activations", "summaries")
_BACKWARD = ("activation_gradients", "input_gradients")
_UPDATE = ("dynamics", "updates")
_KNOWN = (*_STATE, *_FORWARD, *_BACKWARD, *_UPDATE, "gradients")
#: Not candidates: the event itself (losses), aggregates of all parameters, epoch aggregates.
_NOT_CAUSES = ("losses/", "dynamics/global", "epochs/")


PLAIN, SIZE, COUNT = 0, 1, 2


def series_kind(tensor: str, stat: str) -> int | None:
    """How a statistic is read (:data:`SIZE` on a log scale, :data:`PLAIN` as it is,
    :data:`COUNT` as non-finite from above 0), or ``None`` when it is not a candidate."""
    if tensor.startswith(_NOT_CAUSES):
        return None
    if stat in NONFINITE_COUNTS:
        return COUNT
    if stat in SIZE_STATISTICS or (stat in SAMPLE_NORM_STATISTICS and tensor.endswith("/sample_norm")):
        return SIZE
    return PLAIN if stat == "" else None


def phase_of(tensor: str, forward_order: dict[str, float]) -> float:
    """Where in a training step ``tensor`` is computed, in ``[0, 1)``: 0 the weights the step starts
    from, ``[0.2, 0.4)`` the forward pass (by ``forward_order``, the module's place among those
    that ran, in ``[0, 1)``), ``[0.4, 0.6)`` activation and input gradients, 0.6 parameter
    gradients, 0.8 the update; a collection of unknown place (``scalars``, a custom one) 0.5."""
    kind = kind_and_rest(tensor)[0]
    if kind in _STATE:
        return 0.0
    if kind in _FORWARD:
        return 0.2 + 0.2 * forward_order.get(tensor, 0.999)
    if kind in _BACKWARD:
        return 0.4 + 0.2 * forward_order.get(tensor, 0.999)
    if kind == "gradients":
        return 0.6
    if kind in _UPDATE:
        return 0.8
    return 0.5


def kind_and_rest(tensor: str) -> tuple[str, str]:
    """``("activations", "fc3/sample_norm")`` of ``"activations/fc3/sample_norm"``; a custom
    collection holds one kind, named second: ``"attn/gradients/q.weight"`` -> ``("gradients", "q.weight")``."""
    parts = tensor.split("/", 2)
    if parts[0] not in _KNOWN and len(parts) == 3 and parts[1] in _KNOWN:
        return parts[1], parts[2]
    return parts[0], "/".join(parts[1:])


def robust(window: np.ndarray, floor: np.ndarray | float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(median, scale, finite count)`` per column of ``window`` (NaN: not a value); the scale is
    at least ``floor`` (one per column, or one for all)."""
    count = np.sum(~np.isnan(window), axis=0)
    with np.errstate(all="ignore"):
        median = _median(window)
        mad = _median(np.abs(window - median))
        scale = np.maximum(_MAD_TO_STD * mad, floor)
    scale = np.where(scale > 0, scale, np.finfo(np.float64).tiny)
    return median, scale, count


def _median(window: np.ndarray) -> np.ndarray:
    """The median of each column's non-NaN values (NaN where it has none). ``np.nanmedian`` goes
    through masked arrays, ten times slower: used only for the columns holding a NaN."""
    gaps = np.isnan(window).any(axis=0)
    out = np.median(window, axis=0) if window.shape[0] else np.full(window.shape[1], np.nan)
    if gaps.any():
        with _QuietNanWarnings():
            out[gaps] = np.nanmedian(window[:, gaps], axis=0)
    return out


class _QuietNanWarnings:
    """nanmedian of an all-NaN column warns; such a column simply has no trailing behaviour."""

    def __enter__(self) -> None:
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc: object) -> None:
        self._catch.__exit__(*exc)


def departures(
    values: np.ndarray, present: np.ndarray, kinds: np.ndarray, window: int, lookback: int, threshold: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per series (columns of ``values``, saved steps as rows, the event last; ``present`` where
    saved, ``kinds`` how each is read): ``(onset row or -1, |z| at the onset, trailing median)``, the
    median in the series' own units. See :mod:`tensorlens.analysis.explain`, steps 3 and 4."""
    rows, columns = values.shape
    event = rows - 1
    broken = present & ~np.isfinite(values)  # NaN or Inf recorded: away from any behaviour
    size = kinds == SIZE
    with np.errstate(all="ignore"):
        read = np.where(size, np.log(np.where(values > 0, values, np.nan)), values)
    collapsed = present & size & (values == 0)  # a size fallen to exactly 0: away, if it had a behaviour
    usable = np.where(np.isfinite(read), read, np.nan)
    onset = np.full(columns, -1, dtype=np.intp)
    jump = np.zeros(columns)
    baseline = np.full(columns, np.nan)
    for i in range(max(0, event - lookback), event + 1):
        todo = onset < 0
        if not todo.any():
            break
        median, scale, count = robust(usable[max(0, i - window) : i], 0.0)
        scale = np.maximum(scale, np.where(size, SCALE_FLOOR, SCALE_FLOOR * np.abs(median)))
        scale = np.where(scale > 0, scale, np.finfo(np.float64).tiny)
        known = count >= MIN_HISTORY
        with np.errstate(all="ignore"):
            distance = np.abs(usable[i:] - median) / scale
        distance = np.where(broken[i:] | (collapsed[i:] & known), np.inf, distance)
        # a count: any NaN/Inf is away; a NaN count (left uncounted, the norm was not finite) too
        counted = (values[i:] > 0) | (np.isnan(values[i:]) & present[i:])
        distance = np.where(kinds == COUNT, np.where(counted, np.inf, 0.0), distance)
        has_behaviour = known | (kinds == COUNT)
        starts = present[i] & (broken[i] | (has_behaviour & (distance[0] >= threshold)))
        stays = np.all((distance[1:] >= threshold / 2) | ~present[i + 1 :], axis=0)  # NaN distance: not away
        found = todo & starts & stays
        onset[found] = i
        jump[found] = distance[0][found]
        with np.errstate(all="ignore"):
            level = np.where(size, np.exp(median), median)
        baseline[found] = np.where(kinds == COUNT, 0.0, level)[found]
    return onset, jump, baseline


def forward_order(tensors: Sequence[str]) -> dict[str, float]:
    """Each forward (or backward) tensor's place in its pass, in ``[0, 1)``: its module's first
    appearance among the pass's tensors of a record, which lists module outputs (their per-sample
    norms first) in the order the hooks fired. ``activations/fc3/unit_active_rate`` goes with fc3."""
    out: dict[str, float] = {}
    for group in (_FORWARD, _BACKWARD):
        mine = [t for t in tensors if kind_and_rest(t)[0] in group]
        modules = list(dict.fromkeys(kind_and_rest(t)[1].split("/", 1)[0] for t in mine))
        place = {m: i / len(modules) for i, m in enumerate(modules)}
        out.update({t: place[kind_and_rest(t)[1].split("/", 1)[0]] for t in mine})
    return out
