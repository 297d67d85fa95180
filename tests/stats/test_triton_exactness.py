"""The fused Triton kernels against numpy float64, run on CPU tensors in Triton's interpreter.

The same cases the compiled kernel and PyTorch ops pass (tests/test_reductions.py,
tests/test_nonfinite.py and the others take a ``kernel`` fixture that includes this path), here
with every statistic the kernels compute, so that no tensor leaves for PyTorch ops: every dtype,
empty and 0-d tensors, NaN and Inf, huge and tiny values, a tensor of 3 million values (items
merged), 10,000 tiny tensors in one step, histograms with exact edges and fixed ranges, a sparse
gradient made dense. Each test checks that the plan put its tensors on the Triton path.

Runs where Triton runs on CPU tensors: ``TRITON_INTERPRET=1`` (CI: see .ci/run); skipped elsewhere
with the reason.
"""

from __future__ import annotations

import math
import os
import warnings

import numpy as np
import pytest
import torch
from test_reductions import numpy_reference, tolerance

from tensorlens.compute.jobs import TensorJob
from tensorlens.compute.step import StepStatistics
from tensorlens.config import HistogramConfig
from tensorlens.dispatch.assemble import host_record
from tensorlens.stats import path
from tensorlens.stats.histogram import sample_stride
from tensorlens.stats.moments import needed_columns
from tensorlens.stats.registry import STATISTICS
from tensorlens.stats.triton.rows import TRITON_COLUMNS

if not path.triton_importable():
    pytest.skip("triton is not installed (pip install --no-deps triton==3.9.0)", allow_module_level=True)
if not path.interpreting():
    pytest.skip(
        "the Triton kernels read CPU tensors only in Triton's interpreter: run with TRITON_INTERPRET=1 "
        "(as .ci/run does)",
        allow_module_level=True,
    )

#: Every declared statistic the fused kernels compute (median and product take PyTorch ops).
TRITON_STATS = tuple(name for name in STATISTICS if needed_columns((name,)) <= TRITON_COLUMNS)
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.fixture(autouse=True)
def triton_path(monkeypatch):
    monkeypatch.setenv("TENSORLENS_STATS_PATH", "triton")
    path.reset()
    yield
    monkeypatch.undo()
    path.reset()


def compute(tensors: list[torch.Tensor], stats=TRITON_STATS, histogram: HistogramConfig | None = None, sync_free=False):
    engine = StepStatistics(sync_free=sync_free)
    record = host_record(
        engine.compute([TensorJob(f"t/{i}", [t], tuple(stats), histogram) for i, t in enumerate(tensors)])
    )
    assert engine._plan.path == "triton" and engine._plan.triton == list(range(len(tensors))), "not on the Triton path"
    return record, engine


def check(tensors: list[torch.Tensor], sync_free: bool = False) -> StepStatistics:
    record, engine = compute(tensors, sync_free=sync_free)
    for i, tensor in enumerate(tensors):
        a = tensor.to(torch.float64).numpy()
        reference = numpy_reference(a)
        for stat in TRITON_STATS:
            rtol, atol = tolerance(stat, a, tensor.dtype)
            got = record.scalar(f"t/{i}", stat)
            assert np.isclose(got, reference[stat], rtol=rtol, atol=atol, equal_nan=True), (
                i,
                stat,
                tensor.dtype,
                got,
                reference[stat],
            )
    return engine


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sync_free", [False, True])
def test_every_dtype_and_shape_matches_numpy(dtype: torch.dtype, sync_free: bool) -> None:
    torch.manual_seed(0)
    shapes = [(), (0,), (1,), (7,), (33, 17), (4, 5, 6), (70_001,)]
    tensors = [(torch.randn(shape) * 3 + 0.5).to(dtype) for shape in shapes]
    tensors.append(torch.full((1000,), 0.1, dtype=dtype))  # a constant: no spread
    check(tensors, sync_free)
    record, _ = compute([tensors[-1]])
    assert record.scalar("t/0", "std") == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_are_counted_and_propagate_like_numpy(dtype: torch.dtype) -> None:
    values = [1.0, math.nan, -2.0, math.inf, 0.0, -math.inf, math.nan]
    tensors = [
        torch.tensor(values, dtype=dtype),
        torch.tensor([1.0, math.inf, 3.0], dtype=dtype),
        torch.tensor([-math.inf, math.inf], dtype=dtype),
        torch.full((5,), math.nan, dtype=dtype),
    ]
    poisoned = torch.randn(200_000, dtype=torch.float64).to(dtype)
    poisoned[77_777], poisoned[150_001] = math.nan, math.inf  # in different items of a large tensor
    tensors.append(poisoned)
    check(tensors)
    record, engine = compute(tensors[:1], histogram=HistogramConfig(sample=None, bins=4))
    h = record.histogram("t/0")
    assert record.scalar("t/0", "nan_count") == 2 and record.scalar("t/0", "inf_count") == 2
    assert h.counts.sum() == 3 and h.nan_count == 2 and h.inf_count == 2
    np.testing.assert_array_equal(h.counts, np.histogram([1.0, -2.0, 0.0], bins=h.edges)[0])
    assert engine.host_copies == 1


