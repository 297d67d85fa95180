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

Precision: float16/bfloat16 are widened to float32, integers and bools to float64. CPU float
tensors go to the compiled kernel (:mod:`tensorlens.native`: blocks of 4096 values accumulated in
their own precision, merged in float64); everything else to PyTorch's pairwise (cascade)
reductions in float32 (float64 for float64 tensors). Either way the variance is the corrected
two-pass algorithm (around the mean), so a constant tensor has variance 0 and large offsets do
not cancel. Variance and std are population statistics (numpy's ``ddof=0``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import torch

from tensorlens.stats import native, registry

#: Columns of a partial row, in order (declared with their merge rules in :mod:`tensorlens.stats.registry`).
PARTIALS = tuple(column.name for column in registry.COLUMNS)
COL = {name: i for i, name in enumerate(PARTIALS)}


def needed_columns(stat_names: tuple[str, ...] | list[str]) -> frozenset[str]:
    """The partial columns that must be computed to produce ``stat_names``."""
    return _needed_columns(tuple(stat_names))


@functools.lru_cache(maxsize=256)  # asked for every tensor of every saved step, with a few distinct configs
def _needed_columns(stat_names: tuple[str, ...]) -> frozenset[str]:
    return registry.needed_columns(stat_names)


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
    """numpy's median of a flat tensor (see :func:`_exact_median_rows`); NaN when empty."""
    if values.numel() == 0:
        return torch.tensor(math.nan, dtype=torch.float64, device=values.device)
    return _exact_median_rows(values.reshape(1, -1))[0]


#: Tensors up to this many values share one float64 buffer with segment sums; larger ones are
#: reduced one by one. Per-tensor ops cost ~5-10 us of dispatch each, which dominates for small
#: tensors (biases, norms, activations of small batches); a shared buffer costs a fixed number of ops.
SMALL_TENSOR = 2048


def partial_rows(
    values: list[torch.Tensor],
    columns: list[frozenset[str]],
    scratch: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Partial rows ``[N, len(PARTIALS)]`` (see :func:`partial_rows_and_samples`)."""
    return partial_rows_and_samples(values, columns, scratch)[0]


def partial_rows_and_samples(
    values: list[torch.Tensor],
    columns: list[frozenset[str]],
    scratch: Callable[[torch.Tensor], torch.Tensor] | None = None,
    sample_strides: dict[int, int] | None = None,
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Partial rows ``[N, len(PARTIALS)]`` (float64, on the tensors' device) with no host sync.

    ``values`` are flat tensors in their compute dtype (:func:`as_values`), ``columns[i]`` the
    columns tensor ``i`` needs (:func:`needed_columns`); others are NaN. ``nan_count`` and
    ``inf_count`` are left NaN: the caller learns from ``sum``/``min``/``max`` after the one host
    copy whether a tensor holds NaN or Inf, and counts only those (:func:`nonfinite_counts`).
    ``scratch(values)`` may return a reusable buffer at least as long as ``values``.
    ``sample_strides[i]`` asks for every ``sample_strides[i]``-th value of tensor ``i`` (its
    histogram sample): the compiled CPU kernel gathers it in the same read and returns it in the
    dict; the caller takes :func:`strided_sample` itself for the tensors missing there.

    The variance is the corrected two-pass algorithm (Chan, Golub & LeVeque): deviations from
    the mean, minus ``(sum of deviations)^2 / n``, which cancels the rounding error of the mean,
    so a constant tensor has exactly zero spread even in float32. Sums use PyTorch's cascade
    ``sum`` (``vector_norm`` on CPU accumulates float32 naively: 1e-4 relative error at 3M values).
    """
    n_rows = len(values)
    if n_rows == 0:
        return torch.zeros((0, len(PARTIALS)), dtype=torch.float64), {}
    device = values[0].device
    rows = torch.full((n_rows, len(PARTIALS)), math.nan, dtype=torch.float64, device=device)
    counts = [v.numel() for v in values]
    rows[:, COL["count"]] = torch.tensor(counts, dtype=torch.float64, device=device)
    samples: dict[int, torch.Tensor] = {}
    done = _native_rows(rows, values, columns, sample_strides or {}, samples)
    small = [i for i in range(n_rows) if counts[i] <= SMALL_TENSOR and i not in done]
    large = [i for i in range(n_rows) if counts[i] > SMALL_TENSOR and i not in done]
    if small:
        _small_rows(rows, small, [values[i] for i in small], frozenset().union(*(columns[i] for i in small)))
    if large:
        _large_rows(rows, large, [values[i] for i in large], [columns[i] for i in large], scratch)
    return rows, samples


#: The columns the compiled CPU kernel computes (:mod:`tensorlens.native`); a tensor that needs
#: another one (median, prod, abs_min, abs_std) is reduced with PyTorch ops instead.
NATIVE_COLUMNS = frozenset({"count", "sum", "sumsq", "m2", "l1", "min", "max", "zero_count", "nan_count", "inf_count"})


def _native_rows(
    rows: torch.Tensor,
    values: list[torch.Tensor],
    columns: list[frozenset[str]],
    sample_strides: dict[int, int],
    samples: dict[int, torch.Tensor],
) -> set[int]:
    """Fill the rows the compiled kernel can compute (CPU float tensors) and the samples asked
    for; return the indices done."""
    index = [i for i, v in enumerate(values) if columns[i] <= NATIVE_COLUMNS and native.supports(v)]
    found = native.moments(
        [values[i] for i in index], sample_strides=[sample_strides.get(i, 0) for i in index], columns=[columns[i] for i in index]
    ) if index else None
    if found is None:
        return set()
    found, gathered = found
    samples.update({i: sample for i, sample in zip(index, gathered, strict=True) if sample is not None})
    block = native_partial_rows(found)
    wanted = np.stack([_column_mask(columns[i]) for i in index])
    block[~wanted] = math.nan  # as the PyTorch path: NaN where a column was not requested
    rows[torch.tensor(index, device=rows.device)] = torch.from_numpy(block).to(rows.device)
    return set(index)


@functools.lru_cache(maxsize=256)
def _column_mask(columns: frozenset[str]) -> np.ndarray:
    """Which of :data:`PARTIALS` ``columns`` names, as a boolean row."""
    return np.array([name in columns for name in PARTIALS])


def native_partial_rows(found: np.ndarray) -> np.ndarray:
    """Partial rows ``[k, len(PARTIALS)]`` from :func:`tensorlens.native.moments` output (every
    column the kernel computes; the others NaN)."""
    block = np.full((len(found), len(PARTIALS)), math.nan)
    block[:, _FROM_NATIVE] = found
    count, total = found[:, _NATIVE_COUNT], found[:, _NATIVE_SUM]
    # sum^2 / n, 0 for an empty tensor (np.divide's where=, not np.errstate: called once per
    # large activation, and the context manager cost more than the arithmetic)
    mean_square = np.divide(total * total, count, out=np.zeros_like(total), where=count > 0)
    block[:, COL["sumsq"]] = found[:, _NATIVE_M2] + mean_square
    return block


_FROM_NATIVE = np.array([COL[name] for name in native.COLUMNS])
_NATIVE_COUNT, _NATIVE_SUM, _NATIVE_M2 = (native.COLUMNS.index(name) for name in ("count", "sum", "m2"))


def _set(rows: torch.Tensor, index: list[int], column: str, value: torch.Tensor) -> None:
    rows[torch.tensor(index, device=rows.device), COL[column]] = value.to(torch.float64)


def _small_rows(rows: torch.Tensor, index: list[int], values: list[torch.Tensor], columns: frozenset[str]) -> None:
    """Segment reductions over one float64 buffer holding every small tensor."""
    device = rows.device
    flat = torch.cat([v.to(torch.float64) for v in values])
    lengths = torch.tensor([v.numel() for v in values], device=device)
    n = lengths.to(torch.float64)
    segment = torch.repeat_interleave(torch.arange(len(values), device=device), lengths)
    zeros = torch.zeros(len(values), dtype=torch.float64, device=device)
    empty = lengths == 0

    def seg_sum(x: torch.Tensor) -> torch.Tensor:
        return zeros.clone().index_add_(0, segment, x)

    def seg_extreme(x: torch.Tensor, how: str) -> torch.Tensor:
        start = math.inf if how == "amin" else -math.inf
        out = torch.full_like(zeros, start).scatter_reduce_(0, segment, x, how, include_self=True)
        return torch.where(empty, torch.full_like(out, math.nan), out)

    total = seg_sum(flat)
    _set(rows, index, "sum", total)
    _set(rows, index, "min", seg_extreme(flat, "amin"))
    _set(rows, index, "max", seg_extreme(flat, "amax"))
    safe_n = n.clamp(min=1)
    if columns & {"m2", "sumsq"}:
        centred = flat - (total / safe_n)[segment]
        m2 = seg_sum(centred.square()) - seg_sum(centred).square() / safe_n
        _set(rows, index, "m2", m2)
        _set(rows, index, "sumsq", m2 + total.square() / safe_n)
    if columns & {"l1", "abs_min", "abs_m2"}:
        magnitude = flat.abs()
        l1 = seg_sum(magnitude)
        _set(rows, index, "l1", l1)
        if "abs_min" in columns:
            _set(rows, index, "abs_min", seg_extreme(magnitude, "amin"))
        if "abs_m2" in columns:
            centred = magnitude - (l1 / safe_n)[segment]
            _set(rows, index, "abs_m2", seg_sum(centred.square()) - seg_sum(centred).square() / safe_n)
    if "zero_count" in columns:
        _set(rows, index, "zero_count", seg_sum((flat == 0).to(torch.float64)))
    if "prod" in columns:
        _set(rows, index, "prod", torch.ones_like(zeros).scatter_reduce_(0, segment, flat, "prod", include_self=True))
    for name in ("median", "abs_median"):  # not a segment reduction: one sort per tensor, only on request
        if name in columns:
            medians = [_exact_median(v.abs() if name == "abs_median" else v) for v in values]
            _set(rows, index, name, torch.stack([m.to(torch.float64) for m in medians]))


#: Tensors of equal size up to this many values are stacked into one matrix and reduced along
#: its rows: a handful of ops for the group instead of per tensor (16 activations of a batch, the
#: small weights of a model). Larger tensors are reduced one by one: there the dispatch cost of an
#: op is small next to its work, and stacking them (a copy into fresh memory) costs more than it
#: saves (16 x 262144 float32: 1.8 ms to stack, 0.4 ms of ops saved).
STACK_TENSOR = 1 << 16
#: At most this many values per stacked matrix (float32: 16 MiB, plus as much scratch).
STACK_VALUES = 1 << 22


def _stacked_blocks(
    values: list[torch.Tensor], columns: list[frozenset[str]]
) -> list[tuple[list[int], torch.Tensor, frozenset[str]]]:
    """``(positions, matrix [k, n], columns)`` covering every tensor once: equal-size tensors
    (same dtype, device and requested columns) stacked, the others as ``[1, n]`` views."""
    groups: dict[tuple[object, ...], list[int]] = {}
    blocks = []
    for i, v in enumerate(values):
        n = v.numel()
        if n <= STACK_TENSOR:
            groups.setdefault((n, v.dtype, v.device, columns[i]), []).append(i)
        else:
            blocks.append(([i], v.view(1, n), columns[i]))
    for (n, _, _, cols), members in groups.items():
        per_block = max(1, STACK_VALUES // n)
        for start in range(0, len(members), per_block):
            chunk = members[start : start + per_block]
            matrix = values[chunk[0]].view(1, n) if len(chunk) == 1 else torch.stack([values[i] for i in chunk])
            blocks.append((chunk, matrix, cols))
    return blocks


def _large_rows(
    rows: torch.Tensor,
    index: list[int],
    values: list[torch.Tensor],
    columns: list[frozenset[str]],
    scratch: Callable[[torch.Tensor], torch.Tensor] | None,
) -> None:
    """Row-wise reductions of :func:`_stacked_blocks`; the scalar arithmetic that turns them into
    partial rows is done once for all blocks (per-block conversions cost more than the blocks)."""
    device = rows.device
    raw: dict[str, list[torch.Tensor]] = {}
    order: list[int] = []
    lengths: list[torch.Tensor] = []
    for positions, matrix, cols in _stacked_blocks(values, columns):
        k, n = matrix.shape
        found = _block_raw(matrix, cols, scratch)
        for name in _RAW:
            raw.setdefault(name, []).append(found[name] if name in found else torch.full((k,), math.nan, device=device))
        order += [index[p] for p in positions]
        lengths.append(torch.full((k,), float(n), dtype=torch.float64, device=device))
    r = {name: torch.cat(parts).to(torch.float64) for name, parts in raw.items()}  # cat promotes to the widest dtype
    n = torch.cat(lengths)
    m2 = r["sq"] - r["dev"].square() / n
    block = {
        "sum": r["sum"], "min": r["min"], "max": r["max"], "m2": m2, "sumsq": m2 + r["sum"].square() / n,
        "l1": r["l1"], "abs_min": r["abs_min"], "abs_m2": r["abs_sq"] - r["abs_dev"].square() / n,
        "zero_count": r["zero_count"], "prod": r["prod"], "median": r["median"], "abs_median": r["abs_median"],
    }
    at = torch.tensor(order, device=device)
    names = list(block)
    rows[at.unsqueeze(1), torch.tensor([COL[c] for c in names], device=device)] = torch.stack([block[c] for c in names], dim=1)


#: What :func:`_block_raw` returns, per row of a block (NaN where not requested).
_RAW = ("sum", "min", "max", "dev", "sq", "l1", "abs_min", "abs_dev", "abs_sq", "zero_count", "prod", "median", "abs_median")


def _block_raw(
    matrix: torch.Tensor, cols: frozenset[str], scratch: Callable[[torch.Tensor], torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """Reductions ``[k]`` of the ``k`` rows of ``matrix`` ``[k, n]``, named as in :data:`_RAW`."""
    k, n = matrix.shape
    buf = scratch(matrix)[: k * n].view(k, n) if scratch is not None else torch.empty_like(matrix)
    total = matrix.sum(1)
    # not aminmax(dim=1): on CPU it is 5-10x slower than amin and amax along a dimension
    out = {"sum": total, "min": matrix.amin(1), "max": matrix.amax(1)}
    if cols & {"m2", "sumsq"}:
        centred = torch.sub(matrix, (total / n).unsqueeze(1), out=buf)  # x - mean, into the scratch buffer
        out["dev"] = centred.sum(1)
        # squares summed by the cascade sum: a BLAS dot errs by ~3e-6 relative at 3M values
        # (and varies with the thread count), vector_norm's naive float32 loop by 1e-4
        out["sq"] = centred.square_().sum(1)
    if cols & {"l1", "abs_min", "abs_m2", "abs_median"}:
        magnitude = torch.abs(matrix, out=buf)
        l1 = magnitude.sum(1)
        out["l1"] = l1
        if "abs_min" in cols:
            out["abs_min"] = magnitude.amin(1)
        if "abs_median" in cols:
            out["abs_median"] = _exact_median_rows(magnitude)
        if "abs_m2" in cols:
            centred = magnitude.sub_((l1 / n).unsqueeze(1))
            out["abs_dev"] = centred.sum(1)
            out["abs_sq"] = centred.square_().sum(1)
    if "zero_count" in cols:
        out["zero_count"] = n - matrix.bool().sum(1)  # exact; NaN counts as non-zero
    if "prod" in cols:
        out["prod"] = matrix.to(torch.float64).prod(1)
    if "median" in cols:
        out["median"] = _exact_median_rows(matrix)
    return out


def _exact_median_rows(matrix: torch.Tensor) -> torch.Tensor:
    """numpy's median of every row of ``[k, n]`` (``n > 0``): the mean of the two middle values
    for an even count; NaN for a row holding NaN."""
    n = matrix.shape[1]
    lower = matrix.kthvalue((n + 1) // 2, dim=1).values
    median = (lower + matrix.kthvalue(n // 2 + 1, dim=1).values) / 2 if n % 2 == 0 else lower
    return torch.where(torch.isnan(matrix).any(1), torch.full_like(median, math.nan), median)


def partial_row(values: torch.Tensor, columns: frozenset[str]) -> torch.Tensor:
    """The partial row of one flat tensor (see :func:`partial_rows`)."""
    return partial_rows([values], [columns])[0]


def nonfinite_counts(values: torch.Tensor) -> torch.Tensor:
    """``[nan_count, inf_count]`` as float64, computed only for tensors known to hold NaN or Inf."""
    return torch.stack([torch.isnan(values).sum(), torch.isinf(values).sum()]).to(torch.float64)


def merge_partials(rows: torch.Tensor) -> torch.Tensor:
    """Merge partial rows ``[..., W, len(PARTIALS)]`` of disjoint pieces into ``[..., len(PARTIALS)]``,
    each column by its rule in :mod:`tensorlens.stats.registry`.

    Exact for every column but the medians, which become NaN when more than one non-empty piece
    is merged (a median cannot be merged from summaries; the caller may estimate it from the
    merged histogram and must say so).
    """
    rows = rows.to(torch.float64)
    c = rows[..., COL["count"]]
    n = c.sum(-1)
    out = torch.full(rows.shape[:-2] + (len(PARTIALS),), math.nan, dtype=torch.float64, device=rows.device)
    present = c > 0
    inf = torch.tensor(math.inf, dtype=torch.float64, device=rows.device)
    zeros = torch.zeros_like(c)
    for column in registry.COLUMNS:
        col = rows[..., COL[column.name]]
        if column.merge == "sum":
            out[..., COL[column.name]] = col.sum(-1)
        elif column.merge == "prod":
            out[..., COL[column.name]] = col.prod(-1)
        elif column.merge in ("min", "max"):
            reduce, fill = (torch.amin, inf) if column.merge == "min" else (torch.amax, -inf)
            merged = reduce(torch.where(present, col, fill), -1)
            out[..., COL[column.name]] = torch.where(n > 0, merged, torch.full_like(merged, math.nan))
        elif column.merge == "single":
            pick = torch.where(present, col, zeros).sum(-1)
            single = present.sum(-1) <= 1
            out[..., COL[column.name]] = torch.where(single & (n > 0), pick, torch.full_like(pick, math.nan))
    for column in registry.COLUMNS:
        if column.merge.startswith("m2:"):
            # sum_i M2_i + sum_i c_i (mean_i - mean)^2: Chan's pairwise update applied to all pieces at once
            total = column.merge.split(":", 1)[1]
            mean_i = torch.where(present, rows[..., COL[total]] / c.clamp(min=1), zeros)
            mean = out[..., COL[total]] / n.clamp(min=1)
            spread = torch.where(present, c * (mean_i - mean.unsqueeze(-1)) ** 2, zeros)
            m2_i = torch.where(present, rows[..., COL[column.name]], zeros)
            out[..., COL[column.name]] = m2_i.sum(-1) + spread.sum(-1)
    return out


def finalize(row: np.ndarray, stat_names: tuple[str, ...] | list[str]) -> dict[str, float]:
    """Named statistics from one partial row (host, float64)."""
    table = finalize_rows(np.asarray(row, dtype=np.float64)[None, :])
    return {name: float(table[name][0]) for name in stat_names}


def finalize_rows(rows: np.ndarray) -> dict[str, np.ndarray]:
    """Every declared statistic (:mod:`tensorlens.stats.registry`) of every partial row
    ``[N, len(PARTIALS)]``, as arrays ``[N]``.

    Vectorised: the dispatcher thread turns a whole step into statistics in a few numpy calls
    instead of a Python loop per tensor, so it holds the GIL (which the training thread needs
    between any two torch ops) for as short a time as possible.
    """
    return registry.finalize_all({name: rows[:, i] for i, name in enumerate(PARTIALS)})
