"""Every reduction and histogram against numpy, over dtypes and awkward inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tensorlens.compute.jobs import TensorJob
from tensorlens.compute.step import StepStatistics
from tensorlens.config import HistogramConfig
from tensorlens.dispatch.assemble import host_record
from tensorlens.stats.histogram import histogram_range, histogram_scale
from tensorlens.stats.moments import PARTIALS, merge_partials, needed_columns, partial_row
from tensorlens.stats.registry import STATISTICS

# every declared statistic: declaring one without a numpy reference below fails these tests
ALL_STATS = tuple(STATISTICS)


def numpy_reference(a: np.ndarray) -> dict[str, float]:
    """The statistics computed by numpy in float64 on the whole tensor."""
    a = a.astype(np.float64).ravel()
    n = a.size
    b = np.abs(a)
    with np.errstate(all="ignore"):
        def guard(fn, x):
            return float(fn(x)) if n else math.nan

        return {
            "min": guard(np.min, a), "max": guard(np.max, a), "mean": guard(np.mean, a),
            "std": guard(np.std, a), "variance": guard(np.var, a), "sum": float(np.sum(a)),
            "prod": float(np.prod(a)), "median": guard(np.median, a),
            "l1": float(np.linalg.norm(a, 1)) if n else 0.0, "l2": float(np.linalg.norm(a)),
            "rms": float(np.sqrt(np.mean(a * a))) if n else math.nan,
            "linf": float(np.linalg.norm(a, np.inf)) if n else 0.0,
            "abs_min": guard(np.min, b), "abs_max": guard(np.max, b) if n else 0.0, "abs_mean": guard(np.mean, b),
            "abs_std": guard(np.std, b), "abs_variance": guard(np.var, b), "abs_sum": float(np.sum(b)),
            "abs_prod": float(np.prod(b)), "abs_median": guard(np.median, b),
            "abs_l1": float(np.sum(b)), "abs_l2": float(np.linalg.norm(b)), "abs_linf": float(np.max(b)) if n else 0.0,
            "numel": float(n), "nan_count": float(np.isnan(a).sum()), "inf_count": float(np.isinf(a).sum()),
            "zero_fraction": float((a == 0).mean()) if n else math.nan,
        }


def tolerance(stat: str, a: np.ndarray, dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol): float32 accumulation errs by a few ulps of sum(|x|); float64 by far less."""
    eps = 1e-13 if dtype == torch.float64 else 2e-6
    finite = np.abs(a[np.isfinite(a)].astype(np.float64))
    scale = float(finite.sum()) if finite.size else 0.0
    mean_scale = scale / max(finite.size, 1)
    if stat in ("sum", "abs_sum", "l1", "abs_l1"):
        return eps, eps * scale + 1e-12
    if stat in ("mean", "abs_mean"):
        return eps, eps * mean_scale * 4 + 1e-12
    if stat in ("variance", "abs_variance"):
        return 10 * eps, eps * (mean_scale**2) * 10 + 1e-12
    if stat == "rms":
        return 10 * eps, math.sqrt(eps) * mean_scale * 0.01 + 1e-12
    if stat in ("std", "abs_std"):
        return 10 * eps, math.sqrt(eps) * mean_scale * 0.01 + 1e-12
    if stat in ("prod", "abs_prod"):
        return 1e-4, 0.0
    return eps, 1e-12


def compute(tensors: list[torch.Tensor], stats=ALL_STATS, histogram: HistogramConfig | None = None):
    engine = StepStatistics()
    host = engine.compute([TensorJob(f"t/{i}", [t], tuple(stats), histogram) for i, t in enumerate(tensors)])
    _record = host_record(host)
    scalars, histograms, _ = list(_record.scalars), list(_record.histograms), list(_record.tensors)
    values = {(e.tensor, e.stat): e.value for e in scalars}
    return values, {h.tensor: h for h in histograms}, engine


def check_against_numpy(tensor: torch.Tensor, reference: np.ndarray | None = None) -> None:
    values, _, _ = compute([tensor])
    a = tensor.to(torch.float64).numpy() if reference is None else reference
    ref = numpy_reference(a)
    for stat in ALL_STATS:
        rtol, atol = tolerance(stat, a, tensor.dtype)
        got = values[("t/0", stat)]
        assert np.isclose(got, ref[stat], rtol=rtol, atol=atol, equal_nan=True), (stat, tensor.dtype, got, ref[stat])


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]

