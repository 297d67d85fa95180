"""The PyTorch path never makes the host wait for the device, besides the one copy of a step.

No GPU is needed to check it: the path every non-CPU device takes (``StepStatistics(sync_free=True)``,
which also switches the compiled CPU kernel off) runs here on CPU tensors while a
``TorchFunctionMode`` records every call that would block on a GPU: reading a value
(``item``, ``tolist``, ``bool``, ``float``, ``int``, ``numpy``), copying to the host (``cpu``,
``to("cpu")``), ops whose output size depends on the data (``nonzero``, ``bincount``,
``masked_select``, ``unique``, boolean-mask indexing, ``repeat_interleave`` without an output
size), and tensors built from Python data (a host-to-device copy from pageable memory, which
waits). Exactly one ``cpu()`` per step is allowed; tensors from Python data only while a plan is
built (from pinned memory, without waiting, on a GPU).

On a GPU the same is checked by CUDA itself (see docs/performance.md)::

    torch.cuda.set_sync_debug_mode("error")   # any synchronising call raises
    engine.compute(jobs)                       # after one step that built the plan
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from tensorlens.compute.jobs import TensorJob
from tensorlens.compute.step import StepStatistics
from tensorlens.config import HistogramConfig
from tensorlens.dispatch.assemble import host_record
from tensorlens.stats.histogram import histogram_counts
from tensorlens.stats.moments import COL

COL_NAN = COL["nan_count"]

READS = {"item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "cpu"}
DATA_SIZED = {"nonzero", "argwhere", "bincount", "masked_select", "unique", "unique_consecutive", "histc"}
FROM_PYTHON = {"tensor", "as_tensor", "asarray"}


def _is_bool_mask(index: object) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class SyncCounter(TorchFunctionMode):
    """Counts the calls that would synchronise a GPU (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in READS or name in DATA_SIZED or name in FROM_PYTHON:
            self.calls[name] += 1
        elif name in ("__getitem__", "__setitem__", "index_put_", "index_put") and len(args) > 1 and _is_bool_mask(args[1]):
            self.calls[f"{name}[bool]"] += 1
        elif name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor) and "output_size" not in kwargs:
            self.calls["repeat_interleave(tensor)"] += 1
        elif name == "to" and any(_is_host(a) for a in (*args[1:], kwargs.get("device"))):
            self.calls["to(cpu)"] += 1
        return func(*args, **kwargs)


def _is_host(value: object) -> bool:
    return (isinstance(value, str) and value.startswith("cpu")) or (isinstance(value, torch.device) and value.type == "cpu")


def _jobs(nan: bool) -> list[TensorJob]:
    """A step like a small model's: weights and gradients of several sizes (small ones in a shared
    buffer, equal ones stacked, large ones alone), activations, a loss, a fixed-range and an
    outlier-rejecting histogram; with ``nan`` NaN and Inf in some of them."""
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(shape, generator=g) for shape in ((512, 300), (300,), (64, 256), (64, 256), (7,), (100_000,))]
    tensors.append(torch.randn(40, generator=g, dtype=torch.float64))
    if nan:
        tensors[0][3, 7] = math.nan
        tensors[2][0, 0] = math.inf
        tensors[4][2] = -math.inf
        tensors[5][::1000] = math.nan
    stats = ("min", "max", "mean", "std", "l2", "zero_fraction", "nan_count", "inf_count", "median", "abs_mean")
    jobs = [TensorJob(f"t/{i}", [t], stats, HistogramConfig(bins=16)) for i, t in enumerate(tensors)]
    jobs.append(TensorJob("fixed", [tensors[1]], ("mean",), HistogramConfig(bins=8, range=(-1.0, 1.0))))
    jobs.append(TensorJob("rejecting", [tensors[3]], ("mean",), HistogramConfig(bins=8, reject_outliers=0.05)))
    jobs.append(TensorJob("loss", [torch.tensor(0.25)], ("mean",), plain_scalar=True))
    return jobs


@pytest.fixture
def torch_ops(monkeypatch):
    from tensorlens.stats import native

    monkeypatch.setenv("TENSORLENS_NATIVE", "0")
    native.reset()
    yield
    monkeypatch.undo()
    native.reset()


