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
their own precision, merged in float64), GPU tensors where triton imports to the Triton kernels
(:mod:`tensorlens.stats.triton`: the same blocks and merge); everything else to PyTorch's pairwise
(cascade) reductions in float32 (float64 for float64 tensors). :mod:`tensorlens.stats.path` chooses. Either way the variance is the corrected
two-pass algorithm (around the mean), so a constant tensor has variance 0 and large offsets do
not cancel. Variance and std are population statistics (numpy's ``ddof=0``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable

import numpy as np
import torch

from tensorlens.stats import native, registry
from tensorlens.stats.torch_rows import TorchRows, nonfinite_count_rows

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
    """Partial rows ``[N, len(PARTIALS)]`` (float64, on the tensors' device).

    ``values`` are flat tensors in their compute dtype (:func:`as_values`), ``columns[i]`` the
    columns tensor ``i`` needs (:func:`needed_columns`); others are NaN. ``nan_count`` and
    ``inf_count`` are exact (see :class:`~tensorlens.stats.torch_rows.TorchRows`; off the CPU
    without a host sync). Every step of a model uses :mod:`tensorlens.compute.plan` instead,
    which keeps the grouping across steps.
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
    samples: dict[int, torch.Tensor] = {}
    rows = torch.full((n_rows, len(PARTIALS)), math.nan, dtype=torch.float64, device=device)
    done = _native_rows(rows, values, columns, sample_strides or {}, samples)
    rest = [i for i in range(n_rows) if i not in done]
    if rest:
        plan = TorchRows(
            [values[i].numel() for i in rest], [values[i].dtype for i in rest], [columns[i] for i in rest], device,
            counts="flagged" if device.type == "cpu" else "always",
        )
        found = plan.run([values[i] for i in rest], scratch)
        rows = found if len(rest) == n_rows else rows.index_copy(0, torch.tensor(rest, device=device), found)
    return rows, samples


#: The columns the compiled CPU kernel computes (:mod:`tensorlens.native`); a tensor that needs
#: another one (median, prod, abs_min, abs_std, a column declared with its own ``compute``) is
#: reduced with PyTorch ops instead.
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


def partial_row(values: torch.Tensor, columns: frozenset[str]) -> torch.Tensor:
    """The partial row of one flat tensor (see :func:`partial_rows`)."""
    return partial_rows([values], [columns])[0]


def nonfinite_counts(values: torch.Tensor) -> torch.Tensor:
    """``[nan_count, inf_count]`` as float64 of a flat tensor (see :func:`nonfinite_count_rows`)."""
    return nonfinite_count_rows(values.reshape(1, -1))[0]


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
    zeros = torch.zeros_like(c)
    for column in registry.COLUMNS:
        col = rows[..., COL[column.name]]
        if column.merge == "sum":
            out[..., COL[column.name]] = col.sum(-1)
        elif column.merge == "prod":
            out[..., COL[column.name]] = col.prod(-1)
        elif column.merge in ("min", "max"):
            # a Python number, not a tensor made here: that would be a host-to-device copy (a sync)
            reduce, fill = (torch.amin, math.inf) if column.merge == "min" else (torch.amax, -math.inf)
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


def finalize_rows(rows: np.ndarray, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """The declared statistics ``names`` (:mod:`tensorlens.stats.registry`; all of them by
    default) of every partial row ``[N, len(PARTIALS)]``, as arrays ``[N]``.

    Vectorised: the dispatcher thread turns a whole step into statistics in a few numpy calls
    instead of a Python loop per tensor, so it holds the GIL (which the training thread needs
    between any two torch ops) for as short a time as possible.
    """
    return registry.finalize_all({name: rows[:, i] for i, name in enumerate(PARTIALS)}, names)