# every test here runs twice: with the compiled CPU kernel and with PyTorch ops only
pytestmark = pytest.mark.usefixtures("kernel")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (33, 17), (4, 5, 6)])
def test_random_tensors_match_numpy(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    check_against_numpy((torch.randn(shape) * 3 + 0.5).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_tensor_has_zero_spread(dtype: torch.dtype) -> None:
    tensor = torch.full((1000,), 0.1, dtype=dtype)
    check_against_numpy(tensor)
    values, _, _ = compute([tensor])
    assert values[("t/0", "std")] == pytest.approx(0.0, abs=1e-12)
    assert values[("t/0", "variance")] == pytest.approx(0.0, abs=1e-20)


def test_large_offset_does_not_cancel() -> None:
    # mean >> std: the textbook sum-of-squares formula loses every digit of the variance here
    tensor = torch.randn(100_000, dtype=torch.float64) * 1e-3 + 1e4
    values, _, _ = compute([tensor.float()])
    ref = np.std(tensor.float().double().numpy())
    assert values[("t/0", "std")] == pytest.approx(ref, rel=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_are_counted_and_propagate_like_numpy(dtype: torch.dtype) -> None:
    tensor = torch.tensor([1.0, float("nan"), -2.0, float("inf"), 0.0, float("-inf"), float("nan")], dtype=dtype)
    check_against_numpy(tensor)
    values, hists, engine = compute([tensor], histogram=HistogramConfig(sample=None, bins=4))
    assert values[("t/0", "nan_count")] == 2
    assert values[("t/0", "inf_count")] == 2
    assert math.isnan(values[("t/0", "mean")])
    h = hists["t/0"]
    assert h.counts.sum() == 3 and h.nan_count == 2 and h.inf_count == 2
    np.testing.assert_array_equal(h.counts, np.histogram([1.0, -2.0, 0.0], bins=h.edges)[0])
    assert engine.host_copies == 1  # NaN/Inf are counted without a second pass or copy


def test_only_inf_propagates_like_numpy() -> None:
    check_against_numpy(torch.tensor([1.0, float("inf"), 3.0]))
    check_against_numpy(torch.tensor([float("-inf"), float("inf")]))


def test_all_nan_tensor() -> None:
    values, hists, _ = compute([torch.full((5,), float("nan"))], histogram=HistogramConfig(sample=None, bins=8))
    assert values[("t/0", "nan_count")] == 5
    assert hists["t/0"].counts.sum() == 0


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool])
def test_integer_and_bool_tensors(dtype: torch.dtype) -> None:
    tensor = torch.randint(0, 2 if dtype == torch.bool else 100, (257,)).to(dtype)
    check_against_numpy(tensor, tensor.numpy().astype(np.float64))


def test_complex_tensor_is_summarised_by_magnitude_with_one_warning() -> None:
    tensor = torch.randn(50, dtype=torch.complex64)
    with pytest.warns(UserWarning, match="magnitude") as record:
        values, _, _ = compute([tensor, tensor])
    assert len([w for w in record if "magnitude" in str(w.message)]) == 1
    assert values[("t/0", "max")] == pytest.approx(tensor.abs().max().item(), rel=1e-6)


def test_few_million_elements() -> None:
    torch.manual_seed(1)
    tensor = torch.randn(3_000_001) * 0.02 + 0.001
    check_against_numpy(tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("poison", [None, "nan", "inf"])
def test_zero_counts_of_large_tensors_are_exact(dtype: torch.dtype, poison: str | None) -> None:
    # one tensor past the stacking size (reduced alone: the PyTorch path counts its nonzeros with a
    # dot of signs when it holds no NaN/Inf), ReLU-like, with and without NaN/Inf
    torch.manual_seed(3)
    tensor = torch.relu(torch.randn(300_001, dtype=dtype))
    tensor[::7] = -0.0
    if poison is not None:
        tensor[5] = float(poison)
    values, _, _ = compute([tensor])
    a = tensor.double().numpy()
    assert values[("t/0", "zero_fraction")] == float((a == 0).mean())
    assert values[("t/0", "nan_count")] == float(np.isnan(a).sum())
    assert values[("t/0", "inf_count")] == float(np.isinf(a).sum())


def test_partials_merge_exactly() -> None:
    torch.manual_seed(2)
    whole = torch.randn(10_000, dtype=torch.float64) * 5 + 3
    pieces = [whole[:1], whole[1:4000], whole[4000:4000], whole[4000:]]
    columns = needed_columns(ALL_STATS)
    rows = torch.stack([partial_row(p, columns) for p in pieces])
    for row in rows:  # nan/inf counts are filled on the host for finite tensors; they are zero here
        row[PARTIALS.index("nan_count")] = 0
        row[PARTIALS.index("inf_count")] = 0
    merged = merge_partials(rows)
    expected = partial_row(whole, columns)
    for name in ("count", "sum", "sumsq", "m2", "l1", "min", "max", "abs_min", "abs_m2"):
        i = PARTIALS.index(name)
        assert merged[i].item() == pytest.approx(expected[i].item(), rel=1e-10), name
    assert math.isnan(merged[PARTIALS.index("median")].item())  # not mergeable: never silently wrong


# ------------------------------------------------------------------------------------ histograms


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bins", [1, 7, 64, 512])
def test_histogram_counts_equal_numpy_with_the_reported_edges(dtype: torch.dtype, bins: int) -> None:
    torch.manual_seed(3)
    tensor = (torch.randn(20_000) * 2).to(dtype)
    _, hists, _ = compute([tensor], histogram=HistogramConfig(sample=None, bins=bins))
    h = hists["t/0"]
    values = tensor.to(torch.float64).numpy()
    assert h.edges[0] == values.min() and h.edges[-1] == values.max()
    np.testing.assert_array_equal(h.counts, np.histogram(values, bins=h.edges)[0])
    assert h.counts.sum() == tensor.numel() and len(h.counts) == bins


def test_histogram_of_values_on_the_edges() -> None:
    tensor = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 0.1, 0.3])
    _, hists, _ = compute([tensor], histogram=HistogramConfig(sample=None, bins=4))
    h = hists["t/0"]
    np.testing.assert_array_equal(h.counts, np.histogram(tensor.double().numpy(), bins=h.edges)[0])


