"""Pure statistics: mergeable partial moments of a tensor, their merge, and the named reductions.

Everything a reduction needs is derived from a *partial row* (``PARTIALS``) that can be merged
exactly: two rows of disjoint pieces of one tensor merge into the row of the whole (Chan et al.'s
parallel update for the centred second moment). The same merge serves several ranks of a
distributed run. ``median`` is the exception: it is exact for one tensor and cannot be merged
(see :func:`merge_partials`).

NaN semantics (documented in the README): a NaN anywhere in a tensor makes ``min``, ``max``,
``mean``, ``std``, ``variance``, ``sum``, ``prod``, ``median`` and the norms NaN, exactly like numpy;
an Inf propagates the way numpy's arithmetic does. ``nan_count`` and ``inf_count`` are always
recorded, so a NaN is never hidden.

Precision: statistics of float16/bfloat16/float32 tensors are accumulated in float32 by PyTorch's
pairwise (cascade) reductions, float64 tensors in float64; integers and bools in float64. The
variance is computed in two passes (around the mean), so a constant tensor has variance 0 and
large offsets do not cancel. Variance and std are population statistics (numpy's ``ddof=0``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

#: Columns of a partial row, in order. NaN where a column was not requested.
PARTIALS = (
    "count",  # number of values
    "sum",
    "sumsq",  # sum of squares (l2 ** 2)
    "m2",  # sum of squared deviations from the mean
    "l1",  # sum of |x|
    "min",
    "max",
    "abs_min",
    "abs_m2",  # sum of squared deviations of |x| from mean(|x|)
    "prod",
    "median",  # not mergeable
    "abs_median",  # not mergeable
    "nan_count",
    "inf_count",
    "zero_count",
)
COL = {name: i for i, name in enumerate(PARTIALS)}

#: Which partial columns each statistic needs beyond count/sum/min/max (always computed).
_NEEDS = {
    "std": ("m2",),
    "variance": ("m2",),
    "l2": ("sumsq",),
    "l1": ("l1",),
    "prod": ("prod",),
    "median": ("median",),
    "abs_mean": ("l1",),
    "abs_sum": ("l1",),
    "abs_l1": ("l1",),
    "abs_l2": ("sumsq",),
    "abs_min": ("abs_min",),
    "abs_std": ("l1", "abs_m2"),
    "abs_variance": ("l1", "abs_m2"),
    "abs_prod": ("prod",),
    "abs_median": ("abs_median",),
    "zero_fraction": ("zero_count",),
}


def needed_columns(stat_names: tuple[str, ...] | list[str]) -> frozenset[str]:
    """The partial columns that must be computed to produce ``stat_names``."""
    cols = {"count", "sum", "min", "max", "nan_count", "inf_count"}
    for name in stat_names:
        cols.update(_NEEDS.get(name, ()))
    return frozenset(cols)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics of a tensor of ``dtype`` are accumulated in."""
    if dtype == torch.float64:
        return torch.float64
    if dtype.is_floating_point:
        return torch.float32
    return torch.float64  # integers and bool: exact up to 2**53


