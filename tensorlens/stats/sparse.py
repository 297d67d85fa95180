"""Statistics of sparse tensors (``nn.Embedding(sparse=True)`` gradients, CSR/CSC/BSR tensors) as
if they were dense, without densifying them.

The stored values give one partial row; the implicit zeros another, known in closed form (count,
zero sum, zero spread); the two merge exactly (:func:`~tensorlens.stats.moments.merge_partials`).
``numel`` is the dense size and ``zero_fraction`` counts the implicit zeros. The median is exact
too: the implicit zeros sit between the negative and the non-negative stored values. A column
declared with its own ``compute`` gets the implicit zeros' row from that function over a view of
zeros (a ``"single"`` such column is then NaN, as a merge of two pieces). The histogram's strided sample is the one the dense tensor would give, read off the stored indices.
"""

from __future__ import annotations

import math

import torch

from tensorlens.stats.histogram import sample_stride
from tensorlens.stats.moments import COL, PARTIALS, as_values, merge_partials, nonfinite_counts, partial_rows
from tensorlens.stats.torch_rows import DECLARED

SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def is_sparse(tensor: torch.Tensor) -> bool:
    return tensor.layout in SPARSE_LAYOUTS


def _coalesced(tensor: torch.Tensor) -> torch.Tensor:
    coo = tensor if tensor.layout == torch.sparse_coo else tensor.to_sparse_coo()
    return coo.coalesce()


def sparse_summary(
    tensor: torch.Tensor, columns: frozenset[str], sample: int | None, want_sample: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial row [len(PARTIALS)] float64, dense strided sample)`` of a sparse tensor.

    >>> dense = torch.tensor([[0.0, 2.0], [0.0, -1.0]])
    >>> row, _ = sparse_summary(dense.to_sparse(), frozenset({"sum", "m2"}), None, False)
    >>> float(row[COL["count"]]), float(row[COL["sum"]]), float(row[COL["zero_count"]])
    (4.0, 1.0, 2.0)
    """
    coo = _coalesced(tensor.detach())
    values = coo.values()
    if values.is_complex():
        values = values.abs()
    flat = as_values(values)
    device = flat.device
    implicit = tensor.numel() - flat.numel()
    stored = partial_rows([flat], [columns | {"zero_count"}])[0]
    stored[[COL["nan_count"], COL["inf_count"]]] = nonfinite_counts(flat)
    zeros = torch.full((len(PARTIALS),), math.nan, dtype=torch.float64, device=device)
    for name in ("count", "zero_count"):
        zeros[COL[name]] = float(implicit)
    for name in ("sum", "sumsq", "m2", "l1", "abs_m2", "nan_count", "inf_count"):
        zeros[COL[name]] = 0.0
    for name in ("min", "max", "abs_min"):
        zeros[COL[name]] = 0.0 if implicit else math.nan
    zeros[COL["prod"]] = 0.0 if implicit else 1.0
    for name, compute in DECLARED.items():  # a declared column of the implicit zeros (a view, not a copy)
        if name in columns:
            zeros[COL[name]] = compute(flat.new_zeros((1, 1)).expand(1, implicit)).reshape(()).to(torch.float64)
    row = merge_partials(torch.stack([stored, zeros]))
    for name, magnitude in (("median", False), ("abs_median", True)):
        if name in columns:
            row[COL[name]] = _median_with_zeros(flat.abs() if magnitude else flat, implicit)
    dense_sample = _dense_strided_sample(coo, flat, tensor, sample) if want_sample else flat.new_empty(0)
    return row, dense_sample


def _median_with_zeros(values: torch.Tensor, zeros: int) -> torch.Tensor:
    """numpy's median of ``values`` with ``zeros`` more zeros, without materialising them."""
    n = values.numel() + zeros
    if n == 0 or bool(torch.isnan(values).any()):
        return torch.tensor(math.nan, dtype=torch.float64, device=values.device)
    ordered = values.to(torch.float64).sort().values
    negatives = int((ordered < 0).sum())

    def kth(k: int) -> torch.Tensor:  # the k-th smallest (1-based) of values + zeros
        if k <= negatives:
            return ordered[k - 1]
        if k <= negatives + zeros:
            return torch.zeros((), dtype=torch.float64, device=values.device)
        return ordered[k - 1 - zeros]

    if n % 2:
        return kth((n + 1) // 2)
    return (kth(n // 2) + kth(n // 2 + 1)) / 2


def _dense_strided_sample(coo: torch.Tensor, flat: torch.Tensor, tensor: torch.Tensor, sample: int | None) -> torch.Tensor:
    """Every ``sample_stride``-th value of the dense tensor, zeros included, from the stored ones."""
    numel = tensor.numel()
    period = int(tensor.shape[-1]) if tensor.dim() else 1
    stride = sample_stride(numel, sample, period)
    out = torch.zeros(-(-numel // stride) if numel else 0, dtype=flat.dtype, device=flat.device)
    if flat.numel() == 0:
        return out
    sparse_dims = coo.sparse_dim()
    dense_size = math.prod(coo.shape[sparse_dims:])
    # flat position of every stored value: row-major index of its sparse coordinates, then its dense offset
    strides = torch.tensor(
        [math.prod(coo.shape[d + 1: sparse_dims]) for d in range(sparse_dims)], dtype=torch.int64, device=flat.device
    )
    base = (coo.indices() * strides[:, None]).sum(0) * dense_size
    positions = (base[:, None] + torch.arange(dense_size, device=flat.device)[None, :]).reshape(-1)
    hit = positions % stride == 0
    out[positions[hit] // stride] = flat[hit]
    return out
