"""Building and loading the optional compiled statistics kernel for CPU tensors: one read per value instead of about six.

``moments.c`` (next to this file; with ``outputs.c`` and ``dots.c`` for the dynamics) is compiled on first use with the system's C compiler into a
per-user cache (``$TENSORLENS_CACHE`` or ``~/.cache/tensorlens``), keyed by the source, the
compiler and the CPU, and loaded with :mod:`ctypes` (which releases the GIL during the call).
It needs no Python headers and builds in well under a second. Where there is no compiler, or the
build fails, or ``TENSORLENS_NATIVE=0``, :func:`moments` returns ``None`` and the caller uses
PyTorch ops, which give the same statistics (see ``tests/test_native.py``).

Loading a library runs its code, so the cache is used only when nobody else can write it: the
folder must be a real folder (not a symlink) owned by this user and not writable by group or
others, its parents owned by this user or root and not writable by others (unless sticky, like
``/tmp``), and the library a regular file owned by this user and writable by nobody else. A cache
that fails these checks is not touched: the kernel is built in a private temporary folder
(``mkdtemp``, mode 0700) for this process, which is removed once the library is loaded, and one
warning names the cache folder.
How the kernel uses threads (PyTorch's OpenMP pool where its ``libgomp.so.1`` is loaded, else
its own): see :mod:`tensorlens.stats.native`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

_SOURCE = Path(__file__).with_name("moments.c")
# compiled into the same library, for the dynamics: module outputs' unit counts, per-sample norms and
# saturation (outputs.c), the parameters' squared norms and dot products (dots.c)
_SOURCES = (_SOURCE, Path(__file__).with_name("outputs.c"), Path(__file__).with_name("dots.c"))
_FLAG_SETS = (["-O3", "-march=native"], ["-O3"])  # -march=native may be unknown to the compiler
_OPENMP = "-fopenmp"
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_library_path: str | None = None  # the file the loaded kernel came from (tests check where)
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


def cache_dir() -> Path:
    """Where built kernels are kept: ``$TENSORLENS_CACHE`` or ``~/.cache/tensorlens``."""
    return Path(os.environ.get("TENSORLENS_CACHE") or Path.home() / ".cache" / "tensorlens")


def _unsafe_folder(path: Path) -> str | None:
    """Why a library in ``path`` could have been written by someone else (``None``: it could not)."""
    try:
        info = os.lstat(path)
    except OSError as err:
        return f"it cannot be read ({err.strerror})"
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder"
    if info.st_uid != os.geteuid():
        return f"it is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    # whoever can write a parent can rename the folder and put another in its place
    for parent in Path(os.path.realpath(path)).parents:
        try:
            info = os.stat(parent)
        except OSError as err:
            return f"its parent {parent} cannot be read ({err.strerror})"
        if info.st_uid not in (0, os.geteuid()):
            return f"its parent {parent} is owned by uid {info.st_uid}"
        if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
            return f"its parent {parent} is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _safe_library(path: Path) -> bool:
    """A regular file (not a symlink) owned by this user and writable by nobody else."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (
        stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()
        and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _private_cache() -> tuple[Path, bool]:
    """``(folder, temporary)``: the user's cache when it is safe (created 0700 when missing),
    else a fresh private temporary folder for this process (with one warning)."""
    cache = cache_dir()
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = _unsafe_folder(cache)
    except OSError as err:
        problem = f"it cannot be created ({err.strerror})"
    if problem is None:
        return cache, False
    warnings.warn(
        f"tensorlens: not loading the compiled kernel from {cache}: {problem}; building it in a private "
        "temporary folder for this process instead (set TENSORLENS_CACHE to a folder only you can write "
        "to keep the build)",
        stacklevel=3,
    )
    return Path(tempfile.mkdtemp(prefix="tensorlens-kernel-")), True


def _build() -> ctypes.CDLL | None:
    if os.environ.get("TENSORLENS_NATIVE", "1") == "0" or os.name != "posix":
        return None
    compiler = _compiler()
    if compiler is None:
        return None
    source = b"".join(path.read_bytes() for path in _SOURCES)
    cache, temporary = _private_cache()
    try:
        return _build_in(cache, compiler, source)
    finally:
        if temporary:  # the loaded library stays mapped; nothing is left behind for others to find
            shutil.rmtree(cache, ignore_errors=True)