def as_values(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view (or, when the dtype must change, a copy) of ``tensor`` in its compute dtype.

    Complex tensors must be turned into magnitudes by the caller (it warns once).
    """
    flat = tensor.detach().reshape(-1)
    target = compute_dtype(flat.dtype)
    return flat if flat.dtype == target else flat.to(target)


def _exact_median(values: torch.Tensor) -> torch.Tensor:
    """numpy's median: the mean of the two middle values for an even count; NaN if any NaN."""
    n = values.numel()
    lower = values.kthvalue((n + 1) // 2).values
    upper = values.kthvalue(n // 2 + 1).values if n % 2 == 0 else lower
    median = (lower + upper) / 2 if n % 2 == 0 else lower
    return torch.where(torch.isnan(values).any(), torch.full_like(median, math.nan), median)


def _centred_m2(centred: torch.Tensor, n: int) -> torch.Tensor:
    """Sum of squared deviations, given ``centred = values - mean`` (overwritten in place).

    The corrected two-pass algorithm (Chan, Golub & LeVeque): subtracting
    ``(sum of deviations)^2 / n`` cancels the rounding error of the mean, so a constant tensor
    has exactly zero spread even in float32. Squares are summed with PyTorch's cascade ``sum``:
    ``vector_norm`` on CPU accumulates float32 naively (1e-4 relative error at 3M values).
    """
    deviation = centred.sum()
    return centred.square_().sum() - deviation.square() / n


def partial_row(values: torch.Tensor, columns: frozenset[str], scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The partial row (float64, on ``values.device``) of a flat tensor, with no host sync.

    ``nan_count`` and ``inf_count`` are only computed when the tensor is not all-finite, which the
    caller learns from ``min``/``max`` after the one host copy (min and max propagate NaN and
    reveal Inf): here they are NaN placeholders. ``scratch`` (at least ``values.numel()`` long,
    same dtype) saves an allocation for the two-pass variance.
    """
    n = values.numel()
    dev = values.device
    nan = torch.tensor(math.nan, dtype=torch.float64, device=dev)
    out: list[torch.Tensor] = [nan] * len(PARTIALS)
    out[COL["count"]] = torch.tensor(float(n), dtype=torch.float64, device=dev)
    if n == 0:
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        for name in ("sum", "sumsq", "m2", "l1", "abs_m2", "nan_count", "inf_count", "zero_count"):
            out[COL[name]] = zero
        out[COL["prod"]] = torch.ones((), dtype=torch.float64, device=dev)
        return torch.stack(out)
    buf = scratch[:n] if scratch is not None and scratch.numel() >= n and scratch.dtype == values.dtype else None

    floats: dict[str, torch.Tensor] = {}
    total = values.sum()
    floats["sum"] = total
    floats["min"], floats["max"] = torch.aminmax(values)
    if columns & {"m2", "sumsq"}:
        centred = torch.sub(values, total / n, out=buf) if buf is not None else values - total / n
        m2 = _centred_m2(centred, n)
        floats["m2"] = m2
        # sum of squares from the centred moment: both terms are positive, nothing cancels
        # (a NaN or Inf in the tensor is resolved from the counts in `finalize`)
        floats["sumsq"] = m2 + total.square() / n
    if columns & {"l1", "abs_min", "abs_m2", "abs_median"}:
        magnitude = torch.abs(values, out=buf) if buf is not None else values.abs()
        l1 = magnitude.sum()
        floats["l1"] = l1
        if "abs_min" in columns:
            floats["abs_min"] = magnitude.amin()
        if "abs_median" in columns:
            floats["abs_median"] = _exact_median(magnitude)
        if "abs_m2" in columns:
            floats["abs_m2"] = _centred_m2(magnitude.sub_(l1 / n), n)
    if "prod" in columns:
        floats["prod"] = values.to(torch.float64).prod()
    if "median" in columns:
        floats["median"] = _exact_median(values)
    names = list(floats)
    stacked = torch.stack([floats[k].to(values.dtype) for k in names]).to(torch.float64)
    for i, k in enumerate(names):
        out[COL[k]] = stacked[i]
    if "prod" in floats:  # keep the float64 product unrounded
        out[COL["prod"]] = floats["prod"]
    if "zero_count" in columns:  # a count, kept exact in float64 (float32 is exact only to 2**24)
        out[COL["zero_count"]] = (n - torch.count_nonzero(values)).to(torch.float64)
    return torch.stack(out)


def nonfinite_counts(values: torch.Tensor) -> torch.Tensor:
    """``[nan_count, inf_count]`` as float64, computed only for tensors known to hold NaN or Inf."""
    return torch.stack([torch.isnan(values).sum(), torch.isinf(values).sum()]).to(torch.float64)


def merge_partials(rows: torch.Tensor) -> torch.Tensor:
    """Merge partial rows ``[..., W, len(PARTIALS)]`` of disjoint pieces into ``[..., len(PARTIALS)]``.

    Exact for every column but the medians, which become NaN when more than one non-empty piece
    is merged (a median cannot be merged from summaries; the caller may estimate it from the
    merged histogram and must say so).
    """
    rows = rows.to(torch.float64)
    c = rows[..., COL["count"]]
    n = c.sum(-1)
    out = torch.full(rows.shape[:-2] + (len(PARTIALS),), math.nan, dtype=torch.float64, device=rows.device)
    out[..., COL["count"]] = n
    for name in ("sum", "sumsq", "l1", "nan_count", "inf_count", "zero_count"):
        out[..., COL[name]] = rows[..., COL[name]].sum(-1)
    present = c > 0
    inf = torch.tensor(math.inf, dtype=torch.float64, device=rows.device)
    for name, reduce, fill in (("min", torch.amin, inf), ("max", torch.amax, -inf), ("abs_min", torch.amin, inf)):
        col = torch.where(present, rows[..., COL[name]], fill)
        merged = reduce(col, -1)
        out[..., COL[name]] = torch.where(n > 0, merged, torch.full_like(merged, math.nan))
    out[..., COL["prod"]] = rows[..., COL["prod"]].prod(-1)

    def _merged_m2(total_col: str, m2_col: str) -> torch.Tensor:
        # sum_i M2_i + sum_i c_i (mean_i - mean)^2: the pairwise Chan update applied to all pieces at once
        mean_i = torch.where(present, rows[..., COL[total_col]] / c.clamp(min=1), torch.zeros_like(c))
        mean = out[..., COL[total_col]] / n.clamp(min=1)
        spread = torch.where(present, c * (mean_i - mean.unsqueeze(-1)) ** 2, torch.zeros_like(c))
        m2_i = torch.where(present, rows[..., COL[m2_col]], torch.zeros_like(c))
        return m2_i.sum(-1) + spread.sum(-1)

    out[..., COL["m2"]] = _merged_m2("sum", "m2")
    out[..., COL["abs_m2"]] = _merged_m2("l1", "abs_m2")
    single = present.sum(-1) <= 1
    for name in ("median", "abs_median"):
        pick = torch.where(present, rows[..., COL[name]], torch.zeros_like(c)).sum(-1)
        out[..., COL[name]] = torch.where(single & (n > 0), pick, torch.full_like(pick, math.nan))
    return out


def finalize(row: np.ndarray, stat_names: tuple[str, ...] | list[str]) -> dict[str, float]:
    """Named statistics from one partial row (host, float64)."""
    p = {name: float(row[i]) for i, name in enumerate(PARTIALS)}
    n = p["count"]
    empty = n == 0
    nan = math.nan

    def div(a: float, b: float) -> float:
        return a / b if b else nan

    with np.errstate(all="ignore"):
        linf = nan if empty else float(np.fmax(abs(p["min"]), abs(p["max"]))) if not (
            math.isnan(p["min"]) or math.isnan(p["max"])
        ) else nan
        if empty:
            linf = 0.0
        variance = nan if empty else max(p["m2"] / n, 0.0) if not math.isnan(p["m2"]) else nan
        abs_variance = nan if empty else max(p["abs_m2"] / n, 0.0) if not math.isnan(p["abs_m2"]) else nan
        l2 = math.sqrt(max(p["sumsq"], 0.0)) if not math.isnan(p["sumsq"]) else nan
        if p["nan_count"] > 0:  # numpy: a NaN makes every norm NaN, an Inf (without NaN) makes it Inf
            l2 = nan
        elif p["inf_count"] > 0:
            l2 = math.inf
        values = {
            "numel": n,
            "nan_count": p["nan_count"],
            "inf_count": p["inf_count"],
            "min": p["min"],
            "max": p["max"],
            "sum": p["sum"],
            "mean": div(p["sum"], n),
            "variance": variance,
            "std": math.sqrt(variance) if not math.isnan(variance) else nan,
            "prod": p["prod"],
            "median": p["median"],
            "l1": p["l1"],
            "l2": l2,
            "linf": linf,
            "abs_min": p["abs_min"],
            "abs_max": linf,
            "abs_sum": p["l1"],
            "abs_mean": div(p["l1"], n),
            "abs_variance": abs_variance,
            "abs_std": math.sqrt(abs_variance) if not math.isnan(abs_variance) else nan,
            "abs_prod": abs(p["prod"]),
            "abs_median": p["abs_median"],
            "abs_l1": p["l1"],
            "abs_l2": l2,
            "abs_linf": linf,
            "zero_fraction": div(p["zero_count"], n),
        }
    return {name: values[name] for name in stat_names}


# --------------------------------------------------------------------------------------------
# Histograms


def strided_sample(values: torch.Tensor, sample: int | None) -> torch.Tensor:
    """At most ``sample`` values taken at a fixed stride: ``values[::ceil(n / sample)]``."""
    n = values.numel()
    if sample is None or n <= sample:
        return values
    return values[:: -(-n // sample)]


def reject_outliers(values: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the ``fraction`` of finite values farthest from their median.

    Returns ``(kept_mask, rejected_count)``; non-finite values are not kept and not counted as
    rejected (they have their own counts).
    """
    finite = torch.isfinite(values)
    if fraction <= 0.0 or values.numel() == 0:
        return finite, torch.zeros((), dtype=torch.int64, device=values.device)
    finite_values = values[finite]
    m = finite_values.numel()
    if m == 0:
        return finite, torch.zeros((), dtype=torch.int64, device=values.device)
    median = finite_values.kthvalue((m + 1) // 2).values
    distance = (values - median).abs()
    keep = max(1, math.ceil((1.0 - fraction) * m))
    threshold = (finite_values - median).abs().kthvalue(keep).values
    kept = finite & (distance <= threshold)
    return kept, finite.sum() - kept.sum()


def histogram_edges(low: torch.Tensor, high: torch.Tensor, bins: int, dtype: torch.dtype) -> torch.Tensor:
    """``bins + 1`` edges over ``[low, high]`` (0-d tensors), rounded to ``dtype``.

    A degenerate range (``low == high``) is widened to ``[low - 0.5, high + 0.5]``, as numpy does.
    The edges are rounded to the dtype the values are compared in, so that the reported edges are
    exactly the ones used: ``np.histogram(values, bins=edges)`` reproduces the counts.
    """
    low = low.to(torch.float64)
    high = high.to(torch.float64)
    same = low == high
    low = torch.where(same, low - 0.5, low)
    high = torch.where(same, high + 0.5, high)
    steps = torch.arange(bins + 1, dtype=torch.float64, device=low.device)
    edges = low + steps * ((high - low) / bins)
    edges[-1] = high
    return edges.to(dtype)


def histogram_counts(values: torch.Tensor, edges: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Counts of ``values`` in ``edges`` (numpy semantics: ``[e_i, e_i+1)``, the last bin closed).

    Values outside ``[edges[0], edges[-1]]``, NaN, and values where ``mask`` is False are not
    counted. The bin is found arithmetically, then corrected against the edges themselves, which
    gives numpy's exact answer for the same edges at the cost of a few elementwise passes.
    """
    bins = edges.numel() - 1
    values = values.to(edges.dtype)
    low, high = edges[0], edges[-1]
    inside = (values >= low) & (values <= high)
    if mask is not None:
        inside &= mask
    scale = bins / (high - low)
    index = ((values - low) * scale).nan_to_num_(0.0, 0.0, 0.0).floor_().clamp_(0, bins - 1).to(torch.int64)
    index -= (values < edges[index]).to(torch.int64)
    index.clamp_(0, bins - 1)
    index += ((values >= edges[index + 1]) & (index < bins - 1)).to(torch.int64)
    index = torch.where(inside, index, torch.full_like(index, bins))
    return torch.bincount(index, minlength=bins + 1)[:bins]
