"""Optional compiled statistics for CPU tensors: one read per value instead of about six.

``moments.c`` (next to this file, with ``outputs.c`` and ``dots.c``: the dynamics' one read of a
module output, and the dot products of many parameters in one call) is compiled on first use with
the system's C compiler into a per-user cache (``$TENSORLENS_CACHE`` or ``~/.cache/tensorlens``),
keyed by the sources, the compiler and the CPU, and loaded with :mod:`ctypes` (which releases the GIL during the call).
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

from tensorlens.stats.native.build import available, prepare, reset, shares_torch_threads
from tensorlens.stats.native.kernels import (
    COLUMNS,
    HistogramBatch,
    MomentsBatch,
    dots,
    edges,
    finite_ranges,
    histograms,
    moments,
    moments_one,
    output_statistics,
    supports,
    wants,
)

__all__ = [
    "COLUMNS", "HistogramBatch", "MomentsBatch", "available", "dots", "edges", "finite_ranges", "histograms", "moments",
    "moments_one", "output_statistics", "prepare", "reset", "shares_torch_threads", "supports", "wants",
]