def test_histogram_of_constant_and_empty_tensors() -> None:
    _, hists, _ = compute([torch.full((10,), 2.0), torch.empty(0), torch.tensor(5.0)], histogram=HistogramConfig(sample=None, bins=3))
    np.testing.assert_allclose(hists["t/0"].edges[[0, -1]], [1.5, 2.5])  # numpy widens a point range by 0.5
    assert hists["t/0"].counts.tolist() == [0, 10, 0]
    assert hists["t/1"].counts.sum() == 0
    assert hists["t/2"].counts.sum() == 1


def test_histogram_fixed_range_counts_outside_values() -> None:
    tensor = torch.linspace(-2, 2, 401)
    _, hists, _ = compute([tensor], histogram=HistogramConfig(bins=10, range=(-1.0, 1.0)))
    h = hists["t/0"]
    np.testing.assert_array_equal(h.counts, np.histogram(tensor.double().numpy(), bins=h.edges)[0])
    assert h.underflow == (tensor < -1).sum().item() and h.overflow == (tensor > 1).sum().item()


def test_histogram_sampling_is_a_documented_stride_and_reductions_stay_exact() -> None:
    torch.manual_seed(4)
    tensor = torch.randn(100_003)
    values, hists, _ = compute([tensor], histogram=HistogramConfig(bins=16, sample=1000))
    h = hists["t/0"]
    stride = math.ceil(tensor.numel() / 1000)
    sample = tensor[::stride].double().numpy()
    assert h.sampled and h.count == sample.size <= 1000
    np.testing.assert_array_equal(h.counts, np.histogram(sample, bins=h.edges)[0])
    assert values[("t/0", "numel")] == tensor.numel()
    assert values[("t/0", "max")] == tensor.max().item()


def test_sample_stride_visits_every_column_of_a_matrix() -> None:
    from tensorlens.stats.histogram import sample_stride

    assert sample_stride(512 * 512, 512, period=512) == 513  # 512 would take column 0 of every row
    assert sample_stride(100, None, period=10) == 1
    assert sample_stride(100, 200, period=10) == 1
    weight = torch.arange(512 * 512, dtype=torch.float32).reshape(512, 512)
    _, hists, _ = compute([weight], histogram=HistogramConfig(bins=8, sample=512))
    columns = torch.arange(0, 512 * 512, 513) % 512
    assert hists["t/0"].count == len(columns) and len(set(columns.tolist())) == 512


def test_default_histograms_sample_4096_values() -> None:
    assert HistogramConfig().sample == 4096
    _, hists, _ = compute([torch.randn(256, 300), torch.randn(100)], histogram=HistogramConfig())
    assert hists["t/0"].sampled and hists["t/0"].count <= 4096
    assert not hists["t/1"].sampled and hists["t/1"].count == 100