def test_huge_and_tiny_values_and_a_large_offset() -> None:
    torch.manual_seed(1)
    check(
        [
            torch.full((4096,), 3e38),  # a float32 block sum overflows; the float64 merge does not
            torch.randn(5000) * 1e-30,
            torch.randn(5000, dtype=torch.float64) * 1e150,
            torch.tensor([1e-45, -1e-45, 0.0]),  # float32 subnormals
            torch.randn(100_000, dtype=torch.float64).float() * 1e-3 + 1e4,  # mean >> std: the variance survives
        ]
    )


def test_three_million_values_are_split_into_items_and_merged_exactly() -> None:
    torch.manual_seed(2)
    tensor = torch.randn(3_000_001) * 0.02 + 0.001
    tensor[::9] = 0.0
    engine = check([tensor])
    assert engine._plan.triton_rows.n_items == 46  # 64K values per item


def test_ten_thousand_tiny_tensors_in_one_step() -> None:
    rng = np.random.default_rng(3)
    arrays = [rng.normal(size=int(n)) * rng.uniform(0.1, 10) for n in rng.integers(0, 40, 10_000)]
    arrays[17][:] = np.nan if arrays[17].size else arrays[17]
    tensors = [torch.from_numpy(a).float() for a in arrays]
    stats = ("min", "max", "mean", "std", "l2", "zero_fraction", "nan_count", "abs_min")
    record, engine = compute(tensors, stats)
    assert len(engine._plan.triton_rows.launches) <= 3  # a launch per size class, not per tensor
    got = {stat: np.array([record.scalar(f"t/{i}", stat) for i in range(len(tensors))]) for stat in stats}
    padded = np.full((len(arrays), 40), np.nan)  # numpy's statistics of every tensor at once (NaN-padded rows)
    for i, t in enumerate(tensors):
        padded[i, : t.numel()] = t.double().numpy()
    n = np.array([t.numel() for t in tensors], dtype=np.float64)
    has_nan = np.array([bool(np.isnan(a).any()) for a in arrays])
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy: "All-NaN slice" of the empty rows
        mean = np.nansum(padded, 1) / n
        expected = {
            "min": np.nanmin(padded, 1),
            "max": np.nanmax(padded, 1),
            "mean": mean,
            "std": np.sqrt(np.nansum((padded - mean[:, None]) ** 2, 1) / n),
            "l2": np.sqrt(np.nansum(padded**2, 1)),
            "zero_fraction": np.nansum(padded == 0, 1) / n,
            "nan_count": np.zeros(len(arrays)),
            "abs_min": np.nanmin(np.abs(padded), 1),
        }
    for stat, want in expected.items():
        want = np.where(has_nan & (stat != "zero_fraction"), np.nan, want)
        want = np.where((n == 0) & np.isin(stat, ("l2", "zero_fraction")), 0.0 if stat == "l2" else np.nan, want)
        if stat == "nan_count":
            want = np.array([float(np.isnan(a).sum()) for a in arrays])
        np.testing.assert_allclose(got[stat], want, rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=stat)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bins", [1, 7, 64, 512])
