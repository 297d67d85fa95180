"""Partial rows with PyTorch ops, planned once for a fixed set of tensors (the GPU path, and the
CPU path where the compiled kernel is not built).

A :class:`TorchRows` groups the tensors of a step once, while their sizes, dtypes and requested
columns stay the same: small tensors share one float64 buffer reduced with segment sums (segment
ids built once, on the device), equal-size tensors up to :data:`STACK_TENSOR` values are stacked
into one matrix and reduced along its rows, larger ones are reduced one by one. Each step then
costs a fixed handful of ops per group and no Python per tensor beyond a list entry.

No op here waits for the device: no ``.item()``, no ``bincount``/``nonzero``/boolean indexing
(whose output size depends on the data), index tensors copied to the device once per plan from
pinned memory without blocking. ``tests/test_sync_free.py`` counts such calls.

The variance is the corrected two-pass algorithm (Chan, Golub & LeVeque): deviations from the
float mean, minus ``(sum of deviations)^2 / n``, which cancels the rounding error of the mean.
Sums use PyTorch's cascade ``sum`` (``vector_norm`` on CPU accumulates float32 naively).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tensorlens.stats import registry

PARTIALS = tuple(column.name for column in registry.COLUMNS)
COL = {name: i for i, name in enumerate(PARTIALS)}
#: Columns declared with their own ``compute`` (:class:`~tensorlens.stats.registry.Column`): the
#: fused passes below know nothing of them; each block's values are handed to the function.
DECLARED = {column.name: column.compute for column in registry.COLUMNS if column.compute is not None}

#: Tensors up to this many values share one float64 buffer with segment sums; larger ones are
#: reduced by rows. Per-tensor ops cost ~5-10 us of dispatch each, which dominates for small
#: tensors (biases, norms, activations of small batches); a shared buffer costs a fixed number of ops.
SMALL_TENSOR = 2048
#: Tensors of equal size up to this many values are stacked into one matrix and reduced along
#: its rows: a handful of ops for the group instead of per tensor. Larger tensors are reduced one
#: by one: there the dispatch cost of an op is small next to its work, and stacking them (a copy
#: into fresh memory) costs more than it saves (16 x 262144 float32: 1.8 ms to stack, 0.4 ms saved).
STACK_TENSOR = 1 << 16
#: At most this many values per stacked matrix (float32: 16 MiB, plus as much scratch).
STACK_VALUES = 1 << 22
#: float32 sums of ones are exact below this count; larger counts are summed in float64.
_EXACT_FLOAT32_COUNT = 1 << 24


def to_device(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant tensor on ``device`` without blocking the host: built on the CPU and, for
    another device, copied from pinned memory asynchronously (a copy from pageable memory makes
    the host wait for the device)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    try:
        host = host.pin_memory()
    except RuntimeError:  # no pinned memory on this device type: a plain copy
        return host.to(device)
    return host.to(device, non_blocking=True)


#: Raw reductions of a block, per row, in the order of :meth:`TorchRows._block`'s output.
_RAW_BASE = ("sum", "min", "max")


def _raw_names(cols: frozenset[str]) -> tuple[str, ...]:
    names = list(_RAW_BASE)
    if cols & {"m2", "sumsq"}:
        names += ["dev", "sq"]
    if cols & {"l1", "abs_min", "abs_m2", "abs_median"}:
        names.append("l1")
        if "abs_min" in cols:
            names.append("abs_min")
        if "abs_median" in cols:
            names.append("abs_median")
        if "abs_m2" in cols:
            names += ["abs_dev", "abs_sq"]
    if "prod" in cols:
        names.append("prod")
    if "median" in cols:
        names.append("median")
    return tuple(names)


class _BlockSet:
    """Blocks sharing one column set: their raw reductions are stacked, converted and written
    into the rows together."""

    def __init__(self, cols: frozenset[str], counts: bool) -> None:
        self.cols = cols
        self.raw = _raw_names(cols)
        self.zeros = "zero_count" in cols
        self.declared = tuple(name for name in DECLARED if name in cols)
        self.counts = counts
        self.blocks: list[tuple[list[int], int, bool]] = []  # (positions, n, stacked)
        self.order: list[int] = []
        self.lengths: list[float] = []
        self.row_index: torch.Tensor | None = None
        self.n: torch.Tensor | None = None
        self.columns: torch.Tensor | None = None
        self.names: tuple[str, ...] = ()
        self.order_host = np.zeros(0, dtype=np.intp)
        self.columns_host = np.zeros(0, dtype=np.intp)
        self.n_host = np.zeros(0)


class TorchRows:
    """Partial rows ``[len(numels), len(PARTIALS)]`` (float64, on ``device``) of flat tensors of
    the given sizes and dtypes. ``columns[i]`` names the columns tensor ``i`` needs; the others
    are NaN. ``nan_count`` and ``inf_count`` are always exact:

    - ``counts="always"`` (any device): counted for every tensor in the first pass, with no host
      sync (a GPU never waits);
    - ``counts="flagged"`` (CPU tensors: reading a result costs nothing): each tensor's sum is read
      first; only tensors whose sum is not finite are counted, and one that is NaN throughout (a
      diverged run) skips every other reduction, so such a step costs less than a finite one.

    >>> rows = TorchRows([3, 5], [torch.float32] * 2, [frozenset({"sum"})] * 2, torch.device("cpu"))
    >>> rows.run([torch.ones(3), torch.ones(5)])[:, COL["sum"]].tolist()
    [3.0, 5.0]
    """

    def __init__(
        self, numels: list[int], dtypes: list[torch.dtype], columns: list[frozenset[str]], device: torch.device,
        counts: str = "always",
    ) -> None:
        if counts not in ("always", "flagged"):
            raise ValueError(f"Expected counts to be 'always' or 'flagged', but got {counts!r}")
        self.k = len(numels)
        self.device = device
        self.counts = counts
        self.numels = numels
        small = [i for i in range(self.k) if numels[i] <= SMALL_TENSOR]
        self.small = small
        if small:
            lengths = [numels[i] for i in small]
            self.small_columns = frozenset().union(*(columns[i] for i in small))
            self.small_dtype = dtypes[small[0]] if len({dtypes[i] for i in small}) == 1 else None
            self.small_index = to_device(small, torch.int64, device)
            self.small_segment = to_device(
                [g for g, n in enumerate(lengths) for _ in range(n)], torch.int64, device
            )
            self.small_n = to_device(lengths, torch.float64, device)
            self.small_empty = to_device([n == 0 for n in lengths], torch.bool, device)
        #: where tensor ``k``'s values start in :attr:`small_flat` (small tensors only)
        self.small_offsets = dict(zip(small, np.cumsum([0] + [numels[i] for i in small])[:-1].tolist(), strict=True))
        #: the last :meth:`run`'s small tensors, flattened together in float64 (their histograms read it)
        self.small_flat: torch.Tensor | None = None
        sets: dict[frozenset[str], _BlockSet] = {}
        groups: dict[tuple[object, ...], list[int]] = {}
        for i in range(self.k):
            n = numels[i]
            if n <= SMALL_TENSOR:
                continue
            block_set = sets.setdefault(columns[i], _BlockSet(columns[i], counts == "always"))
            if n <= STACK_TENSOR:
                groups.setdefault((n, dtypes[i], columns[i]), []).append(i)
            else:
                block_set.blocks.append(([i], n, False))
        for (n, _, cols), members in groups.items():
            per_block = max(1, STACK_VALUES // n)
            for start in range(0, len(members), per_block):
                chunk = members[start : start + per_block]
                sets[cols].blocks.append((chunk, n, len(chunk) > 1))
        for block_set in sets.values():
            for positions, n, _ in block_set.blocks:
                block_set.order += positions
                block_set.lengths += [float(n)] * len(positions)
            block_set.row_index = to_device(block_set.order, torch.int64, device)
            block_set.n = to_device(block_set.lengths, torch.float64, device)
            block_set.names = _partial_names(block_set.cols)
            block_set.columns = to_device([COL[c] for c in block_set.names], torch.int64, device)
            block_set.order_host = np.array(block_set.order, dtype=np.intp)
            block_set.columns_host = np.array([COL[c] for c in block_set.names], dtype=np.intp)
            block_set.n_host = np.array(block_set.lengths, dtype=np.float64)
        self.sets = list(sets.values())
        self._count = to_device([float(n) for n in numels], torch.float64, device)
        self._small_columns_index: dict[tuple[str, ...], torch.Tensor] = {}

    def run(
        self, values: list[torch.Tensor], scratch: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The rows of ``values`` (in their compute dtype, on the plan's device; contiguous, and flat
        unless small: those are flattened together)."""
        rows = torch.full((self.k, len(PARTIALS)), math.nan, dtype=torch.float64, device=self.device)
        if not self.k:
            return rows
        rows[:, COL["count"]] = self._count
        if self.small:
            self._small_rows(rows, [values[i] for i in self.small])
        for block_set in self.sets:
            self._block_rows(rows, block_set, values, scratch)
        return rows

    # ------------------------------------------------------------------ small tensors

    def _small_rows(self, rows: torch.Tensor, values: list[torch.Tensor]) -> None:
        """Segment reductions over one float64 buffer holding every small tensor."""
        columns = self.small_columns
        if self.small_dtype is not None:
            # reshape and concatenate in one C++ call: no Python per tensor
            flat = torch._C._nn.flatten_dense_tensors(values).to(torch.float64)
        else:
            flat = torch.cat([v.reshape(-1).to(torch.float64) for v in values])
        self.small_flat = flat
        segment, n, empty = self.small_segment, self.small_n, self.small_empty
        zeros = torch.zeros(len(values), dtype=torch.float64, device=self.device)

        def seg_sum(x: torch.Tensor) -> torch.Tensor:
            return zeros.clone().index_add_(0, segment, x)

        def seg_extreme(x: torch.Tensor, how: str) -> torch.Tensor:
            start = math.inf if how == "amin" else -math.inf
            out = torch.full_like(zeros, start).scatter_reduce_(0, segment, x, how, include_self=True)
            return torch.where(empty, torch.full_like(out, math.nan), out)

        out: dict[str, torch.Tensor] = {}
        total = seg_sum(flat)
        out["sum"], out["min"], out["max"] = total, seg_extreme(flat, "amin"), seg_extreme(flat, "amax")
        safe_n = n.clamp(min=1)
        if columns & {"m2", "sumsq"}:
            centred = flat - (total / safe_n)[segment]
            m2 = seg_sum(centred.square()) - seg_sum(centred).square() / safe_n
            out["m2"], out["sumsq"] = m2, m2 + total.square() / safe_n
        if columns & {"l1", "abs_min", "abs_m2", "abs_median"}:
            magnitude = flat.abs()
            l1 = seg_sum(magnitude)
            out["l1"] = l1
            if "abs_min" in columns:
                out["abs_min"] = seg_extreme(magnitude, "amin")
            if "abs_m2" in columns:
                centred = magnitude - (l1 / safe_n)[segment]
                out["abs_m2"] = seg_sum(centred.square()) - seg_sum(centred).square() / safe_n
        if "zero_count" in columns:
            out["zero_count"] = seg_sum((flat == 0).to(torch.float64))
        if "prod" in columns:
            out["prod"] = torch.ones_like(zeros).scatter_reduce_(0, segment, flat, "prod", include_self=True)
        for name, compute in DECLARED.items():  # a function of a [k, n] block: one call per small tensor
            if name in columns:
                out[name] = torch.cat([compute(v.reshape(1, -1)).reshape(1).to(torch.float64) for v in values])
        if self.counts == "always" or not np.isfinite(total.numpy()).all():  # flagged: a read on the CPU, free
            out["nan_count"] = seg_sum(torch.isnan(flat).to(torch.float64))
            out["inf_count"] = seg_sum(torch.isinf(flat).to(torch.float64))
        else:
            out["nan_count"] = out["inf_count"] = zeros
        for name in ("median", "abs_median"):  # not a segment reduction: one sort per tensor, only on request
            if name in columns:
                medians = [exact_median(v.abs() if name == "abs_median" else v) for v in values]
                out[name] = torch.stack([m.to(torch.float64) for m in medians])
        names = tuple(out)
        if names not in self._small_columns_index:
            self._small_columns_index[names] = to_device([COL[c] for c in names], torch.int64, self.device)
        rows[self.small_index.unsqueeze(1), self._small_columns_index[names]] = torch.stack([out[c] for c in names], dim=1)

    # ------------------------------------------------------------------ larger tensors, by rows

    def _block_rows(
        self, rows: torch.Tensor, block_set: _BlockSet, values: list[torch.Tensor],
        scratch: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> None:
        raw, zero_counts, counts, declared = [], [], [], []
        for positions, n, stacked in block_set.blocks:
            matrix = torch.stack([values[i] for i in positions]) if stacked else values[positions[0]].view(1, n)
            if block_set.declared:  # computed on the values whatever they hold
                declared.append(torch.stack(
                    [DECLARED[name](matrix).reshape(len(positions)).to(torch.float64) for name in block_set.declared], dim=1
                ))
            total = matrix.sum(1)
            nonfinite = None
            finite = False  # known to hold neither NaN nor Inf
            if self.counts == "flagged":
                nonfinite = torch.zeros((len(positions), 2), dtype=torch.float64)
                finite = bool(np.isfinite(total.numpy()).all())  # a read on the CPU, free
                if not finite:
                    buf = scratch(matrix)[: matrix.numel()].view_as(matrix) if scratch is not None else None
                    nonfinite = _flagged_counts(matrix, buf)
                    if bool((nonfinite[:, 0] == n).all()):  # NaN throughout: every other statistic is NaN
                        raw.append(torch.full((len(positions), len(block_set.raw)), math.nan, dtype=matrix.dtype))
                        if block_set.zeros:  # zeros and NaN: all NaN
                            zero_counts.append(torch.full((len(positions),), float(n), dtype=torch.float64))
                        counts.append(nonfinite)
                        continue
            found, zeros, first_pass_counts = _block_raw(matrix, block_set, scratch, total, finite)
            raw.append(found)
            if zeros is not None:
                zero_counts.append(zeros)
            counts.append(first_pass_counts if nonfinite is None else nonfinite)
        at = {name: j for j, name in enumerate(block_set.raw)}
        if self.counts == "flagged":  # a CPU: the few values per tensor are finished in numpy, not in a dozen ops
            r = (torch.cat(raw) if len(raw) > 1 else raw[0]).numpy().astype(np.float64)  # [K, R]
            zeros = [z.numpy() for z in zero_counts]
            both = np.concatenate([c.numpy() for c in counts])
            computed = _declared(block_set, declared, np)
            out = [_partial_column(name, r, at, block_set.n_host, zeros, both, np, computed) for name in block_set.names]
            rows.numpy()[block_set.order_host[:, None], block_set.columns_host] = np.stack(out, axis=1)
            return
        r = torch.cat(raw).to(torch.float64) if len(raw) > 1 else raw[0].to(torch.float64)  # [K, R]
        both_t = torch.cat(counts).to(torch.float64)  # [K, 2]: nan, inf
        computed = _declared(block_set, declared, torch)
        found = [_partial_column(name, r, at, block_set.n, zero_counts, both_t, torch, computed) for name in block_set.names]
        rows[block_set.row_index.unsqueeze(1), block_set.columns] = torch.stack(found, dim=1)


def _partial_names(cols: frozenset[str]) -> tuple[str, ...]:
    """The partial columns a block set writes (always sum, min, max and the non-finite counts;
    the rest as requested)."""
    names = ["sum", "min", "max"]
    for name in ("m2", "sumsq", "l1", "abs_min", "abs_m2", "zero_count", "prod", "median", "abs_median", *DECLARED):
        if name in cols or (name == "m2" and "sumsq" in cols) or (name == "sumsq" and "m2" in cols):
            names.append(name)
    names += ["nan_count", "inf_count"]
    return tuple(dict.fromkeys(names))


def _flagged_counts(matrix: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    """``[k, 2]`` NaN and Inf counts (CPU) of rows known to hold NaN or Inf: the NaN count first,
    and the finite count only where some value is not NaN."""
    k, n = matrix.shape
    if buf is None:
        buf = torch.empty_like(matrix)
    dtype = torch.float64 if n >= _EXACT_FLOAT32_COUNT else None  # counts past 2**24 are not exact in float32
    not_nan = torch.nansum(torch.clamp(matrix, 1, 1, out=buf), 1, dtype=dtype).to(torch.float64)  # clamp keeps NaN
    out = torch.stack([n - not_nan, torch.zeros_like(not_nan)], dim=1)
    if bool((not_nan > 0).any()):
        one = matrix.new_ones(()).expand_as(matrix)
        finite = torch.nansum(torch.add(one, matrix, alpha=0, out=buf), 1, dtype=dtype).to(torch.float64)
        out[:, 1] = not_nan - finite
    return out


def _declared(block_set: _BlockSet, declared: list[torch.Tensor], xp: Any) -> dict[str, Any]:
    """The declared columns of a block set's blocks ``[k, d]``, joined in block order, by name."""
    if not block_set.declared:
        return {}
    joined = torch.cat(declared) if len(declared) > 1 else declared[0]
    if xp is np:
        joined = joined.numpy()
    return {name: joined[:, j] for j, name in enumerate(block_set.declared)}


def _partial_column(
    name: str, r: Any, at: dict[str, int], n: Any, zero_counts: list[Any], counts: Any, xp: Any,
    declared: dict[str, Any],
) -> Any:
    """Partial column ``name`` of a block set from its raw reductions ``r`` ``[K, R]`` (float64),
    the same IEEE operations in PyTorch (``xp=torch``) or numpy (``xp=np``); ``declared``: the
    columns computed by their own function, by name."""
    if name in declared:
        return declared[name]
    if name in ("sum", "min", "max", "l1", "abs_min", "prod", "median", "abs_median"):
        return r[:, at[name]]
    if name == "m2":
        return r[:, at["sq"]] - r[:, at["dev"]] * r[:, at["dev"]] / n
    if name == "sumsq":
        return r[:, at["sq"]] - r[:, at["dev"]] * r[:, at["dev"]] / n + r[:, at["sum"]] * r[:, at["sum"]] / n
    if name == "abs_m2":
        return r[:, at["abs_sq"]] - r[:, at["abs_dev"]] * r[:, at["abs_dev"]] / n
    if name == "zero_count":  # zeros and NaN, less the NaN
        zeros = xp.concatenate(zero_counts) if xp is np else torch.cat(zero_counts)
        return zeros.astype(np.float64) - counts[:, 0] if xp is np else zeros.to(torch.float64) - counts[:, 0]
    return counts[:, 0] if name == "nan_count" else counts[:, 1]


def _block_raw(
    matrix: torch.Tensor, block_set: _BlockSet, scratch: Callable[[torch.Tensor], torch.Tensor] | None,
    total: torch.Tensor, finite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Raw reductions ``[k, len(block_set.raw)]`` of the ``k`` rows of ``matrix`` ``[k, n]`` (in
    its dtype; ``total``: their sums), its zero counts and its ``[k, 2]`` NaN/Inf counts where asked
    (``finite``: the rows are known to hold neither NaN nor Inf)."""
    k, n = matrix.shape
    cols = block_set.cols
    buf = scratch(matrix)[: k * n].view(k, n) if scratch is not None else torch.empty_like(matrix)
    # not aminmax(dim=1): on CPU it is 5-10x slower than amin and amax along a dimension
    out = [total, matrix.amin(1), matrix.amax(1)]
    if cols & {"m2", "sumsq"}:
        centred = torch.sub(matrix, (total / n).unsqueeze(1), out=buf)  # x - mean, into the scratch buffer
        out.append(centred.sum(1))
        # squares summed by the cascade sum: a BLAS dot errs by ~3e-6 relative at 3M values
        # (and varies with the thread count), vector_norm's naive float32 loop by 1e-4
        out.append(centred.square_().sum(1))
    if cols & {"l1", "abs_min", "abs_m2", "abs_median"}:
        magnitude = torch.abs(matrix, out=buf)
        l1 = magnitude.sum(1)
        out.append(l1)
        if "abs_min" in cols:
            out.append(magnitude.amin(1))
        if "abs_median" in cols:
            out.append(_exact_median_rows(magnitude).to(matrix.dtype))
        if "abs_m2" in cols:
            centred = magnitude.sub_((l1 / n).unsqueeze(1))
            out.append(centred.sum(1))
            out.append(centred.square_().sum(1))
    if "prod" in cols:  # in float64: it over/underflows float32 long before (stack promotes the rest)
        out.append(matrix.to(torch.float64).prod(1))
    if "median" in cols:
        out.append(_exact_median_rows(matrix))
    # zeros and NaN together: n - sum |sign(x)| (float ops; a comparison into bools and their sum
    # take 2.5x longer on a CPU); the caller subtracts the NaN count
    zeros = None
    if block_set.zeros and finite and k == 1 and n < _EXACT_FLOAT32_COUNT and matrix.device.type == "cpu":
        # one tensor without NaN: the nonzeros are sign(x) . sign(x), a BLAS dot of values in
        # {-1, 0, 1} (two passes instead of three; sums of such squares are exact below 2**24 in
        # any order)
        signs = torch.sign(matrix, out=buf).view(-1)
        zeros = n - torch.dot(signs, signs).reshape(1).to(torch.float64)
    elif block_set.zeros:
        dtype = torch.float64 if n >= _EXACT_FLOAT32_COUNT else None
        zeros = n - torch.nansum(torch.sign(matrix, out=buf).abs_(), 1, dtype=dtype).to(torch.float64)
    nonfinite = nonfinite_count_rows(matrix, buf) if block_set.counts else None
    return torch.stack(out, dim=1), zeros, nonfinite


def nonfinite_count_rows(matrix: torch.Tensor, buf: torch.Tensor | None = None) -> torch.Tensor:
    """``[k, 2]`` float64: the NaN and the Inf count of every row of ``matrix`` ``[k, n]``.

    With float ops only: ``clamp(x, 1, 1)`` is 1, or NaN for NaN; ``1 + 0 * x`` is 1, or NaN for
    NaN and +-Inf; ``nansum`` counts the ones. On this CPU that is ~80 us per million values, where
    ``isnan(x).sum()`` and ``isinf(x).sum()`` (comparisons into bools, summed) take ~600 us.
    """
    k, n = matrix.shape
    if buf is None:
        buf = torch.empty_like(matrix)
    dtype = torch.float64 if n >= _EXACT_FLOAT32_COUNT else None  # counts past 2**24 are not exact in float32
    not_nan = torch.nansum(torch.clamp(matrix, 1, 1, out=buf), 1, dtype=dtype)
    one = matrix.new_ones(()).expand_as(matrix)
    finite = torch.nansum(torch.add(one, matrix, alpha=0, out=buf), 1, dtype=dtype)
    not_nan, finite = not_nan.to(torch.float64), finite.to(torch.float64)
    return torch.stack([n - not_nan, not_nan - finite], dim=1)


def exact_median(values: torch.Tensor) -> torch.Tensor:
    """numpy's median of a flat tensor (see :func:`_exact_median_rows`); NaN when empty."""
    if values.numel() == 0:
        return torch.full((), math.nan, dtype=torch.float64, device=values.device)
    return _exact_median_rows(values.reshape(1, -1))[0]


def _exact_median_rows(matrix: torch.Tensor) -> torch.Tensor:
    """numpy's median of every row of ``[k, n]`` (``n > 0``): the mean of the two middle values
    for an even count; NaN for a row holding NaN."""
    n = matrix.shape[1]
    lower = matrix.kthvalue((n + 1) // 2, dim=1).values
    median = (lower + matrix.kthvalue(n // 2 + 1, dim=1).values) / 2 if n % 2 == 0 else lower
    return torch.where(torch.isnan(matrix).any(1), torch.full_like(median, math.nan), median)


def finite_range_rows(
    samples: list[torch.Tensor], layout: object | None, dtype: torch.dtype, stacked: list[torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)`` ``[G]`` in ``dtype``: the smallest and largest finite value of each sample
    (``+inf``/``-inf`` where none is), samples of one length stacked (``layout``: a
    :class:`~tensorlens.stats.histogram.HistogramLayout` of these samples, whose ``stack`` of them
    may be given as ``stacked``; or ``None``)."""
    device = samples[0].device if samples else torch.device("cpu")
    low = torch.full((len(samples),), math.inf, dtype=dtype, device=device)
    high = torch.full((len(samples),), -math.inf, dtype=dtype, device=device)
    if layout is not None:
        groups = [(members, at) for _, members, at, _ in layout.by_length]  # type: ignore[attr-defined]
        matrices = stacked if stacked is not None else layout.stack(samples)  # type: ignore[attr-defined]
    else:
        by_length: dict[int, list[int]] = {}
        for g, s in enumerate(samples):
            if s.numel():
                by_length.setdefault(s.numel(), []).append(g)
        groups = [(members, torch.tensor(members, device=device)) for members in by_length.values()]
        matrices = [torch.stack([samples[g].reshape(-1) for g in members]) for members, _ in groups]
    for (_, at), matrix in zip(groups, matrices, strict=True):
        low[at] = torch.nan_to_num(matrix, math.inf, math.inf, math.inf).amin(1).to(dtype)
        high[at] = torch.nan_to_num(matrix, -math.inf, -math.inf, -math.inf).amax(1).to(dtype)
    return low, high
