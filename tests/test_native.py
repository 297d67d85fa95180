"""The compiled CPU kernel against PyTorch ops and numpy: same statistics, same bins, and a clean
fallback when it cannot be built."""

from __future__ import annotations

import math
import os
import shutil
import stat
import sys

import numpy as np
import pytest
import torch

from tensorlens.compute.jobs import TensorJob
from tensorlens.compute.step import StepStatistics
from tensorlens.config import HistogramConfig
from tensorlens.dispatch.assemble import host_record
from tensorlens.stats import native
from tensorlens.stats.histogram import histogram_counts, histogram_range, sample_stride
from tensorlens.stats.moments import COL, NATIVE_COLUMNS, partial_rows


def _torch_rows(values: list[torch.Tensor], monkeypatch) -> torch.Tensor:
    monkeypatch.setenv("TENSORLENS_NATIVE", "0")
    native.reset()
    try:
        return partial_rows(values, [NATIVE_COLUMNS] * len(values))
    finally:
        monkeypatch.delenv("TENSORLENS_NATIVE")
        native.reset()


def _awkward_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(3_000_001, generator=g)
    with_nan = torch.randn(700_000, generator=g)
    with_nan[123_457] = math.nan
    with_inf = torch.randn(70_000, generator=g, dtype=torch.float64)
    with_inf[5] = math.inf
    both_inf = torch.randn(5000, generator=g)
    both_inf[0], both_inf[4999] = math.inf, -math.inf
    huge = torch.full((4096,), 3e38)  # a float32 block sum overflows; the sum in double does not
    relu = torch.relu(torch.randn(262_144, generator=g))
    return [
        big, with_nan, with_inf, both_inf, huge, relu,
        torch.randn(1_000_000, generator=g) * 1e-3 + 1e4,  # mean >> std
        torch.full((100_003,), 0.1), torch.zeros(0), torch.tensor([2.5]), torch.arange(17, dtype=torch.float64),
    ]


def test_kernel_rows_match_pytorch_and_numpy(kernel_on, monkeypatch) -> None:
    values = _awkward_tensors()
    got = partial_rows(values, [NATIVE_COLUMNS] * len(values)).numpy()
    reference = _torch_rows(values, monkeypatch).numpy()
    for i, v in enumerate(values):
        a = v.double().numpy()
        finite = a[np.isfinite(a)]
        scale = float(np.abs(finite).sum()) if finite.size else 0.0
        with np.errstate(all="ignore"):
            expected = {
                "count": a.size, "sum": a.sum(), "min": a.min() if a.size else math.nan,
                "max": a.max() if a.size else math.nan, "l1": np.abs(a).sum(), "zero_count": float((a == 0).sum()),
                "m2": ((a - a.mean()) ** 2).sum() if a.size else 0.0,
            }
        for name, value in expected.items():
            if not np.isfinite(value):  # NaN and Inf propagate exactly as in numpy, on both paths
                assert np.array_equal([got[i, COL[name]], reference[i, COL[name]]], [value, value], equal_nan=True), (i, name)
                continue
            tolerance = 0.0 if name in ("count", "min", "max", "zero_count") else 2e-6 * max(scale, abs(value))
            if name == "m2":
                tolerance = 1e-5 * value + 1e-9 * (scale / max(a.size, 1)) ** 2 * a.size
            assert abs(got[i, COL[name]] - value) <= tolerance, (i, name, got[i, COL[name]], value)
            if name in ("count", "min", "max", "zero_count"):  # exact on both paths
                assert reference[i, COL[name]] == value, (i, name)
    nan_row, inf_row = got[1], got[2]
    assert nan_row[COL["nan_count"]] == 1 and math.isnan(nan_row[COL["min"]]) and math.isnan(nan_row[COL["max"]])
    assert inf_row[COL["inf_count"]] == 1 and inf_row[COL["max"]] == math.inf and math.isnan(inf_row[COL["m2"]])
    assert got[7, COL["m2"]] == 0.0  # a constant tensor has no spread
    assert got[4, COL["sum"]] == pytest.approx(4096 * np.float64(np.float32(3e38)))  # no float32 overflow


def test_kernel_skips_only_the_columns_not_asked_for(kernel_on) -> None:
    """l1 and zero_count are computed only for a tensor that needs them (NaN otherwise); every
    other column is the same whatever was asked, to the bit."""
    g = torch.Generator().manual_seed(8)
    values = [torch.relu(torch.randn(300_001, generator=g)), torch.relu(torch.randn(70_000, generator=g, dtype=torch.float64))]
    full, _ = native.moments(values)
    base = frozenset({"count", "sum", "m2", "min", "max", "nan_count", "inf_count"})
    for extra in (frozenset(), frozenset({"l1"}), frozenset({"zero_count"}), frozenset({"l1", "zero_count"})):
        got, _ = native.moments(values, columns=[base | extra] * len(values))
        for j, name in enumerate(native.COLUMNS):
            if name in ("l1", "zero_count") and name not in extra:
                assert np.isnan(got[:, j]).all(), name
            else:
                np.testing.assert_array_equal(got[:, j], full[:, j], err_msg=name)
    assert full[0, native.COLUMNS.index("zero_count")] == float((values[0] == 0).sum())