def test_histograms_are_exact_and_the_same_bits_as_pytorch_ops(dtype: torch.dtype, bins: int, monkeypatch) -> None:
    """numpy bins the sample into the recorded counts with the recorded edges, and the counts and
    edges equal those of PyTorch ops on the path a GPU takes, to the bit."""
    g = torch.Generator().manual_seed(4)
    tensors = [
        (torch.randn(n, generator=g, dtype=torch.float64) * 10.0**e + c).to(dtype)
        for n, e, c in ((100_003, 0, 0.0), (999, -6, 1.0), (5, 3, -7.0), (0, 0, 0.0), (4096, -30, 0.0), (1, 0, 2.0))
    ]
    tensors.append(torch.randn(512, 300, generator=g).to(dtype))  # strided across a matrix's columns
    config = HistogramConfig(bins=bins)
    record, _ = compute(tensors, ("mean",), config)
    monkeypatch.setenv("TENSORLENS_STATS_PATH", "torch")
    reference = host_record(
        StepStatistics(sync_free=True).compute(
            [TensorJob(f"t/{i}", [t], ("mean",), config) for i, t in enumerate(tensors)]
        )
    )
    for i, t in enumerate(tensors):
        flat = t.float().reshape(-1) if dtype == torch.bfloat16 else t.reshape(-1)
        sample = flat[:: sample_stride(flat.numel(), config.sample, t.shape[-1] if t.dim() else 1)].double().numpy()
        h, r = record.histogram(f"t/{i}"), reference.histogram(f"t/{i}")
        np.testing.assert_array_equal(h.counts, np.histogram(sample, bins=h.edges)[0])
        np.testing.assert_array_equal(h.counts, r.counts)
        np.testing.assert_array_equal(h.edges, r.edges)
        assert h.count == sample.size


def test_a_fixed_range_counts_what_falls_outside() -> None:
    torch.manual_seed(5)
    tensor = torch.randn(10_000) * 2
    tensor[3], tensor[4] = math.nan, -math.inf  # never binned, never counted outside
    record, _ = compute([tensor], ("mean",), HistogramConfig(bins=8, sample=None, range=(-1.0, 1.0)))
    h = record.histogram("t/0")
    a = tensor.numpy()
    finite = a[np.isfinite(a)]
    np.testing.assert_array_equal(h.counts, np.histogram(finite, bins=h.edges)[0])
    assert (h.edges[0], h.edges[-1]) == (-1.0, 1.0)
    assert h.underflow == (finite < -1).sum() and h.overflow == (finite > 1).sum()


@pytest.mark.parametrize("sync_free", [False, True])
def test_histograms_of_poisoned_tensors_span_the_finite_values_of_their_sample(sync_free: bool) -> None:
    g = torch.Generator().manual_seed(6)
    tensors = [torch.randn(n, generator=g) for n in (7, 300, 5000, 70_001)]
    tensors[0][2] = math.nan
    tensors[1][::5] = math.inf
    tensors[2][:] = math.nan
    config = HistogramConfig(bins=16, sample=1000)
    record, _ = compute(tensors, ("mean",), config, sync_free)
    for i, t in enumerate(tensors):
        a = t.numpy()
        sample = a[:: sample_stride(a.size, config.sample, a.size)]
        finite = sample[np.isfinite(sample)]
        h = record.histogram(f"t/{i}")
        assert h.counts.sum() == finite.size and h.nan_count == np.isnan(a).sum()
        np.testing.assert_array_equal(h.counts, np.histogram(finite.astype(np.float64), bins=h.edges)[0])
        # the range: the tensor's own where it is finite, else its sample's finite values
        span = (a.min(), a.max()) if np.isfinite(a).all() else (finite.min(), finite.max()) if finite.size else None
        if span is not None and span[0] < span[1]:
            assert (h.edges[0], h.edges[-1]) == span


@pytest.mark.parametrize("nan", [False, True])
def test_a_step_waits_for_the_device_once(nan: bool) -> None:
    """On the path a GPU takes, a saved step makes no call that would wait for the device but the
    one copy to the host (tests/test_sync_free.py's counter), and the plan is reused."""
    from test_sync_free import SyncCounter

    torch.manual_seed(7)
    tensors = [torch.randn(300, 40), torch.randn(17), torch.randn(100_000, dtype=torch.float64)]
    if nan:
        tensors[0][3, 3], tensors[2][5] = math.nan, -math.inf
    engine = StepStatistics(sync_free=True)
    jobs = [TensorJob(f"t/{i}", [t], ("mean", "std", "l2"), HistogramConfig(bins=16)) for i, t in enumerate(tensors)]
    jobs.append(TensorJob("fixed", [tensors[1]], ("mean",), HistogramConfig(bins=8, range=(-1.0, 1.0))))
    engine.compute(jobs)  # builds the plan
    with SyncCounter() as counter:
        engine.compute(jobs)
    assert counter.calls == {"cpu": 1, "numpy": 1}, counter.calls  # numpy: of the host copy
    assert engine.host_copies == 2 and engine.plans_built == 1 and engine._plan.triton == [0, 1, 2, 3]
    assert all(group.triton is not None for group in engine._plan.groups)


