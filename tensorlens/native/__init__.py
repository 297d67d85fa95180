"""Optional compiled statistics for CPU tensors: one read per value instead of about six.

``moments.c`` (next to this file) is compiled on first use with the system's C compiler into a
per-user cache (``$TENSORLENS_CACHE`` or ``~/.cache/tensorlens``), keyed by the source, the
compiler and the CPU, and loaded with :mod:`ctypes` (which releases the GIL during the call).
It needs no Python headers and builds in well under a second. Where there is no compiler, or the
build fails, or ``TENSORLENS_NATIVE=0``, :func:`moments` returns ``None`` and the caller uses
PyTorch ops, which give the same statistics (see ``tests/test_native.py``).
``TENSORLENS_NATIVE_THREADS`` caps the threads of a call (default: ``torch.get_num_threads()``).

Threads: where PyTorch's own ``libgomp.so.1`` is loaded (its Linux wheels), the kernel is built
with ``-fopenmp`` and runs on PyTorch's OpenMP pool, whose workers are still spinning right after
an op and take the kernel's chunks at once (a thread each 64K values). Elsewhere it starts its own
threads, only for a million values or more each: right after an op a new thread competes with the
pool's spinning workers (measured slower on smaller tensors).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

#: Output columns of :func:`moments`, in order.
COLUMNS = ("count", "sum", "m2", "min", "max", "l1", "zero_count", "nan_count", "inf_count")

_SOURCE = Path(__file__).with_name("moments.c")
_FLAG_SETS = (["-O3", "-march=native"], ["-O3"])  # -march=native may be unknown to the compiler
_OPENMP = "-fopenmp"
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
_shares = False  # the loaded kernel's threads are PyTorch's OpenMP workers


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: a library built for one CPU is not loaded on another."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _build() -> ctypes.CDLL | None:
    if os.environ.get("TENSORLENS_NATIVE", "1") == "0" or os.name != "posix":
        return None
    compiler = _compiler()
    if compiler is None:
        return None
    source = _SOURCE.read_bytes()
    cache = Path(os.environ.get("TENSORLENS_CACHE") or Path.home() / ".cache" / "tensorlens")
    # With PyTorch's own libgomp loaded, an OpenMP build shares its runtime and its workers (one
    # libgomp.so.1 per process); any other build (libomp, TBB, no OpenMP) gets plain threads.
    flag_sets = [[*flags, _OPENMP] for flags in _FLAG_SETS] if _torch_uses_libgomp() else []
    for flags in [*flag_sets, *_FLAG_SETS]:
        key = hashlib.sha256(source + repr((compiler, flags, _cpu_signature())).encode()).hexdigest()[:16]
        target = cache / f"moments-{key}.so"
        try:
            if not target.exists():
                cache.mkdir(parents=True, exist_ok=True)
                # build beside the target and rename: concurrent processes never load half a file
                with tempfile.TemporaryDirectory(dir=cache) as scratch:
                    built = Path(scratch) / "moments.so"
                    subprocess.run(
                        [compiler, *flags, "-fPIC", "-shared", "-pthread", "-o", str(built), str(_SOURCE), "-lm"],
                        check=True, capture_output=True, timeout=60,
                    )
                    os.replace(built, target)
            library = ctypes.CDLL(str(target))
        except (OSError, subprocess.SubprocessError):
            continue
        library.tl_moments.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 7 + [ctypes.c_int32]
        library.tl_moments.restype = ctypes.c_int
        library.tl_shares_torch_threads.restype = ctypes.c_int
        library.tl_moments_one.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_int32,
        ]
        library.tl_moments_one.restype = ctypes.c_int
        library.tl_histograms.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 7 + [
            ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ]
        library.tl_histograms.restype = ctypes.c_int
        library.tl_edges.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p]
        library.tl_edges.restype = ctypes.c_int
        return library
    return None


def _torch_uses_libgomp() -> bool:
    """Whether this process has loaded a library named ``libgomp.so.1`` (PyTorch's Linux wheels
    bring theirs), which an ``-fopenmp`` build then shares: the dynamic loader does not load a
    second library of the same soname. A renamed copy (``libgomp-<hash>.so.1``, older wheels)
    would not be shared: two OpenMP pools would compete, so that case gets plain threads."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return any(line.rstrip().endswith("/libgomp.so.1") for line in f)
    except OSError:
        return False