@pytest.mark.parametrize("nan", [False, True])
def test_a_saved_step_waits_for_the_device_once(torch_ops, nan: bool) -> None:
    engine = StepStatistics(sync_free=True)
    engine.compute(_jobs(nan))  # builds the plan
    for _ in range(2):
        jobs = _jobs(nan)
        copies = engine.host_copies
        with SyncCounter() as counter:
            engine.compute(jobs)
        assert engine.plans_built == 1
        assert engine.host_copies == copies + 1
        assert counter.calls == Counter({"cpu": 1, "numpy": 1}), counter.calls  # numpy: of the host copy


def test_the_plan_is_built_without_waiting_but_for_constants(torch_ops) -> None:
    """Building a plan makes its index tensors from Python lists (on a GPU: pinned memory, copied
    without waiting) and reads nothing back from the device."""
    with SyncCounter() as counter:
        StepStatistics(sync_free=True).compute(_jobs(True))
    assert set(counter.calls) <= FROM_PYTHON | {"cpu", "numpy"}, counter.calls
    assert counter.calls["cpu"] == counter.calls["numpy"] == 1


@pytest.mark.parametrize("nan", [False, True])
def test_the_sync_free_path_gives_the_same_bits(kernel, nan: bool) -> None:
    """What a GPU computes equals what the CPU computes (with the kernel, or PyTorch ops reading
    flags on the host), to the bit: scalars, counts, edges."""
    reference = host_record(StepStatistics().compute(_jobs(nan)))
    found = host_record(StepStatistics(sync_free=True).compute(_jobs(nan)))
    assert found.scalar_names == reference.scalar_names
    if kernel == "torch":
        np.testing.assert_array_equal(found.scalar_values, reference.scalar_values)
    else:  # another summation order (blocks of 4096 merged in double): equal to rounding
        np.testing.assert_allclose(found.scalar_values, reference.scalar_values, rtol=2e-6, atol=1e-9)
    nan_at = [k for k, (_, stat) in enumerate(found.scalar_names) if stat in ("nan_count", "inf_count", "numel")]
    np.testing.assert_array_equal(found.scalar_values[nan_at], reference.scalar_values[nan_at])
    for mine, theirs in zip(found.histograms, reference.histograms, strict=True):
        assert mine.tensor == theirs.tensor
        np.testing.assert_array_equal(mine.counts, theirs.counts)
        np.testing.assert_array_equal(mine.edges, theirs.edges)


def test_index_add_histograms_equal_bincount_ones() -> None:
    """Counts go into a fixed-size buffer with index_add_ (bincount sizes its output from the
    data: a sync on a GPU); they equal bincount's to the bit."""
    g = torch.Generator().manual_seed(11)
    samples = [torch.randn(n, generator=g) * s for n, s in ((4096, 1.0), (4096, 3.0), (777, 0.1), (1, 1.0), (0, 1.0))]
    low = torch.tensor([s.min().item() if s.numel() else -0.5 for s in samples])
    high = torch.tensor([s.max().item() if s.numel() else 0.5 for s in samples])
    masks = [None, samples[1] > 0, None, None, None]
    counts, scale, _, _ = histogram_counts(samples, low, high, 32, masks)
    for g_, sample in enumerate(samples):
        keep = sample if masks[g_] is None else sample[masks[g_]]
        position = ((keep - low[g_]) * scale[g_]).nan_to_num(0.0, 31.0, 0.0).clamp(0, 31).floor().to(torch.int64)
        np.testing.assert_array_equal(counts[g_].numpy(), torch.bincount(position, minlength=32).numpy())


def test_an_activation_reduced_in_its_hook_does_not_wait_either(torch_ops, monkeypatch) -> None:
    """A large activation is reduced where it is captured (PyTorch ops on a GPU, its row kept on
    the device): no host sync there either, once its plan exists."""
    from tensorlens.compute import jobs
    from tensorlens.stats.torch_rows import TorchRows

    monkeypatch.setattr(jobs, "_torch_rows", lambda numel, dtype, device, columns: TorchRows(
        [numel], [dtype], [columns], device, counts="always"))  # what a GPU tensor gets
    plan = jobs.reduce_plan(("mean", "std", "zero_fraction", "nan_count"), HistogramConfig(bins=16))
    activation = torch.randn(300, 512)
    activation[3, 3] = math.nan
    jobs.reduce_now(activation, plan)
    with SyncCounter() as counter:
        piece = jobs.reduce_now(activation, plan)
    assert not {k: v for k, v in counter.calls.items() if k not in FROM_PYTHON}, counter.calls
    assert piece.native_row is None and piece.partial_row.device == activation.device
    assert piece.partial_row[COL_NAN].item() == 1