def test_histogram_outlier_rejection() -> None:
    tensor = torch.cat([torch.randn(990), torch.full((10,), 1e6)])
    _, hists, _ = compute([tensor], histogram=HistogramConfig(sample=None, bins=8, reject_outliers=0.01))
    h = hists["t/0"]
    assert h.rejected == 10 and h.counts.sum() == 990
    assert h.edges[-1] < 100  # the range follows the kept values



@pytest.mark.parametrize("offset, spread", [(1e4, 1e-3), (1.0, 1e-6), (-3e7, 5.0)])
def test_histogram_of_a_range_narrower_than_float32_can_split(offset: float, spread: float) -> None:
    # 512 bins over a range of a few ulps: bins collapse to equal edges and stay empty, yet every
    # value is counted exactly where numpy puts it with the reported edges
    torch.manual_seed(5)
    tensor = (torch.rand(5000, dtype=torch.float64) * spread + offset).float()
    _, hists, _ = compute([tensor], histogram=HistogramConfig(sample=None, bins=512))
    h = hists["t/0"]
    assert np.all(np.diff(h.edges) >= 0)
    np.testing.assert_array_equal(h.counts, np.histogram(tensor.double().numpy(), bins=h.edges)[0])
    assert h.counts.sum() == 5000


def test_histogram_with_a_fixed_range_reports_the_data_range() -> None:
    tensor = torch.tensor([-3.0, -0.25, 0.0, 0.5, 2.0])
    _, hists, _ = compute([tensor], histogram=HistogramConfig(bins=4, range=(-1.0, 1.0)))
    h = hists["t/0"]
    assert (h.min, h.max) == (-3.0, 2.0)
    assert h.edges[0] == -1.0 and h.edges[-1] == 1.0
    assert (h.underflow, h.overflow, h.count) == (1, 1, 3)


def test_histogram_edges_near_zero_are_exact() -> None:
    # (x - low) rounds to -low for every |x| below half an ulp of low: the edge near 0 of a
    # symmetric range is where that stops, about -3e-8 for low = -1, not 0
    tiny = [-3e-8, -2.9e-8, -1e-9, -1e-30, -0.0, 0.0, 1e-30, 1e-9, 2.9e-8, 3e-8]
    tensor = torch.tensor([-1.0, 1.0, *tiny, -0.5, 0.5, -0.49999997, 0.49999997])
    for config in (HistogramConfig(sample=None, bins=4), HistogramConfig(sample=None, bins=4, range=(-1.0, 1.0))):
        _, hists, _ = compute([tensor], histogram=config)
        h = hists["t/0"]
        np.testing.assert_array_equal(h.counts, np.histogram(tensor.double().numpy(), bins=h.edges)[0])
        assert h.counts.sum() == tensor.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exact_edges_on_random_ranges(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(7)
    for _ in range(20):
        center = (torch.rand((), generator=generator, dtype=torch.float64) - 0.5) * 10 ** torch.randint(-3, 6, (), generator=generator)
        spread = 10 ** torch.randint(-6, 3, (), generator=generator).double()
        tensor = (center + spread * torch.randn(3000, generator=generator, dtype=torch.float64)).to(dtype)
        _, hists, _ = compute([tensor], histogram=HistogramConfig(sample=None, bins=int(torch.randint(1, 513, (), generator=generator))))
        h = hists["t/0"]
        np.testing.assert_array_equal(h.counts, np.histogram(tensor.double().numpy(), bins=h.edges)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_histogram_ranges_and_scales_are_the_same_bits_in_numpy_and_pytorch(dtype: torch.dtype) -> None:
    # the compiled kernel's path computes them in numpy, the PyTorch path with tensor ops
    low = torch.tensor([0.1, -3.0, 2.5, math.nan, -math.inf, 1e-30, -1e38, 7.0], dtype=torch.float64)
    high = torch.tensor([0.1 + 1e-9, 4.0, 2.5, 1.0, 3.0, 2e-30, 1e38, math.nan], dtype=torch.float64)
    t_low, t_high = histogram_range(low, high, dtype)
    n_low, n_high = histogram_range(low.numpy(), high.numpy(), dtype)
    assert n_low.dtype == t_low.numpy().dtype
    np.testing.assert_array_equal(n_low, t_low.numpy())
    np.testing.assert_array_equal(n_high, t_high.numpy())
    np.testing.assert_array_equal(histogram_scale(n_low, n_high, 64), histogram_scale(t_low, t_high, 64).numpy())