def available() -> bool:
    """Whether the compiled kernel is in use (building it on the first call)."""
    global _library, _tried, _shares
    with _lock:
        if not _tried:
            try:
                _library = _build()
                _shares = _library is not None and bool(_library.tl_shares_torch_threads())
            finally:
                _tried = True  # after _library is set: moments_one reads them without the lock
    return _library is not None


def prepare() -> None:
    """Build (or load) the kernel on a background thread, so that the first saved step does not
    wait for the compiler (a hook calls this when it is created)."""
    if not _tried:
        threading.Thread(target=available, name="tensorlens-native-build", daemon=True).start()


def reset() -> None:
    """Forget the loaded kernel, so the next call decides again (tests, ``TENSORLENS_NATIVE``)."""
    global _library, _tried, _shares
    with _lock:
        _library, _tried, _shares = None, False, False


def shares_torch_threads() -> bool:
    """Whether the kernel runs its threads in PyTorch's OpenMP pool (built with ``-fopenmp``
    against the libgomp PyTorch loaded): then a call right after an op can use every thread at
    once, where new threads would compete with the pool's still-spinning workers."""
    return available() and _shares


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
    if not values or not available():
        return None
    assert _library is not None
    k = len(values)
    out = np.empty((k, len(COLUMNS)), dtype=np.float64)
    strides = sample_strides or [0] * k
    samples = [
        torch.empty(-(-v.numel() // s), dtype=v.dtype) if s > 0 else None for v, s in zip(values, strides, strict=True)
    ]
    # plain ctypes arrays: called once per large activation, numpy's wrappers cost more than the call
    status = _library.tl_moments(
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
    if not _tried:
        available()
    library = _library  # set before _tried: read without the lock on this hot path
    if library is None:
        return None
    out = np.empty(len(COLUMNS), dtype=np.float64)
    sample = torch.empty(-(-values.numel() // sample_stride), dtype=values.dtype) if sample_stride > 0 else None
    status = library.tl_moments_one(
        values.data_ptr(), values.numel(), values.dtype == torch.float64, wants, max(sample_stride, 1),
        sample.data_ptr() if sample is not None else None, out.ctypes.data,
        _thread_cap() if _shares else 1,
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
    :func:`tensorlens.reductions.histogram_counts` does; ``None`` without the kernel."""
    if not available():
        return None
    assert _library is not None
    g = len(values)
    counts = np.empty((g, bins), dtype=np.int64)
    below, above = np.empty(g, dtype=np.int64), np.empty(g, dtype=np.int64)
    pointers = (ctypes.c_void_p * g)(*[v.data_ptr() for v in values])
    numel = np.array([v.numel() for v in values], dtype=np.int64)
    stride = np.array(strides, dtype=np.int64)
    is_double = np.array([v.dtype == torch.float64 for v in values], dtype=np.int32)
    arrays = [np.ascontiguousarray(a, dtype=np.float64) for a in (low, high, scale)]
    _library.tl_histograms(
        g, pointers, numel.ctypes.data, stride.ctypes.data, is_double.ctypes.data,
        arrays[0].ctypes.data, arrays[1].ctypes.data, arrays[2].ctypes.data,
        bins, int(clip), counts.ctypes.data, below.ctypes.data, above.ctypes.data,
    )
    return counts, below, above


def edges(low: np.ndarray, high: np.ndarray, scale: np.ndarray, bins: int, dtype: np.dtype) -> np.ndarray | None:
    """:func:`tensorlens.reductions.exact_edges` computed by the kernel (``[G, bins + 1]``), or
    ``None`` without it or for a dtype other than float32/float64."""
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)) or not available():
        return None
    assert _library is not None
    arrays = [np.ascontiguousarray(a, dtype=np.float64).reshape(-1) for a in (low, high, scale)]
    g = len(arrays[0])
    out = np.empty((g, bins + 1), dtype=np.float64)
    _library.tl_edges(
        g, arrays[0].ctypes.data, arrays[1].ctypes.data, arrays[2].ctypes.data, bins,
        int(dtype == np.dtype(np.float64)), out.ctypes.data,
    )
    return out
