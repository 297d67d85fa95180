"""Which path computes a tensor's statistics: the compiled CPU kernel (``native``), the fused Triton
kernels (``triton``), or PyTorch ops (``torch``). All three give the same statistics (numpy's, to
float rounding; counts, bounds and histograms exactly).

``TENSORLENS_STATS_PATH`` chooses, read at every step (benchmarks switch it in one process):

- unset or ``auto``: ``native`` for CPU tensors where a C compiler builds the kernel, ``triton``
  for CUDA/ROCm tensors where ``triton`` imports, ``torch`` otherwise;
- ``native``, ``triton`` or ``torch``: that path wherever it can run. Where it cannot (``triton``
  not installed, ``native`` for a GPU tensor, ``triton`` for a CPU tensor outside Triton's
  interpreter) the tensors fall back to PyTorch ops, with one warning saying why.

``TENSORLENS_NATIVE=0`` (the older switch) still turns the compiled kernel off. Under Triton's
interpreter (``TRITON_INTERPRET=1``, set before ``triton`` is first imported: triton reads it once)
the Triton kernels run on CPU tensors, one Python step per op: how the path is tested without a
GPU, never fast. A tensor the chosen kernel cannot read (a
dtype it does not know, a column it does not compute) takes PyTorch ops on its own.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Iterable

import torch

NATIVE, TRITON, TORCH = "native", "triton", "torch"
PATHS = (NATIVE, TRITON, TORCH)
ENV = "TENSORLENS_STATS_PATH"

_warned: set[str] = set()
_lock = threading.Lock()


def warn_once(key: str, message: str) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(f"tensorlens: {message}", stacklevel=3)


def requested() -> str:
    """``TENSORLENS_STATS_PATH`` (``"auto"`` when unset; an unknown value warns once and means auto)."""
    value = os.environ.get(ENV, "").strip().lower()
    if not value or value == "auto":
        return "auto"
    if value not in PATHS:
        warn_once(f"bad:{value}", f"{ENV}={value!r} is not one of auto, {', '.join(PATHS)}: using auto")
        return "auto"
    return value


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    """Whether ``triton`` is installed and imports (checked once per process; :func:`reset`)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a broken install: the path is simply not there
        return False
    return True


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``): on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can read tensors on ``device``: CUDA and ROCm devices (both
    ``cuda`` in PyTorch), or the CPU under the interpreter (which cannot read GPU memory)."""
    if not triton_importable():
        return False
    return device.type == "cpu" if interpreting() else device.type == "cuda"


def native_allowed() -> bool:
    """Whether the compiled CPU kernel may be used (neither switch turns it off)."""
    return os.environ.get("TENSORLENS_NATIVE") != "0" and requested() in ("auto", NATIVE)


def path_for(device: torch.device, sync_free: bool = False) -> str:
    """The path for tensors on ``device`` (``sync_free``: a CPU standing in for a GPU in tests, which
    never takes the compiled kernel)."""
    want = requested()
    if want == TORCH:
        return TORCH
    if want == TRITON:
        if triton_runs_on(device):
            return TRITON
        warn_once(
            f"triton:{device.type}",
            f"{ENV}=triton cannot run on {device.type} tensors ({_why_not_triton(device)}): "
            "their statistics use PyTorch ops",
        )
        return TORCH
    if device.type == "cpu":
        if sync_free:
            return TORCH
        from tensorlens.stats import native

        if native_allowed() and native.available():
            return NATIVE
        if want == NATIVE:
            warn_once(
                "native:build", f"{ENV}=native, but the compiled kernel could not be built here: PyTorch ops are used"
            )
        return TORCH
    if want == NATIVE:
        warn_once(
            f"native:{device.type}",
            f"{ENV}=native: the compiled kernel reads CPU tensors only; "
            f"{device.type} tensors use {TRITON if triton_runs_on(device) else TORCH}",
        )
    return TRITON if triton_runs_on(device) else TORCH


def _why_not_triton(device: torch.device) -> str:
    if not triton_importable():
        return "triton is not installed: pip install triton"
    if interpreting():
        return "TRITON_INTERPRET=1 runs Triton kernels on CPU tensors only"
    return "Triton kernels run on CUDA/ROCm tensors (or on the CPU under TRITON_INTERPRET=1)"


def describe(devices: Iterable[str | torch.device]) -> str:
    """The path of each distinct device, for the run metadata: ``"native"``, or ``"cuda:0=triton"``
    style entries joined by commas when devices differ (the CPU's path where none is given)."""
    found = {str(d): path_for(torch.device(d)) for d in devices if str(d) != "meta"} or {
        "cpu": path_for(torch.device("cpu"))
    }
    paths = set(found.values())
    if len(paths) == 1:
        return paths.pop()
    return ",".join(f"{d}={p}" for d, p in sorted(found.items()))


def reset() -> None:
    """Forget the warnings given and whether triton imports (tests)."""
    with _lock:
        _warned.clear()
    triton_importable.cache_clear()
