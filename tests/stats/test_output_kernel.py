"""The compiled one-read kernel for module outputs (``outputs.c``: per-unit active counts,
per-sample norms, saturated count) against the PyTorch ops it replaces and numpy float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tensorlens.stats import derived


def _torch_path(monkeypatch, *args, **kwargs) -> derived.OutputStatistics:
    monkeypatch.setenv("TENSORLENS_NATIVE", "0")  # read at every call: no rebuild
    try:
        return derived.output_statistics(*args, **kwargs)
    finally:
        monkeypatch.delenv("TENSORLENS_NATIVE")


def _numpy_reference(y: np.ndarray, channel_last: bool, threshold: float, bounds, normalize: bool):
    """Counts, positions, saturated and norms in float64, written out from their definitions."""
    y64 = y.astype(np.float64)
    thr = y.dtype.type(threshold)  # PyTorch compares in the tensor's own dtype
    active = np.abs(y) > thr
    if y.ndim < 2:
        counts, positions = np.array([active.sum()], dtype=np.float64), max(1, y.size)
    else:
        units = y.shape[-1] if channel_last else y.shape[1]
        positions = y.size // units if units else 0
        by_unit = active if channel_last else np.moveaxis(active, 1, -1)
        counts = by_unit.reshape(positions, units).sum(axis=0).astype(np.float64)
    low, high = (y.dtype.type(b) for b in bounds)
    saturated = int(((y >= high) | (y <= low)).sum())
    rows = y64.reshape(y.shape[0], math.prod(y.shape[1:]))
    norms = np.sqrt((rows * rows).sum(axis=1))
    if normalize and rows.shape[1]:
        norms = norms / math.sqrt(rows.shape[1])
    return counts, positions, saturated, norms


def _outputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(7)
    relu = torch.relu(torch.randn(8, 5, 7, generator=g, dtype=dtype))
    special = torch.randn(4, 6, 3, 5, generator=g, dtype=dtype)
    special[0, 1, 2, 3], special[1, 2, 0, 0], special[3, 5, 2, 4] = math.nan, math.inf, -math.inf
    tanh = torch.tanh(3 * torch.randn(6, 33, generator=g, dtype=dtype))  # 33: a row's tail after the 8 lanes
    return [
        (relu, True), (relu, False), (special, True), (special, False), (tanh, True), (tanh, False),
        (torch.randn(9, generator=g, dtype=dtype), True),  # a vector: one unit
        (torch.zeros(0, 5, 7, dtype=dtype), True), (torch.zeros(0, 5, 7, dtype=dtype), False),  # an empty batch
        (torch.zeros(3, 0, dtype=dtype), True),  # no unit at all
        (torch.full((2, 3, 4), 0.1, dtype=dtype), True),  # exactly at the threshold of 0.1
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threshold", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("normalize", [False, True])
def test_kernel_equals_the_pytorch_ops_and_numpy(kernel_on, monkeypatch, dtype, threshold, normalize) -> None:
    bounds = derived.saturation_bounds(-1.0, 1.0, 0.9)
    for y, channel_last in _outputs(dtype):
        fast = derived.output_statistics(y, channel_last, threshold, bounds, normalize=normalize)
        slow = _torch_path(monkeypatch, y, channel_last, threshold, bounds, normalize=normalize)
        counts, positions, saturated, norms = _numpy_reference(y.numpy(), channel_last, threshold, bounds, normalize)
        assert fast.counts.dtype == torch.float64 and fast.norms.dtype == torch.float64
        # counts and saturated values exactly, as the PyTorch path counts them
        np.testing.assert_array_equal(fast.counts.numpy(), counts)
        np.testing.assert_array_equal(fast.counts.numpy(), slow.counts.to(torch.float64).numpy())
        assert fast.positions == slow.positions == positions
        assert fast.saturated == int(slow.saturated) == saturated
        # norms summed in float64: to float64 rounding of numpy, to float32 rounding of PyTorch's slices
        np.testing.assert_allclose(fast.norms.numpy(), norms, rtol=1e-13, atol=0)
        np.testing.assert_allclose(fast.norms.numpy(), slow.norms.numpy(), rtol=1e-6 if dtype == torch.float32 else 1e-13)
        assert fast.norms.shape == slow.norms.shape == (y.shape[0],)


def test_kernel_asks_only_for_what_is_wanted(kernel_on) -> None:
    y = torch.randn(4, 8)
    read = derived.output_statistics(y, True, units=False, norms=False)
    assert read.counts is None and read.norms is None and read.saturated is None and read.positions == 0
    read = derived.output_statistics(y, True, norms=False)
    assert read.counts is not None and read.norms is None and read.saturated is None and read.positions == 4


def test_gradient_norms_through_the_kernel_match_numpy(kernel_on, monkeypatch) -> None:
    """``sample_norms`` (the backward hooks' per-sample gradient norms) reads supported tensors with
    the kernel; non-contiguous and half-precision tensors keep the PyTorch ops."""
    g = torch.Generator().manual_seed(1)
    grad = torch.randn(5, 3, 20_000, generator=g) * 1e3  # rows longer than PyTorch's float32 slices
    grad[2, 1, 7] = math.inf
    fast = derived.sample_norms(grad)
    reference = np.sqrt((grad.numpy().astype(np.float64).reshape(5, -1) ** 2).sum(axis=1))
    np.testing.assert_allclose(fast.numpy(), reference, rtol=1e-13)
    assert math.isinf(fast[2])
    np.testing.assert_allclose(fast.numpy(), derived.sample_norms(grad, native_read=False).numpy(), rtol=1e-6)
    for other in (grad.transpose(0, 1), grad.to(torch.bfloat16), grad[:, :, ::2]):
        ref = np.sqrt((other.to(torch.float64).numpy().reshape(other.shape[0], -1) ** 2).sum(axis=1))
        np.testing.assert_allclose(derived.sample_norms(other).numpy(), ref, rtol=1e-5)


def test_threads_give_the_same_bits(kernel_on, monkeypatch) -> None:
    """A large output is shared among threads by rows (with PyTorch's OpenMP pool): the same
    counts and norms as one thread."""
    y = torch.randn(16, 32, 1024, generator=torch.Generator().manual_seed(4))
    y[3, 4, 5] = math.nan
    bounds = derived.saturation_bounds(-2.0, 2.0, 0.5)
    monkeypatch.setenv("TENSORLENS_NATIVE_THREADS", "1")
    one = [derived.output_statistics(y, cl, 0.5, bounds) for cl in (True, False)]
    monkeypatch.setenv("TENSORLENS_NATIVE_THREADS", "2")
    two = [derived.output_statistics(y, cl, 0.5, bounds) for cl in (True, False)]
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a.counts, b.counts) and a.saturated == b.saturated
        assert torch.equal(a.norms.nan_to_num(), b.norms.nan_to_num()) and a.norms.isnan().tolist() == b.norms.isnan().tolist()
    slow = _torch_path(monkeypatch, y, False, 0.5, bounds)
    np.testing.assert_array_equal(one[1].counts.numpy(), slow.counts.numpy())
    assert one[1].saturated == int(slow.saturated)


def test_the_torch_path_is_used_when_the_kernel_is_off(monkeypatch) -> None:
    for variable, value in (("TENSORLENS_NATIVE", "0"), ("TENSORLENS_STATS_PATH", "torch")):
        monkeypatch.setenv(variable, value)
        read = derived.output_statistics(torch.tensor([[0.0, 2.0], [1.0, -3.0]]), True, 0.5, (-2.5, 2.5))
        assert isinstance(read.saturated, torch.Tensor) and int(read.saturated) == 1
        assert read.counts.tolist() == [1.0, 2.0] and read.norms.dtype == torch.float64
        monkeypatch.delenv(variable)


def _numpy_dots(a, b) -> np.ndarray:
    return np.array([(x.numpy().astype(np.float64) * y.numpy().astype(np.float64)).sum() for x, y in zip(a, b, strict=True)])


def test_kernel_dot_products_match_numpy_and_the_pytorch_ops(kernel_on, monkeypatch) -> None:
    """``dots.c``: every pair in one call, products summed in float64 (more exact than the float32
    ``torch.dot`` of large tensors); NaN/Inf propagate; empty tensors give 0."""
    g = torch.Generator().manual_seed(9)
    a = [torch.randn(n, generator=g) for n in (1, 7, 2048, 2049, 300_000)] + [torch.randn(50, 40, generator=g, dtype=torch.float64)]
    a += [torch.zeros(0), torch.tensor([math.inf, 1.0]), torch.tensor([math.nan])]
    b = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in a]
    fast = derived.dot_products(a, b)
    reference = _numpy_dots(a, b)
    assert fast.dtype == torch.float64 and fast.shape == (len(a),)
    np.testing.assert_allclose(fast.numpy(), reference, rtol=1e-12)
    assert float(fast[6]) == 0.0 and not math.isfinite(float(fast[7])) and math.isnan(float(fast[8]))
    monkeypatch.setenv("TENSORLENS_NATIVE", "0")
    slow = derived.dot_products(a, b)
    monkeypatch.delenv("TENSORLENS_NATIVE")
    np.testing.assert_allclose(fast.numpy()[:6], slow.numpy()[:6], rtol=1e-5)
    squares = derived.squared_norms(a[:6])
    np.testing.assert_allclose(squares.numpy(), _numpy_dots(a[:6], a[:6]), rtol=1e-13)


def test_kernel_dot_products_the_same_bits_on_any_threads_and_fall_back(kernel_on, monkeypatch) -> None:
    g = torch.Generator().manual_seed(10)
    a = [torch.randn(n, generator=g) for n in (1_000_003, 5, 200_000)]
    b = [torch.randn(t.shape, generator=g) for t in a]
    monkeypatch.setenv("TENSORLENS_NATIVE_THREADS", "1")
    one = derived.dot_products(a, b)
    monkeypatch.setenv("TENSORLENS_NATIVE_THREADS", "3")
    assert torch.equal(one, derived.dot_products(a, b))
    # what the kernel does not read (another dtype in a pair, a strided view, half precision) takes the PyTorch ops
    mixed = [torch.randn(10, generator=g), torch.randn(6, 5, generator=g).t(), torch.randn(9, generator=g).to(torch.bfloat16)]
    other = [mixed[0].to(torch.float64), torch.randn(5, 6, generator=g), torch.randn(9, generator=g).to(torch.bfloat16)]
    reference = [(x.to(torch.float64) * y.to(torch.float64)).sum().item() for x, y in zip(mixed, other, strict=True)]
    np.testing.assert_allclose(derived.dot_products(mixed, other).numpy(), reference, rtol=1e-6)
