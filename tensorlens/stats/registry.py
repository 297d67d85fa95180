"""Every statistic, declared once: the partial columns it needs, how they merge, how it is finalized.

A tensor's statistics are derived from a *partial row*: the :data:`COLUMNS` below, computed on the
device (:mod:`tensorlens.stats.moments`, or the compiled kernel) and merged exactly across
micro-batches, repeated module calls and ranks by each column's ``merge`` rule. A
:class:`Statistic` names the columns it needs and finalizes them, vectorised over many rows.

To add a statistic computed from the existing columns: one :func:`statistic` declaration here and
a test against numpy (``tests/stats/``). A statistic that needs a new column also declares the
column here, with its ``compute`` (a function over a block of flat values): the PyTorch path
(:mod:`tensorlens.stats.torch_rows`, which a GPU without triton and the sparse path use) calls it,
and the compiled kernel and the Triton kernels (:mod:`tensorlens.stats.triton`) leave tensors that
need such a column to that path, so nothing else changes
(``tests/stats/test_declared_column.py`` adds one this way). Statistics across the tensors of a
step or across steps live in :mod:`tensorlens.stats.derived`; views of stored data (quantiles,
thinning) in :mod:`tensorlens.stats.views`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a partial row and how two rows of disjoint pieces combine in it.

    ``merge``: ``"sum"``, ``"min"``, ``"max"``, ``"prod"``; ``"m2:<total>"`` for a centred second
    moment around the mean of column ``<total>`` (Chan's parallel update); ``"single"`` for a value
    that cannot be merged (exact for one piece, NaN across several).

    ``compute``: how the column is computed, ``compute(values) -> [k]`` for a ``[k, n]`` torch
    tensor of ``k`` tensors' flat values (their compute dtype, on their device; ``n`` may be 0),
    with torch ops only (no ``.item()``, nothing whose size depends on the data: a GPU must not
    wait). ``None`` for the columns below, which the fused paths compute themselves (the PyTorch
    rows in a few shared passes, the compiled kernel and the Triton kernels in one read); a column
    declared with a ``compute`` is computed by the PyTorch path, the kernels leaving such tensors to it.

    >>> Column("positive_count", "sum", "values > 0", compute=lambda x: (x > 0).sum(1))  # doctest: +SKIP
    """

    name: str
    merge: str
    doc: str
    compute: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if self.merge not in _MERGES and not self.merge.startswith("m2:"):
            raise ValueError(f"Column {self.name!r}: expected merge to be one of {sorted(_MERGES)} or 'm2:<total>', "
                             f"but got {self.merge!r}")
        if self.compute is not None and not callable(self.compute):
            raise TypeError(f"Column {self.name!r}: expected compute to be a function of a [k, n] tensor, "
                            f"but got {self.compute!r}")


_MERGES = frozenset({"sum", "min", "max", "prod", "single"})


#: The partial row, in order. NaN where a column was not requested.
COLUMNS: tuple[Column, ...] = (
    Column("count", "sum", "number of values"),
    Column("sum", "sum", "sum of the values"),
    Column("sumsq", "sum", "sum of squares (l2 ** 2)"),
    Column("m2", "m2:sum", "sum of squared deviations from the mean"),
    Column("l1", "sum", "sum of |x|"),
    Column("min", "min", "smallest value"),
    Column("max", "max", "largest value"),
    Column("abs_min", "min", "smallest |x|"),
    Column("abs_m2", "m2:l1", "sum of squared deviations of |x| from mean(|x|)"),
    Column("prod", "prod", "product of the values"),
    Column("median", "single", "exact median (numpy's)"),
    Column("abs_median", "single", "exact median of |x|"),
    Column("nan_count", "sum", "NaN values"),
    Column("inf_count", "sum", "+-Inf values"),
    Column("zero_count", "sum", "values equal to zero"),
)
#: Columns every tensor gets, whatever its statistics.
ALWAYS_COMPUTED = frozenset({"count", "sum", "min", "max", "nan_count", "inf_count"})

Partials = Mapping[str, np.ndarray]  # column name -> values [N] of N rows


@dataclasses.dataclass(frozen=True)
class Statistic:
    """A named statistic: the columns it needs beyond :data:`ALWAYS_COMPUTED` and its finalize,
    ``finalize(partials) -> [N]`` over ``N`` rows (float64; NaN where undefined)."""

    name: str
    columns: tuple[str, ...]
    finalize: Callable[[Partials], np.ndarray]
    doc: str


#: Every statistic by name, in declaration order (the order a record lists them in).
STATISTICS: dict[str, Statistic] = {}


def statistic(name: str, columns: tuple[str, ...] = (), doc: str = "") -> Callable[[Callable[[Partials], np.ndarray]], Callable[[Partials], np.ndarray]]:
    """Declare a statistic (a decorator over its finalize function).

    >>> @statistic("sum_of_squares_per_value", ("sumsq",), "sumsq / n")   # doctest: +SKIP
    ... def _(p): return p["sumsq"] / _safe_n(p)
    """
    known = {c.name for c in COLUMNS}

    def register(finalize: Callable[[Partials], np.ndarray]) -> Callable[[Partials], np.ndarray]:
        unknown = set(columns) - known
        if unknown:
            raise ValueError(f"statistic {name!r} needs unknown columns {sorted(unknown)}")
        if name in STATISTICS:
            raise ValueError(f"statistic {name!r} is declared twice")
        STATISTICS[name] = Statistic(name, tuple(columns), finalize, doc)
        return finalize

    return register