def test_kernel_threads_and_the_single_tensor_path_give_the_same_bits(kernel_on) -> None:
    """Chunks are merged in a fixed order: any number of threads (PyTorch's OpenMP workers where
    the kernel shares them, else its own) gives the same row, and so does moments_one."""
    g = torch.Generator().manual_seed(9)
    values = [torch.randn(3_000_001, generator=g), torch.randn(500_000, generator=g, dtype=torch.float64)]
    one, _ = native.moments(values, threads=1)
    for threads in (2, 4):
        np.testing.assert_array_equal(native.moments(values, threads=threads)[0], one)
    for i, v in enumerate(values):
        row, sample = native.moments_one(v, 7, native.wants(frozenset(native.COLUMNS)))
        np.testing.assert_array_equal(row, one[i])
        assert torch.equal(sample, v[::7])
    assert native.moments_one(values[0], 0, 0)[1] is None
    assert isinstance(native.shares_torch_threads(), bool)


def test_a_build_without_openmp_uses_its_own_threads_and_agrees(kernel_on, monkeypatch, tmp_path) -> None:
    """Where PyTorch brings no libgomp (macOS, other threading backends) the kernel is built
    without OpenMP and starts its own threads: the same rows."""
    values = [torch.randn(2_500_000, generator=torch.Generator().manual_seed(2))]
    reference, _ = native.moments(values, threads=2)
    monkeypatch.setattr(native.build, "_torch_uses_libgomp", lambda: False)
    monkeypatch.setenv("TENSORLENS_CACHE", str(tmp_path))
    native.reset()
    assert native.available() and not native.shares_torch_threads()
    for threads in (1, 3):
        np.testing.assert_array_equal(native.moments(values, threads=threads)[0], reference)


def test_kernel_gathers_the_documented_strided_sample(kernel_on) -> None:
    values = [torch.randn(1_000_003), torch.randn(4096, dtype=torch.float64), torch.randn(10)]
    strides = [sample_stride(v.numel(), 4096, 512) for v in values]
    _, samples = native.moments(values, sample_strides=strides)
    for v, s, sample in zip(values, strides, samples, strict=True):
        assert torch.equal(sample, v[::s])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("clip", [False, True])
def test_kernel_bins_exactly_like_pytorch(kernel_on, dtype: torch.dtype, clip: bool) -> None:
    g = torch.Generator().manual_seed(11)
    samples = [(torch.randn(n, generator=g, dtype=torch.float64) * 10 ** e + c).to(dtype)
               for n, e, c in ((4096, 0, 0.0), (999, -6, 1.0), (5, 3, -7.0), (0, 0, 0.0), (4096, -30, 0.0))]
    low = torch.tensor([s.min().item() if s.numel() else math.nan for s in samples], dtype=torch.float64)
    high = torch.tensor([s.max().item() if s.numel() else math.nan for s in samples], dtype=torch.float64)
    if clip:  # a fixed range that cuts both tails
        low, high = low * 0.5, high * 0.5
    low, high = histogram_range(low, high, dtype)
    counts, scale, below, above = histogram_counts(samples, low, high, 37, clip=clip)
    found = native.histograms(samples, [1] * len(samples), low.double().numpy(), high.double().numpy(),
                              scale.double().numpy(), 37, clip)
    assert found is not None
    np.testing.assert_array_equal(found[0], counts.numpy())
    np.testing.assert_array_equal(found[1], below.numpy())
    np.testing.assert_array_equal(found[2], above.numpy())


@pytest.mark.parametrize("clip", [False, True])
def test_kernel_bins_a_range_that_rounds_to_a_point_like_pytorch(kernel_on, clip: bool) -> None:
    # HistogramConfig(range=(0.1, 0.1 + 1e-9)) is a valid range in float64 and a point in float32:
    # the scale is inf and (x - low) * scale is NaN at x == low. Both paths put it in bin 0. (The
    # kernel used to cast that NaN to an index, undefined in C; GCC's min/max happened to give 0.)
    low = torch.tensor([0.1], dtype=torch.float64).to(torch.float32)
    high = torch.tensor([0.1 + 1e-9], dtype=torch.float64).to(torch.float32)
    sample = torch.tensor([0.1, 0.1, 0.2, 0.05, 0.1 + 1e-9], dtype=torch.float32)
    counts, scale, below, above = histogram_counts([sample], low, high, 8, clip=clip)
    assert math.isinf(float(scale[0]))
    found = native.histograms([sample], [1], low.double().numpy(), high.double().numpy(), scale.double().numpy(), 8, clip)
    np.testing.assert_array_equal(found[0], counts.numpy())
    np.testing.assert_array_equal(found[1], below.numpy())
    np.testing.assert_array_equal(found[2], above.numpy())


