"""The calls into the compiled kernel: moments (with the histogram's strided sample), binning and
exact edges. Each returns ``None`` where the kernel is not built, and the caller uses PyTorch ops."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from tensorlens.stats.native import build

#: Output columns of :func:`moments`, in order.
COLUMNS = ("count", "sum", "m2", "min", "max", "l1", "zero_count", "nan_count", "inf_count")


def supports(values: torch.Tensor) -> bool:
    """Whether :func:`moments` can read ``values``: a contiguous float32/float64 CPU tensor."""
    return values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64) and values.is_contiguous()


def moments(
    values: list[torch.Tensor],
    threads: int | None = None,
    sample_strides: list[int] | None = None,
    columns: list[frozenset[str]] | None = None,
) -> tuple[np.ndarray, list[torch.Tensor | None]] | None:
    """``[len(values), len(COLUMNS)]`` float64 statistics of flat tensors that :func:`supports`,
    and, where ``sample_strides[i]`` is set (> 0), every ``sample_strides[i]``-th value of tensor
    ``i`` (gathered in the same read); ``None`` when the kernel is not available (the caller then
    uses PyTorch ops). ``columns[i]``, where given, names the columns tensor ``i`` needs:
    ``l1`` and ``zero_count`` are computed only when named (NaN otherwise), the rest always."""
    library = build.library() if values else None
    if library is None:
        return None
    k = len(values)
    out = np.empty((k, len(COLUMNS)), dtype=np.float64)
    strides = sample_strides or [0] * k
    samples = [
        torch.empty(-(-v.numel() // s), dtype=v.dtype) if s > 0 else None for v, s in zip(values, strides, strict=True)
    ]
    # plain ctypes arrays: called once per large activation, numpy's wrappers cost more than the call
    status = library.tl_moments(
        k,
        (ctypes.c_void_p * k)(*[v.data_ptr() for v in values]),
        (ctypes.c_int64 * k)(*[v.numel() for v in values]),
        (ctypes.c_int32 * k)(*[v.dtype == torch.float64 for v in values]),
        (ctypes.c_int32 * k)(*([wants(c) for c in columns] if columns is not None else [_ALL] * k)),
        (ctypes.c_int64 * k)(*[max(s, 1) for s in strides]),
        (ctypes.c_void_p * k)(*[s.data_ptr() if s is not None else None for s in samples]),
        out.ctypes.data,
        max(1, int(threads or _thread_cap())),
    )
    return (out, samples) if status == 0 else None


def moments_one(values: torch.Tensor, sample_stride: int, wants: int) -> tuple[np.ndarray, torch.Tensor | None] | None:
    """:func:`moments` of one tensor (its ``[len(COLUMNS)]`` row and sample), with ``wants``
    from :func:`wants`: the lean path for one large activation in its forward hook, with the
    kernel's threads when they are PyTorch's own (:func:`shares_torch_threads`), else one."""
    library = build.library()
    if library is None:
        return None
    out = np.empty(len(COLUMNS), dtype=np.float64)
    sample = torch.empty(-(-values.numel() // sample_stride), dtype=values.dtype) if sample_stride > 0 else None
    status = library.tl_moments_one(
        values.data_ptr(), values.numel(), values.dtype == torch.float64, wants, max(sample_stride, 1),
        sample.data_ptr() if sample is not None else None, out.ctypes.data,
        _thread_cap() if build.shares_torch_threads() else 1,
    )
    return (out, sample) if status == 0 else None


_WANT_L1, _WANT_ZEROS = 1, 2  # as in moments.c
_ALL = _WANT_L1 | _WANT_ZEROS


def wants(columns: frozenset[str]) -> int:
    """The kernel's flags for the optional columns among ``columns`` (``l1``, ``zero_count``)."""
    return (_WANT_L1 if "l1" in columns else 0) | (_WANT_ZEROS if "zero_count" in columns else 0)


def _thread_cap() -> int:
    return max(1, int(os.environ.get("TENSORLENS_NATIVE_THREADS", "0")) or torch.get_num_threads())


def histograms(
    values: list[torch.Tensor], strides: list[int], low: np.ndarray, high: np.ndarray, scale: np.ndarray,
    bins: int, clip: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(counts [G, bins], below [G], above [G])`` (int64) of every ``strides[g]``-th value of
    ``values[g]`` (tensors that :func:`supports`, all of one dtype), binned over
    ``[low[g], high[g]]`` with ``scale[g]`` exactly as
    :func:`tensorlens.stats.histogram.histogram_counts` does; ``None`` without the kernel."""
    library = build.library()
    if library is None:
        return None
    g = len(values)
    counts = np.empty((g, bins), dtype=np.int64)
    below, above = np.empty(g, dtype=np.int64), np.empty(g, dtype=np.int64)
    pointers = (ctypes.c_void_p * g)(*[v.data_ptr() for v in values])
    numel = np.array([v.numel() for v in values], dtype=np.int64)
    stride = np.array(strides, dtype=np.int64)
    is_double = np.array([v.dtype == torch.float64 for v in values], dtype=np.int32)
    arrays = [np.ascontiguousarray(a, dtype=np.float64) for a in (low, high, scale)]
    library.tl_histograms(
        g, pointers, numel.ctypes.data, stride.ctypes.data, is_double.ctypes.data,
        arrays[0].ctypes.data, arrays[1].ctypes.data, arrays[2].ctypes.data,
        bins, int(clip), counts.ctypes.data, below.ctypes.data, above.ctypes.data,
    )
    return counts, below, above


def edges(low: np.ndarray, high: np.ndarray, scale: np.ndarray, bins: int, dtype: np.dtype) -> np.ndarray | None:
    """:func:`tensorlens.stats.edges.exact_edges` computed by the kernel (``[G, bins + 1]``), or
    ``None`` without it or for a dtype other than float32/float64."""
    dtype = np.dtype(dtype)
    library = build.library() if dtype in (np.dtype(np.float32), np.dtype(np.float64)) else None
    if library is None:
        return None
    arrays = [np.ascontiguousarray(a, dtype=np.float64).reshape(-1) for a in (low, high, scale)]
    g = len(arrays[0])
    out = np.empty((g, bins + 1), dtype=np.float64)
    library.tl_edges(
        g, arrays[0].ctypes.data, arrays[1].ctypes.data, arrays[2].ctypes.data, bins,
        int(dtype == np.dtype(np.float64)), out.ctypes.data,
    )
    return out