def needed_columns(names: tuple[str, ...]) -> frozenset[str]:
    """The columns that must be computed to finalize ``names``."""
    cols = set(ALWAYS_COMPUTED)
    for name in names:
        found = STATISTICS.get(name)
        if found is not None:
            cols.update(found.columns)
    return frozenset(cols)


def finalize_all(partials: Partials, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """The declared statistics ``names`` (all of them by default) of ``partials`` (rows ``[N]``
    per column)."""
    with np.errstate(all="ignore"):
        return {
            name: np.asarray(STATISTICS[name].finalize(partials), dtype=np.float64)
            for name in (STATISTICS if names is None else names)
        }


# ---------------------------------------------------------------------------- shared pieces

_NAN = np.float64(math.nan)


def _empty(p: Partials) -> np.ndarray:
    return p["count"] == 0


def _safe_n(p: Partials) -> np.ndarray:
    return np.where(_empty(p), 1.0, p["count"])


def _per_value(p: Partials, column: str) -> np.ndarray:
    return np.where(_empty(p), _NAN, p[column] / _safe_n(p))


def _variance(p: Partials, m2: str) -> np.ndarray:
    return np.where(_empty(p), _NAN, np.maximum(p[m2] / _safe_n(p), 0.0))  # a NaN m2 stays NaN


def _linf(p: Partials) -> np.ndarray:
    # an empty tensor has norm 0 (numpy); a NaN bound makes it NaN
    return np.where(_empty(p), 0.0, np.where(np.isnan(p["min"]) | np.isnan(p["max"]), _NAN,
                                             np.fmax(np.abs(p["min"]), np.abs(p["max"]))))


def _l2(p: Partials) -> np.ndarray:
    l2 = np.sqrt(np.maximum(p["sumsq"], 0.0))
    # numpy: a NaN makes every norm NaN, an Inf (without NaN) makes it Inf
    return np.where(p["nan_count"] > 0, _NAN, np.where(p["inf_count"] > 0, np.inf, l2))


# ---------------------------------------------------------------------------- the statistics
# Counts recorded for every tensor (ReductionConfig adds them whatever it is asked for).

statistic("numel", (), "number of values (the dense size for a sparse tensor)")(lambda p: p["count"])
statistic("nan_count", (), "NaN values: never dropped, always recorded")(lambda p: p["nan_count"])
statistic("inf_count", (), "+-Inf values: never dropped, always recorded")(lambda p: p["inf_count"])

# Reductions over the values (numpy's semantics: NaN propagates, population variance).
statistic("min", (), "smallest value")(lambda p: p["min"])
statistic("max", (), "largest value")(lambda p: p["max"])
statistic("sum", (), "sum of the values")(lambda p: p["sum"])
statistic("mean", (), "sum / numel")(lambda p: _per_value(p, "sum"))
statistic("variance", ("m2",), "population variance (ddof=0), corrected two-pass")(lambda p: _variance(p, "m2"))
statistic("std", ("m2",), "sqrt(variance)")(lambda p: np.sqrt(_variance(p, "m2")))
statistic("prod", ("prod",), "product of the values")(lambda p: p["prod"])
statistic("median", ("median",), "exact median (one tensor; NaN when merged across pieces)")(lambda p: p["median"])

# Norms (of x; the abs_ forms of |x| are equal, kept for symmetry with SageMaker Debugger).
statistic("l1", ("l1",), "sum of |x|")(lambda p: p["l1"])
statistic("l2", ("sumsq",), "sqrt(sum of x^2)")(_l2)
statistic("linf", (), "max |x|")(_linf)

statistic("rms", ("sumsq",), "root mean square sqrt(mean(x^2)): the scale unit-scaled and low-precision training track")(
    lambda p: np.where(_empty(p), _NAN, _l2(p) / np.sqrt(_safe_n(p)))
)

# The same reductions over |x|.
statistic("abs_min", ("abs_min",), "smallest |x|")(lambda p: p["abs_min"])
statistic("abs_max", (), "largest |x|")(_linf)
statistic("abs_sum", ("l1",), "sum of |x|")(lambda p: p["l1"])
statistic("abs_mean", ("l1",), "mean of |x|")(lambda p: _per_value(p, "l1"))
statistic("abs_variance", ("l1", "abs_m2"), "population variance of |x|")(lambda p: _variance(p, "abs_m2"))
statistic("abs_std", ("l1", "abs_m2"), "std of |x|")(lambda p: np.sqrt(_variance(p, "abs_m2")))
statistic("abs_prod", ("prod",), "|product|")(lambda p: np.abs(p["prod"]))
statistic("abs_median", ("abs_median",), "exact median of |x|")(lambda p: p["abs_median"])
statistic("abs_l1", ("l1",), "l1 of |x| (= l1)")(lambda p: p["l1"])
statistic("abs_l2", ("sumsq",), "l2 of |x| (= l2)")(_l2)
statistic("abs_linf", (), "linf of |x| (= linf)")(_linf)

# Counts.
statistic("zero_fraction", ("zero_count",), "fraction of values equal to zero (dead ReLU units)")(
    lambda p: _per_value(p, "zero_count")
)