def test_activations_reduced_in_their_hook_are_read_in_their_own_dtype(tmp_path) -> None:
    """A bfloat16 activation is reduced where it is captured by the kernels, read as bfloat16;
    its statistics equal numpy's of its values."""
    import tensorlens as tl

    torch.manual_seed(8)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU()).to(torch.bfloat16)
    memory = tl.MemoryBackend()
    hook = tl.Hook(
        out_dir=tmp_path / "run",
        backends=[memory],
        include_collections=["activations"],
        save_config=tl.SaveConfig(save_interval=1),
        reduction_config=tl.ReductionConfig(reductions=("mean", "std", "min", "max")),
    )
    hook.register_module(model)
    seen = {}
    model[1].register_forward_hook(lambda m, i, o: seen.update(relu=o.detach().double().numpy().copy()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(64, 64, dtype=torch.bfloat16)).float().sum().backward()
    optimizer.step()
    hook.close()
    record = memory.records[0]
    name = next(n for n in record.tensor_names() if n.startswith("activations/") and "1" in n)
    a = seen["relu"]
    assert record.scalar(name, "mean") == pytest.approx(a.mean(), rel=1e-5)
    assert record.scalar(name, "std") == pytest.approx(a.std(), rel=1e-4)
    assert (record.scalar(name, "min"), record.scalar(name, "max")) == (a.min(), a.max())


def test_the_interpreter_is_what_runs_here() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1" and path.path_for(torch.device("cpu")) == "triton"


def test_the_traffic_benchmark_counts_one_read_per_value_on_the_triton_path() -> None:
    """benchmarks/traffic.py on one large tensor: the Triton kernels read each value once and
    write nothing of its size (their own accounting plus the ATen ops around them); PyTorch ops,
    counted op by op, read it more than nine times, as docs/performance.md says."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "traffic", Path(__file__).resolve().parents[2] / "benchmarks" / "traffic.py"
    )
    traffic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(traffic)
    jobs = [TensorJob("a", [torch.randn(1 << 20)], ("min", "max", "mean", "std", "zero_fraction"), None)]
    triton, torch_ops = traffic.measure("triton", jobs), traffic.measure("torch", jobs)
    assert triton["reads_per_value"] < 1.01 and triton["writes_per_value"] < 0.01, triton
    assert torch_ops["reads_per_value"] > 9 and torch_ops["writes_per_value"] > 3, torch_ops


def test_a_declared_column_leaves_only_its_tensors_to_pytorch_ops(tmp_path) -> None:
    """A statistic over a column declared with its own ``compute`` (tests/stats/test_declared_column.py)
    is recorded on the Triton path too: the tensors that ask for it take PyTorch ops, the others the
    kernels, each statistic numpy's."""
    import subprocess
    import sys
    import textwrap

    from test_declared_column import DECLARE

    code = textwrap.dedent("""
        import numpy as np, torch
        from tensorlens.compute.jobs import TensorJob
        from tensorlens.compute.step import StepStatistics
        from tensorlens.dispatch.assemble import host_record

        g = torch.Generator().manual_seed(0)
        tensors = [torch.randn(n, generator=g) for n in (7, 3000, 70_001)]
        jobs = [TensorJob(f"a/{i}", [t], ("positive_fraction", "mean")) for i, t in enumerate(tensors)]
        jobs += [TensorJob(f"b/{i}", [t], ("mean", "std")) for i, t in enumerate(tensors)]
        engine = StepStatistics()
        record = host_record(engine.compute(jobs))
        assert engine._plan.path == "triton" and engine._plan.triton == [3, 4, 5] and engine._plan.torch == [0, 1, 2]
        for i, t in enumerate(tensors):
            a = t.double().numpy()
            assert record.scalar(f"a/{i}", "positive_fraction") == (a > 0).mean()
            assert abs(record.scalar(f"a/{i}", "mean") - a.mean()) < 1e-6
            assert abs(record.scalar(f"b/{i}", "std") - a.std()) < 1e-5 * a.std()
        print("ok")
    """)
    env = {**os.environ, "TENSORLENS_STATS_PATH": "triton", "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", DECLARE + code], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr[-4000:]
