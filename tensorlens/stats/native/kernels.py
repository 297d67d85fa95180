"""The calls into the compiled kernel: moments (with the histogram's strided sample), binning and
exact edges; for the dynamics, module outputs' unit counts and per-sample norms, and dot products. Each returns ``None`` where the kernel is not built, and the caller uses PyTorch ops."""

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
    # is_cpu, not device.type: building a torch.device costs more than the rest of the check
    return values.is_cpu and values.dtype in (torch.float32, torch.float64) and values.is_contiguous()


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
    status = _for(library, values.numel()).tl_moments_one(  # a short call keeps the GIL (KEEP_GIL_BELOW)
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


def finite_ranges(values: list[torch.Tensor], strides: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(lo, hi)`` (float64 ``[G]``): the smallest and largest finite value of every
    ``strides[g]``-th value of ``values[g]`` (tensors that :func:`supports`); ``+inf``/``-inf``
    where none is finite. ``None`` without the kernel."""
    library = build.library()
    if library is None:
        return None
    g = len(values)
    lo, hi = np.empty(g), np.empty(g)
    numel = np.array([v.numel() for v in values], dtype=np.int64)
    stride = np.array(strides, dtype=np.int64)
    is_double = np.array([v.dtype == torch.float64 for v in values], dtype=np.int32)
    library.tl_finite_range(
        g, (ctypes.c_void_p * g)(*[v.data_ptr() for v in values]), numel.ctypes.data, stride.ctypes.data,
        is_double.ctypes.data, lo.ctypes.data, hi.ctypes.data,
    )
    return lo, hi


class MomentsBatch:
    """:func:`moments` of the same tensors step after step (a plan of
    :mod:`tensorlens.compute.plan`): the arrays of sizes, dtypes, columns and sample strides
    are built once, so a step costs the call and one pointer per tensor. The histogram samples are
    gathered into one buffer owned by the batch (valid until the next :meth:`run`).

    >>> batch = MomentsBatch([4096], [False], [0], [7])                           # doctest: +SKIP
    >>> rows = batch.run([torch.randn(4096).data_ptr()])                           # doctest: +SKIP
    """

    def __init__(self, numel: list[int], is_double: list[bool], wants_flags: list[int], strides: list[int]) -> None:
        k = self.k = len(numel)
        self._total = sum(numel)
        self._numel = (ctypes.c_int64 * k)(*numel)
        self._is_double = (ctypes.c_int32 * k)(*[int(d) for d in is_double])
        self._wants = (ctypes.c_int32 * k)(*wants_flags)
        self._strides = (ctypes.c_int64 * k)(*[max(s, 1) for s in strides])
        # sample g: -(-numel // stride) values at sample_offset[g] bytes into the shared buffer
        lengths = [-(-n // s) if s > 0 else 0 for n, s in zip(numel, strides, strict=True)]
        width = [8 if d else 4 for d in is_double]
        offsets, at = [], 0
        for length, w in zip(lengths, width, strict=True):
            at = -(-at // 8) * 8  # aligned for float64
            offsets.append(at)
            at += length * w
        self.sample_buffer = torch.empty(max(at, 8), dtype=torch.uint8)
        base = self.sample_buffer.data_ptr()
        self.sample_lengths = lengths
        self.sample_pointers = [base + o if s > 0 else None for o, s in zip(offsets, strides, strict=True)]
        self._samples = (ctypes.c_void_p * k)(*self.sample_pointers)
        self._offsets = offsets
        self.out = np.empty((k, len(COLUMNS)), dtype=np.float64)

    def sample(self, g: int, dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``g``'s gathered sample, a view of the shared buffer (valid until the next run)."""
        width = 8 if dtype == torch.float64 else 4
        start = self._offsets[g]
        return self.sample_buffer[start : start + self.sample_lengths[g] * width].view(dtype)

    def run(self, pointers: list[int], threads: int | None = None) -> np.ndarray | None:
        """The ``[k, len(COLUMNS)]`` rows of the tensors at ``pointers`` (the same sizes and dtypes
        as at construction), in :attr:`out` (overwritten by the next run); ``None`` without the kernel."""
        library = build.library()
        if library is None:
            return None
        status = _for(library, self._total).tl_moments(  # a short call keeps the GIL (KEEP_GIL_BELOW)
            self.k, (ctypes.c_void_p * self.k)(*pointers), self._numel, self._is_double, self._wants, self._strides,
            self._samples, self.out.ctypes.data, max(1, int(threads or _thread_cap())),
        )
        return self.out if status == 0 else None


class HistogramBatch:
    """:func:`histograms` of the same samples step after step: pointers (into a
    :class:`MomentsBatch` buffer, which does not move), lengths, strides and dtypes built once."""

    def __init__(self, pointers: list[int], numel: list[int], strides: list[int], is_double: list[bool], bins: int, clip: bool) -> None:
        g = self.g = len(numel)
        self.bins, self.clip = bins, clip
        self._pointers = (ctypes.c_void_p * g)(*pointers)
        self._numel = np.array(numel, dtype=np.int64)
        self._strides = np.array(strides, dtype=np.int64)
        self._is_double = np.array([int(d) for d in is_double], dtype=np.int32)

    def run(self, low: np.ndarray, high: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """``(counts [G, bins], below [G], above [G])``; ``None`` without the kernel."""
        library = build.library()
        if library is None:
            return None
        g, bins = self.g, self.bins
        counts = np.empty((g, bins), dtype=np.int64)
        below, above = np.empty(g, dtype=np.int64), np.empty(g, dtype=np.int64)
        arrays = [np.ascontiguousarray(a, dtype=np.float64) for a in (low, high, scale)]
        library.tl_histograms(
            g, self._pointers, self._numel.ctypes.data, self._strides.ctypes.data, self._is_double.ctypes.data,
            arrays[0].ctypes.data, arrays[1].ctypes.data, arrays[2].ctypes.data,
            bins, int(self.clip), counts.ctypes.data, below.ctypes.data, above.ctypes.data,
        )
        return counts, below, above


#: Outputs of at least this many values share the work among PyTorch's OpenMP threads (a thread
#: per this many values, as :func:`moments` does); smaller ones are read by one thread.
OUTPUT_VALUES_PER_THREAD = 1 << 16
#: Calls on fewer values than this keep the GIL (well under a millisecond): releasing it lets a busy
#: thread (a tracker's) take it, and the training thread waits up to the switch interval to get
#: it back, per call. Longer calls release it.
KEEP_GIL_BELOW = 1 << 20


def _for(library: ctypes.CDLL, values: int) -> ctypes.CDLL:
    return library.held if values < KEEP_GIL_BELOW else library


def _threads_for(values: int) -> int:
    """Threads for a call reading ``values`` values: one per :data:`OUTPUT_VALUES_PER_THREAD` on
    PyTorch's own OpenMP pool (:func:`shares_torch_threads`), else one."""
    if values >= 2 * OUTPUT_VALUES_PER_THREAD and build.shares_torch_threads():
        return min(_thread_cap(), values // OUTPUT_VALUES_PER_THREAD)
    return 1


def output_statistics(
    values: torch.Tensor, batch: int, units: int, inner: int, threshold: float, counts: bool, norm_divisor: float | None,
    bounds: tuple[float, float] | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, int | None] | None:
    """One read of a module output that :func:`supports`, seen as ``[batch, numel / batch]`` with
    ``units`` units of ``inner`` consecutive values repeating along each row (``inner=1``:
    channel-last; one unit: ``units=inner=1``); see ``outputs.c``. Returns ``(counts, norms,
    saturated)``: float64 ``[units]`` counts of ``|x| > threshold`` when ``counts``; float64
    ``[batch]`` per-sample L2 norms divided by ``norm_divisor`` when it is given; the number of
    values ``>= bounds[1]`` or ``<= bounds[0]`` when ``bounds`` are. ``None`` without the kernel."""
    library = build.library()
    if library is None:
        return None
    numel = values.numel()
    count_out = torch.empty(units, dtype=torch.float64) if counts else None
    norm_out = torch.empty(batch, dtype=torch.float64) if norm_divisor is not None else None
    saturated = ctypes.c_int64(0)
    threads = _threads_for(numel)
    status = _for(library, numel).tl_output_stats(
        values.data_ptr(), values.dtype == torch.float64, batch, numel // batch if batch else 0, units, inner,
        threshold, count_out.data_ptr() if count_out is not None else None,
        norm_out.data_ptr() if norm_out is not None else None, norm_divisor or 1.0,
        bounds[0] if bounds is not None else 0.0, bounds[1] if bounds is not None else 0.0,
        ctypes.addressof(saturated) if bounds is not None else None, threads,
    )
    if status != 0:
        return None
    return count_out, norm_out, (saturated.value if bounds is not None else None)


def dots(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor | None:
    """``[sum(a[i] * b[i])]`` as float64 ``[len(a)]`` in one call (``dots.c``: products summed
    in double), for pairs that :func:`supports`, each of one dtype and size; ``None`` without the kernel."""
    library = build.library()
    if library is None:
        return None
    k = len(a)
    out = torch.empty(k, dtype=torch.float64)
    numel = [t.numel() for t in a]
    total = sum(numel)
    threads = _threads_for(total)
    status = _for(library, total).tl_dots(
        k, (ctypes.c_void_p * k)(*[t.data_ptr() for t in a]), (ctypes.c_void_p * k)(*[t.data_ptr() for t in b]),
        (ctypes.c_int64 * k)(*numel), (ctypes.c_int32 * k)(*[t.dtype == torch.float64 for t in a]), out.data_ptr(), threads,
    )
    return out if status == 0 else None
