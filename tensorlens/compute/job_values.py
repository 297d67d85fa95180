"""Values of jobs that are not plain dense tensors: sparse tensors summarised over their stored
values and implicit zeros, quantized, nested and mkldnn tensors made plain, and a job whose pieces
mix captured-and-reduced with dense ones reduced throughout. Each raises for what it cannot read,
so the engine can leave out that one tensor (see ``StepStatistics._isolate``).
"""

from __future__ import annotations

import dataclasses

import torch

from tensorlens.compute.jobs import ReducedPiece, TensorJob, reduce_now, reduce_plan
from tensorlens.stats.histogram import strided_sample
from tensorlens.stats.moments import COL, as_values, needed_columns, nonfinite_counts, partial_rows
from tensorlens.stats.sparse import is_sparse, sparse_summary

_NAN, _INF = COL["nan_count"], COL["inf_count"]


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """A strided tensor of plain values: quantized dequantized, nested flattened, mkldnn densified,
    lazy conjugation and negation resolved. Meta tensors hold no values: an error."""
    if tensor.device.type == "meta":
        raise ValueError("a meta tensor holds no values")
    if tensor.is_quantized:
        tensor = tensor.dequantize()
    if tensor.is_nested:
        parts = tensor.unbind()
        tensor = torch.cat([p.reshape(-1) for p in parts]) if parts else tensor.new_empty(0)
    if tensor.layout == torch._mkldnn:  # type: ignore[attr-defined]
        tensor = tensor.to_dense()
    if tensor.layout != torch.strided:
        raise ValueError(f"tensors of layout {tensor.layout} are not supported")
    return tensor.resolve_conj().resolve_neg()


def prepared(job: TensorJob) -> TensorJob:
    """``job`` with its sparse pieces summarised (their stored values and implicit zeros);
    tensors of other layouts become plain strided tensors in :meth:`StepStatistics._values <tensorlens.compute.step.StepStatistics._values>`."""
    if not any(isinstance(p, torch.Tensor) and is_sparse(p) for p in job.pieces):
        return job
    histogram = job.histogram if job.histogram is not None and job.histogram.enabled and not job.plain_scalar else None
    pieces: list[torch.Tensor | ReducedPiece] = []
    for piece in job.pieces:
        if isinstance(piece, torch.Tensor) and is_sparse(piece):
            row, sample = sparse_summary(
                piece, needed_columns(job.stats), histogram.sample if histogram else None, histogram is not None
            )
            pieces.append(ReducedPiece(None, sample, piece.shape, piece.dtype, piece.device, partial_row=row))
        else:
            pieces.append(piece)
    raw = None
    if job.save_raw:  # the raw tensor asked for is the dense one
        raw = torch.cat([as_values(plain(p.to_dense() if is_sparse(p) else p).reshape(-1)) for p in job.pieces])
    return dataclasses.replace(job, pieces=pieces, raw=raw)


def reduced_pieces(job: TensorJob) -> list[ReducedPiece]:
    """Every piece of a job with a reduced one, reduced (a module whose calls were captured
    both ways, which only a change of device or dtype between calls can cause)."""
    out = []
    for piece in job.pieces:
        if not isinstance(piece, ReducedPiece):
            plan = reduce_plan(job.stats, job.histogram)
            reduced = reduce_now(piece, plan) if plan is not None else None
            if reduced is None:  # e.g. a dense tensor saved next to a sparse one: a partial row of its own
                values = as_values(plain(piece.detach()))
                row = partial_rows([values], [needed_columns(job.stats)])[0]
                row[[_NAN, _INF]] = nonfinite_counts(values)
                hist = job.histogram
                sample = strided_sample(values, hist.sample) if hist is not None and hist.enabled else values.new_empty(0)
                reduced = ReducedPiece(None, sample, piece.shape, piece.dtype, piece.device, partial_row=row)
            piece = reduced
        out.append(piece)
    return out