def test_engine_histograms_match_numpy_with_the_kernel(kernel_on) -> None:
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(512, 512, generator=g), torch.randn(64, 32768, generator=g, dtype=torch.float64) * 1e-3]
    host = StepStatistics().compute([TensorJob(f"t/{i}", [t], ("min", "max"), HistogramConfig(bins=64)) for i, t in enumerate(tensors)])
    _record = host_record(host)
    _, histograms, _ = list(_record.scalars), list(_record.histograms), list(_record.tensors)
    for t, h in zip(tensors, histograms, strict=True):
        sample = t.reshape(-1)[:: sample_stride(t.numel(), 4096, t.shape[-1])]
        np.testing.assert_array_equal(h.counts, np.histogram(sample.double().numpy(), bins=h.edges)[0])
        assert h.sampled and h.count == sample.numel()


def test_falls_back_to_pytorch_when_disabled_or_unbuildable(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TENSORLENS_NATIVE", "0")
    native.reset()
    assert not native.available() and native.moments([torch.ones(3)]) is None
    monkeypatch.delenv("TENSORLENS_NATIVE")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TENSORLENS_CACHE", str(tmp_path / "cache"))
    native.reset()
    assert not native.available()
    values, _, _ = _stats(torch.tensor([1.0, 2.0, 4.0]))
    assert values == pytest.approx({"mean": 7 / 3, "std": float(np.std([1.0, 2.0, 4.0]))})
    native.reset()


def test_the_switches_are_read_at_every_call_however_they_are_set(kernel_on, monkeypatch) -> None:
    # library() looks at the environment's own dict first (see build._switched_off): every way of
    # changing os.environ must still reach it at the next call, with no reset
    from tensorlens.stats.native import build

    assert build.library() is not None
    monkeypatch.setenv("TENSORLENS_NATIVE", "0")
    assert build.library() is None
    monkeypatch.delenv("TENSORLENS_NATIVE")
    assert build.library() is not None
    os.environ["TENSORLENS_STATS_PATH"] = " Triton "
    try:
        assert build.library() is None
        os.environ.update(TENSORLENS_STATS_PATH="native")
        assert build.library() is not None
        os.environ["TENSORLENS_STATS_PATH"] = "torch"
        assert build.library() is None
    finally:
        os.environ.pop("TENSORLENS_STATS_PATH", None)
    assert build.library() is not None


def _stats(tensor: torch.Tensor):
    host = StepStatistics().compute([TensorJob("t", [tensor], ("mean", "std"))])
    _record = host_record(host)
    scalars, histograms, tensors = list(_record.scalars), list(_record.histograms), list(_record.tensors)
    return {e.stat: e.value for e in scalars}, histograms, tensors


def test_kernel_edges_are_bit_identical_to_numpy(kernel_on) -> None:
    from tensorlens.stats.edges import exact_edges_numpy

    rng = np.random.default_rng(0)
    for trial in range(300):
        dtype = np.float32 if trial % 2 == 0 else np.float64
        center = (rng.random(5) - 0.5) * 10.0 ** rng.integers(-8, 8, 5)
        spread = 10.0 ** rng.integers(-12, 4, 5)
        low = (center - spread).astype(dtype)
        high = np.maximum(low, (center + spread * rng.random(5)).astype(dtype))
        high = np.where(high <= low, np.nextafter(low, np.inf), high).astype(dtype)  # ranges of one ulp too
        bins = int(rng.integers(1, 200))
        scale = (bins / (high.astype(np.float64) - low.astype(np.float64))).astype(dtype)
        np.testing.assert_array_equal(native.edges(low, high, scale, bins, dtype), exact_edges_numpy(low, high, scale, bins, dtype))


# ----------------------------------------------------------------------------- where the kernel is loaded from

_EVIL_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *marker = getenv("TENSORLENS_TEST_MARKER");
    if (marker) { FILE *f = fopen(marker, "w"); if (f) { fputs("loaded", f); fclose(f); } }
}
int tl_moments(void) { return 0; }
"""


@pytest.fixture
def planted(kernel_on, monkeypatch, tmp_path):
    """``(file name of the kernel, a library that writes a marker file when it is loaded, marker)``."""
    import shutil
    import subprocess

    safe = tmp_path / "first-build"
    monkeypatch.setenv("TENSORLENS_CACHE", str(safe))
    native.reset()
    assert native.available()
    name = os.path.basename(native.build.library_path())
    source = tmp_path / "evil.c"
    source.write_text(_EVIL_SOURCE)
    evil = tmp_path / "evil.so"
    subprocess.run([native.build._compiler(), "-shared", "-fPIC", "-o", str(evil), str(source)], check=True)
    marker = tmp_path / "marker"
    monkeypatch.setenv("TENSORLENS_TEST_MARKER", str(marker))
    native.reset()
    yield name, evil, marker
    native.reset()
    shutil.rmtree(safe, ignore_errors=True)


def _mapped(path: str) -> bool:
    with open("/proc/self/maps", encoding="utf-8") as maps:
        return any(line.rstrip().endswith(path) for line in maps)


def _assert_kernel_works() -> None:
    values = [torch.randn(10_000, generator=torch.Generator().manual_seed(5), dtype=torch.float64)]
    rows, _ = native.moments(values)
    row, x = dict(zip(native.COLUMNS, rows[0].tolist(), strict=True)), values[0].numpy()
    assert row["count"] == x.size and row["min"] == x.min() and row["max"] == x.max()
    assert row["sum"] == pytest.approx(x.sum(), rel=1e-12)
    assert row["m2"] == pytest.approx(((x - x.mean()) ** 2).sum(), rel=1e-12)


def _assert_built_privately(cache, planted_file, evil, marker) -> None:
    """The kernel works, was not read from ``cache``, and its temporary folder is gone."""
    assert native.available()
    loaded = native.build.library_path()
    assert not loaded.startswith(str(cache) + os.sep)
    assert not os.path.exists(os.path.dirname(loaded))  # the private folder was removed once loaded
    assert not marker.exists() and not _mapped(str(planted_file))
    assert planted_file.read_bytes() == evil.read_bytes()  # left alone
    _assert_kernel_works()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps")
def test_a_cache_others_can_write_is_never_loaded(planted, monkeypatch, tmp_path) -> None:
    name, evil, marker = planted
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    shutil.copy(evil, shared / name)
    monkeypatch.setenv("TENSORLENS_CACHE", str(shared))
    with pytest.warns(UserWarning, match=r"not loading the compiled kernel from .*shared: it is writable by group or others"):
        native.reset()
        native.available()
    _assert_built_privately(shared, shared / name, evil, marker)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps")
@pytest.mark.parametrize("how", ["group-writable", "another owner", "symlink", "parent writable by others"])
def test_a_cache_folder_this_user_does_not_hold_alone_is_never_loaded(planted, monkeypatch, tmp_path, how) -> None:
    name, evil, marker = planted
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    if how == "group-writable":
        os.chmod(cache, 0o770)
    elif how == "another owner":
        if os.geteuid() != 0:
            pytest.skip("only root can give a folder to another user")
        os.chown(cache, 65534, 65534)
    elif how == "symlink":
        target, cache = cache, tmp_path / "link"
        cache.symlink_to(target)
    else:
        parent = tmp_path / "open"
        parent.mkdir()
        os.chmod(parent, 0o777)  # no sticky bit: anyone may rename the cache and put another there
        cache = parent / "cache"
        cache.mkdir(mode=0o700)
    shutil.copy(evil, cache / name)
    monkeypatch.setenv("TENSORLENS_CACHE", str(cache))
    with pytest.warns(UserWarning, match="not loading the compiled kernel from"):
        native.reset()
        native.available()
    _assert_built_privately(cache, cache / name, evil, marker)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps")
@pytest.mark.parametrize("how", ["world-writable file", "symlink to another file"])
def test_a_planted_library_in_a_private_cache_is_rebuilt_not_loaded(planted, monkeypatch, tmp_path, how) -> None:
    import warnings

    name, evil, marker = planted
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    if how == "world-writable file":
        shutil.copy(evil, cache / name)
        os.chmod(cache / name, 0o666)
    else:
        (cache / name).symlink_to(evil)
    monkeypatch.setenv("TENSORLENS_CACHE", str(cache))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a private cache needs no warning
        native.reset()
        assert native.available()
    assert native.build.library_path() == str(cache / name)
    info = os.lstat(cache / name)
    assert stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022
    assert not marker.exists() and not _mapped(str(evil))
    _assert_kernel_works()


def test_a_missing_cache_is_created_private_and_reused(kernel_on, monkeypatch, tmp_path) -> None:
    cache = tmp_path / "new" / "cache"
    monkeypatch.setenv("TENSORLENS_CACHE", str(cache))
    native.reset()
    assert native.available()
    first = native.build.library_path()
    assert os.path.dirname(first) == str(cache) and stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    built_at = os.stat(first).st_mtime_ns
    native.reset()
    assert native.available() and native.build.library_path() == first
    assert os.stat(first).st_mtime_ns == built_at  # loaded again, not rebuilt
    _assert_kernel_works()
