"""Choosing the statistics path (``TENSORLENS_STATS_PATH``), and falling back cleanly where the
chosen one cannot run: no triton, no GPU (and no interpreter), a dtype the kernels do not read.
The path is recorded in the run metadata and shown by ``tensorlens show``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import tensorlens as tl
from tensorlens.compute.jobs import TensorJob
from tensorlens.compute.step import StepStatistics
from tensorlens.dispatch.assemble import host_record
from tensorlens.stats import native, path

CUDA = torch.device("cuda")  # a device object only: nothing here needs a GPU
STATS = ("min", "max", "mean", "std", "l2", "zero_fraction", "nan_count")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ("TENSORLENS_STATS_PATH", "TENSORLENS_NATIVE"):
        monkeypatch.delenv(name, raising=False)
    path.reset()
    native.reset()
    yield monkeypatch
    monkeypatch.undo()
    path.reset()
    native.reset()


def tensorlens_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("tensorlens")]


def step(tensors: list[torch.Tensor], engine: StepStatistics | None = None):
    engine = engine or StepStatistics()
    record = host_record(engine.compute([TensorJob(f"t/{i}", [t], STATS) for i, t in enumerate(tensors)]))
    return record, engine


def assert_numpy(record, tensors: list[torch.Tensor]) -> None:
    for i, t in enumerate(tensors):
        a = t.double().numpy()
        assert record.scalar(f"t/{i}", "mean") == pytest.approx(a.mean(), rel=1e-6)
        assert record.scalar(f"t/{i}", "std") == pytest.approx(a.std(), rel=1e-5)
        assert (record.scalar(f"t/{i}", "min"), record.scalar(f"t/{i}", "max")) == (a.min(), a.max())


def test_auto_takes_the_compiled_kernel_on_a_cpu_and_triton_on_a_gpu(clean) -> None:
    # as outside the interpreter (the variable itself stays: triton reads it once, when first imported)
    clean.setattr(path, "interpreting", lambda: False)
    assert path.path_for(torch.device("cpu")) == ("native" if native.available() else "torch")
    assert path.path_for(torch.device("cpu"), sync_free=True) == "torch"  # a CPU standing in for a GPU
    assert path.path_for(CUDA) == ("triton" if path.triton_importable() else "torch")
    clean.setattr(path, "triton_importable", lambda: False)
    assert path.path_for(CUDA) == "torch"


def test_the_old_switch_and_an_explicit_torch_turn_the_kernel_off(clean) -> None:
    clean.setenv("TENSORLENS_NATIVE", "0")
    assert path.path_for(torch.device("cpu")) == "torch" and not native.available()
    clean.delenv("TENSORLENS_NATIVE")
    for chosen in ("torch", "triton"):
        clean.setenv("TENSORLENS_STATS_PATH", chosen)
        assert not native.available()
    clean.setenv("TENSORLENS_STATS_PATH", "torch")
    assert path.path_for(CUDA) == "torch"


def test_an_unknown_value_warns_once_and_means_auto(clean) -> None:
    clean.setenv("TENSORLENS_STATS_PATH", "cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert path.requested() == "auto"
    assert tensorlens_warnings(caught) == [
        "tensorlens: TENSORLENS_STATS_PATH='cuda' is not one of auto, native, triton, torch: using auto"
    ]


def test_native_asked_for_gpu_tensors_says_it_reads_cpu_tensors_only(clean) -> None:
    clean.setenv("TENSORLENS_STATS_PATH", "native")
    clean.setattr(path, "interpreting", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert path.path_for(CUDA) == ("triton" if path.triton_importable() else "torch")
        path.path_for(CUDA)
    assert len(tensorlens_warnings(caught)) == 1 and "reads CPU tensors only" in tensorlens_warnings(caught)[0]


def test_triton_without_a_gpu_or_the_interpreter_falls_back_with_one_warning(clean) -> None:
    """TENSORLENS_STATS_PATH=triton on a machine without a GPU: the CPU tensors take PyTorch ops,
    one warning says why, and the statistics are numpy's."""
    clean.setenv("TENSORLENS_STATS_PATH", "triton")
    clean.setattr(path, "interpreting", lambda: False)
    tensors = [torch.randn(1000), torch.randn(7, dtype=torch.float64)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = None
        for _ in range(2):
            record, engine = step(tensors, engine)
    assert engine._plan.path == "torch" and not engine._plan.triton
    found = tensorlens_warnings(caught)
    assert len(found) == 1 and "TENSORLENS_STATS_PATH=triton cannot run on cpu tensors" in found[0]
    assert_numpy(record, tensors)


def test_without_triton_the_core_imports_and_falls_back_cleanly(tmp_path) -> None:
    """Where triton cannot be imported at all, tensorlens imports and records as before; asking
    for triton gives PyTorch ops and one warning that says to install it."""
    script = textwrap.dedent("""
        import sys, warnings
        sys.modules["triton"] = None  # import triton now fails, as where it is not installed
        import numpy as np, torch
        import tensorlens as tl
        from tensorlens.compute.jobs import TensorJob
        from tensorlens.compute.step import StepStatistics
        from tensorlens.dispatch.assemble import host_record
        from tensorlens.stats import path
        assert not path.triton_importable() and path.path_for(torch.device("cuda")) == "torch"
        x = torch.randn(5000)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = StepStatistics()
            for _ in range(2):
                record = host_record(engine.compute([TensorJob("x", [x], ("mean", "std"))]))
        found = [str(w.message) for w in caught if str(w.message).startswith("tensorlens")]
        assert len(found) == 1 and "triton is not installed" in found[0], found
        assert engine._plan.path == "torch"
        assert abs(record.scalar("x", "mean") - x.double().mean().item()) < 1e-6
    """)
    env = {**os.environ, "TENSORLENS_STATS_PATH": "triton", "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_importing_tensorlens_does_not_import_triton(tmp_path) -> None:
    script = (
        "import sys, torch, tensorlens as tl\n"
        "from tensorlens.compute.jobs import TensorJob\n"
        "from tensorlens.compute.step import StepStatistics\n"
        "StepStatistics().compute([TensorJob('x', [torch.randn(10)], ('mean',))])\n"
        "assert 'triton' not in sys.modules, 'triton imported by the core'\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TENSORLENS_STATS_PATH", "TRITON_INTERPRET")}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_unsupported_dtype_falls_back_per_tensor_with_one_warning(clean) -> None:
    if not (path.triton_importable() and path.interpreting()):
        pytest.skip(
            "needs the Triton path on CPU tensors: triton installed and TRITON_INTERPRET=1 (as .ci/run runs it)"
        )
    clean.setenv("TENSORLENS_STATS_PATH", "triton")
    tensors = [torch.randn(300), torch.arange(50), torch.randn(20, dtype=torch.float64), torch.arange(9) * 3]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = None
        for _ in range(2):
            record, engine = step(tensors, engine)
    assert engine._plan.triton == [0, 2] and engine._plan.torch == [1, 3]  # each tensor on its own
    found = tensorlens_warnings(caught)
    assert len(found) == 1 and "'t/1' (int64)" in found[0] and "use PyTorch ops" in found[0], found
    assert_numpy(record, tensors)


@pytest.mark.parametrize("chosen", ["torch", None])
def test_the_run_metadata_and_show_name_the_path(chosen: str | None, clean, tmp_path) -> None:
    if chosen is not None:
        clean.setenv("TENSORLENS_STATS_PATH", chosen)
    expected = chosen or path.path_for(torch.device("cpu"))
    model = torch.nn.Linear(4, 3)
    hook = tl.watch(model, save_interval=1, backends=["local"], out_dir=tmp_path / "run")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    hook.close()
    with tl.open_run(hook.run_dir) as run:
        assert run.metadata()["config"]["stats_path"] == expected
    done = subprocess.run(
        [sys.executable, "-m", "tensorlens", "show", str(hook.run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].endswith(f"statistics: {expected}")


def test_describe_names_each_device_when_they_differ(clean) -> None:
    clean.setenv("TENSORLENS_STATS_PATH", "torch")
    assert path.describe(["cpu"]) == "torch" and path.describe([]) == "torch"
    clean.delenv("TENSORLENS_STATS_PATH")
    clean.setattr(path, "triton_importable", lambda: False)
    clean.setenv("TENSORLENS_NATIVE", "0")
    assert path.describe(["cpu", "cuda:0"]) == "torch"
    clean.delenv("TENSORLENS_NATIVE")
    if native.available():
        assert path.describe(["cuda:0", "cpu"]) == "cpu=native,cuda:0=torch"
    assert np.all([p in path.PATHS for p in ("native", "triton", "torch")])


COMPILE = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tensorlens.stats.triton import kernels as k
from tensorlens.stats.triton.rows import COL, PARTIALS

def build(fn, signature, constants):
    signature = {**signature, **{name: "constexpr" for name in constants}}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants), target=GPUTarget("cuda", 90, 32))
    assert ".entry" in compiled.asm["ptx"]

table = {"addresses": "*i64", "lengths": "*i64"}
for dtype, rows, cols in ((tl.bfloat16, 256, 16), (tl.float32, 1, 4096), (tl.float64, 8, 512)):
    build(k.item_partials, {**table, "out": "*fp64", "n_items": "i32"},
          {"ROWS": rows, "COLS": cols, "DTYPE": dtype, "ACC": tl.float64 if dtype == tl.float64 else tl.float32,
           "WANT_ABS": True, "WANT_ZEROS": True})
names = {"COUNT": "count", "SUM": "sum", "SUMSQ": "sumsq", "M2": "m2", "L1": "l1", "MIN": "min", "MAX": "max",
         "ABS_MIN": "abs_min", "ABS_M2": "abs_m2", "NAN": "nan_count", "INF": "inf_count", "ZERO": "zero_count"}
build(k.merge_items, {"items": "*fp64", "first": "*i64", "counts": "*i64", "out": "*fp64", "n_tensors": "i32"},
      {**{f"C_{short}": COL[name] for short, name in names.items()}, "P": len(PARTIALS), "ROWS": 512})
samples = {"addresses": "*i64", "strides": "*i64", "lengths": "*i64"}
build(k.sample_ranges, {**samples, "low_out": "*fp64", "high_out": "*fp64", "n_samples": "i32"},
      {"ROWS": 64, "COLS": 64, "DTYPE": tl.float32, "ACC": tl.float32})
build(k.bin_samples, {**samples, "low": "*fp32", "high": "*fp32", "scale": "*fp32", "counts": "*i64", "below": "*i64",
                      "above": "*i64", "n_samples": "i32"},
      {"BINS": 64, "CLIP": True, "ROWS": 1, "COLS": 4096, "DTYPE": tl.bfloat16, "ACC": tl.float32})
print("compiled")
"""


def test_the_kernels_compile_for_a_gpu_without_one(tmp_path) -> None:
    """The interpreter runs Python, not the compiler: each kernel is also compiled to PTX for an
    sm_90 GPU (an H100) with the ptxas triton brings, which needs no GPU."""
    if not (path.triton_importable() and path.interpreting()):
        pytest.skip(
            "compiled once per CI run, in the Triton session: triton installed and TRITON_INTERPRET=1 (as .ci/run does)"
        )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run(
        [sys.executable, "-c", COMPILE], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert done.returncode == 0 and "compiled" in done.stdout, done.stdout + done.stderr[-4000:]
