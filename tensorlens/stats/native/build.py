"""Building and loading the optional compiled statistics kernel for CPU tensors: one read per value instead of about six.

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


def library() -> ctypes.CDLL | None:
    """The loaded kernel, or ``None`` (read without the lock on hot paths: set before ``_tried``)."""
    if not _tried:
        available()
    return _library