def _build_in(cache: Path, compiler: str, source: bytes) -> ctypes.CDLL | None:
    global _library_path
    # With PyTorch's own libgomp loaded, an OpenMP build shares its runtime and its workers (one
    # libgomp.so.1 per process); any other build (libomp, TBB, no OpenMP) gets plain threads.
    flag_sets = [[*flags, _OPENMP] for flags in _FLAG_SETS] if _torch_uses_libgomp() else []
    for flags in [*flag_sets, *_FLAG_SETS]:
        key = hashlib.sha256(source + repr((compiler, flags, _cpu_signature())).encode()).hexdigest()[:16]
        target = cache / f"moments-{key}.so"
        try:
            # a file this user did not write alone (a symlink, another owner, a shared mode) is
            # replaced, never loaded: only this user can write the folder, so the new one stays ours
            if not _safe_library(target):
                # build beside the target and rename: concurrent processes never load half a file
                with tempfile.TemporaryDirectory(dir=cache) as scratch:
                    built = Path(scratch) / "moments.so"
                    subprocess.run(
                        [compiler, *flags, "-fPIC", "-shared", "-pthread", "-o", str(built), *map(str, _SOURCES), "-lm"],
                        check=True, capture_output=True, timeout=60,
                    )
                    os.chmod(built, 0o755)
                    os.replace(built, target)
            library = ctypes.CDLL(str(target))
        except (OSError, subprocess.SubprocessError):
            continue
        _library_path = str(target)
        library.tl_shares_torch_threads.restype = ctypes.c_int
        library.tl_histograms.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 7 + [
            ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ]
        library.tl_histograms.restype = ctypes.c_int
        library.tl_edges.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p]
        library.tl_edges.restype = ctypes.c_int
        library.tl_finite_range.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 6
        library.tl_finite_range.restype = ctypes.c_int
        # the calls of a saved step take microseconds on small tensors: through a PyDLL they keep
        # the GIL, since a released GIL taken by a busy thread (a tracker's) costs the training
        # thread up to the switch interval (5 ms) per call to get back (kernels.KEEP_GIL_BELOW)
        library.held = ctypes.PyDLL(str(target))
        for loaded in (library, library.held):
            loaded.tl_moments.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 7 + [ctypes.c_int32]
            loaded.tl_moments.restype = ctypes.c_int
            loaded.tl_moments_one.argtypes = [
                ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p,
                ctypes.c_void_p, ctypes.c_int32,
            ]
            loaded.tl_moments_one.restype = ctypes.c_int
            loaded.tl_output_stats.argtypes = [
                ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                ctypes.c_double, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_double, ctypes.c_double, ctypes.c_double,
                ctypes.c_void_p, ctypes.c_int32,
            ]
            loaded.tl_output_stats.restype = ctypes.c_int
            loaded.tl_dots.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 5 + [ctypes.c_int32]
            loaded.tl_dots.restype = ctypes.c_int
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
    """Whether the compiled kernel is in use (building it on the first call). ``TENSORLENS_NATIVE=0``
    switches it off at any time, also once it is loaded (benchmarks compare both paths in one process)."""
    global _library, _tried, _shares
    if _switched_off():
        return False
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
    global _library, _library_path, _tried, _shares
    with _lock:
        _library, _library_path, _tried, _shares = None, None, False, False


def library_path() -> str | None:
    """The file the loaded kernel was read from (``None`` when none is loaded)."""
    return _library_path if available() else None


def shares_torch_threads() -> bool:
    """Whether the kernel runs its threads in PyTorch's OpenMP pool (built with ``-fopenmp``
    against the libgomp PyTorch loaded): then a call right after an op can use every thread at
    once, where new threads would compete with the pool's still-spinning workers."""
    return available() and _shares


def library() -> ctypes.CDLL | None:
    """The loaded kernel, or ``None`` (read without the lock on hot paths: set before ``_tried``)."""
    if not _tried:
        available()
    return None if _switched_off() else _library


# library() runs ~200 times per saved step of a small model, and an os.environ lookup costs ~1 µs
# (key encoding, a Mapping call, value decoding). The mapping's own dict of encoded keys
# (CPython's os._Environ._data, kept in step with every change made through os.environ) says
# in ~0.1 µs that neither variable is set, the usual case; otherwise they are read as usual.
_ENVIRON = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
_SWITCH_KEYS = (
    tuple(_ENCODE(k) for k in ("TENSORLENS_NATIVE", "TENSORLENS_STATS_PATH"))
    if isinstance(_ENVIRON, dict) and callable(_ENCODE) else None
)


def _switched_off() -> bool:
    if _SWITCH_KEYS is not None and _SWITCH_KEYS[0] not in _ENVIRON and _SWITCH_KEYS[1] not in _ENVIRON:  # type: ignore[operator]
        return False
    # TENSORLENS_STATS_PATH=torch|triton asks for another path (tensorlens.stats.path)
    return os.environ.get("TENSORLENS_NATIVE") == "0" or os.environ.get("TENSORLENS_STATS_PATH", "").strip().lower() in ("torch", "triton")
