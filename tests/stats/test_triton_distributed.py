"""The Triton path under ``torch.distributed``: two CPU processes with gloo, each with its own piece
of partitioned tensors (and a replicated one), merged exactly across ranks as on the other paths.

Each rank computes the step with ``TENSORLENS_STATS_PATH=triton`` (Triton's interpreter) and with
``torch``; the test checks that the ranks agree to the bit, that the merged statistics are numpy's
of the concatenation, and that the histograms equal PyTorch ops' to the bit. Run as a script, this
file is one rank.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

WORLD = 2
STATS = (
    "min",
    "max",
    "mean",
    "std",
    "sum",
    "l1",
    "l2",
    "abs_min",
    "abs_std",
    "zero_fraction",
    "nan_count",
    "inf_count",
    "numel",
)


def _data() -> dict[str, tuple[list[np.ndarray | None], bool, dict[str, Any]]]:
    """name -> (piece per rank (None: the rank lacks it), partitioned, histogram settings)."""
    rng = np.random.default_rng(11)
    act1 = rng.normal(size=70_001)
    act1[[5, 60_000]] = [np.nan, np.inf]  # rank 1 only: the ranks must agree on the finite range
    replicated = rng.normal(size=300)
    return {
        "act": ([rng.normal(size=5000) * 3, act1], True, {"bins": 16}),
        "act32": (
            [rng.normal(size=90).astype(np.float32), rng.normal(size=4000).astype(np.float32)],
            True,
            {"bins": 8},
        ),
        "zeros": ([np.array([0.0, 1.0, 0.0]), np.array([0.0, -2.0])], True, {"bins": 4}),
        "replicated": ([replicated, replicated], False, {"bins": 8}),
        "only_rank1": ([None, rng.normal(size=600)], True, {"bins": 8}),
        "fixed": ([rng.normal(size=1000) * 2, rng.normal(size=500) * 2], True, {"bins": 4, "range": (-1.0, 1.0)}),
    }


def _rank_part(rank: int) -> dict[str, Any]:
    from tensorlens.compute.distributed import CollectiveReducer
    from tensorlens.compute.jobs import TensorJob
    from tensorlens.compute.step import StepStatistics
    from tensorlens.config import HistogramConfig
    from tensorlens.dispatch.assemble import host_record

    out = {}
    for chosen in ("triton", "torch"):
        os.environ["TENSORLENS_STATS_PATH"] = chosen
        reducer = CollectiveReducer()
        jobs = [
            TensorJob(name, [torch.from_numpy(pieces[rank])], STATS, HistogramConfig(**hist), partitioned=partitioned)
            for name, (pieces, partitioned, hist) in _data().items()
            if pieces[rank] is not None
        ]
        engine = StepStatistics()
        record = host_record(engine.compute(reducer.agree_jobs(jobs), reducer))
        out[chosen] = {
            "path": engine._plan.path,
            "on_triton": len(engine._plan.triton),
            "scalars": {
                f"{t}/{s}": v for (t, s), v in zip(record.scalar_names, record.scalar_values.tolist(), strict=True)
            },
            "histograms": {
                h.tensor: {"counts": h.counts, "edges": h.edges, "underflow": h.underflow, "overflow": h.overflow}
                for h in record.histograms
            },
        }
    return out


def _worker_main(argv: list[str]) -> None:
    rank, port, out = int(argv[0]), int(argv[1]), Path(argv[2])
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        result = _rank_part(rank)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    with open(out / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tensorlens.stats import path

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    if not (path.triton_importable() and path.interpreting()):
        pytest.skip(
            "needs the Triton path on CPU tensors: triton installed and TRITON_INTERPRET=1 (as .ci/run runs it)"
        )
    out = tmp_path_factory.mktemp("triton-ddp")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(rank), str(port), str(out)],
            env=env,
            cwd=out,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    logs = [proc.communicate(timeout=300)[0] for proc in procs]
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log[-4000:]
    return [pickle.loads((out / f"rank{rank}.pkl").read_bytes()) for rank in range(WORLD)]


def test_the_ranks_agree_to_the_bit_on_the_triton_path(results) -> None:
    first, second = results[0]["triton"], results[1]["triton"]
    assert first["path"] == "triton" and first["on_triton"] >= 5
    assert first["scalars"].keys() == second["scalars"].keys()
    np.testing.assert_array_equal(list(first["scalars"].values()), list(second["scalars"].values()))
    for name, h in first["histograms"].items():
        np.testing.assert_array_equal(h["counts"], second["histograms"][name]["counts"])
        np.testing.assert_array_equal(h["edges"], second["histograms"][name]["edges"])


def test_merged_statistics_are_numpys_of_the_concatenation(results) -> None:
    scalars = results[0]["triton"]["scalars"]
    for name, (pieces, partitioned, _) in _data().items():
        whole = np.concatenate([p.astype(np.float64) for p in pieces if p is not None]) if partitioned else pieces[0]
        with np.errstate(all="ignore"):
            expected = {
                "min": whole.min(),
                "max": whole.max(),
                "mean": whole.mean(),
                "std": whole.std(),
                "sum": whole.sum(),
                "l1": np.abs(whole).sum(),
                "l2": np.sqrt((whole * whole).sum()),
                "abs_min": np.abs(whole).min(),
                "abs_std": np.abs(whole).std(),
                "zero_fraction": (whole == 0).mean(),
                "nan_count": float(np.isnan(whole).sum()),
                "inf_count": float(np.isinf(whole).sum()),
                "numel": whole.size,
            }
        rel = 1e-5 if name == "act32" else 1e-9
        for stat, want in expected.items():
            np.testing.assert_allclose(
                scalars[f"{name}/{stat}"], want, rtol=rel, atol=1e-12, equal_nan=True, err_msg=f"{name}/{stat}"
            )


def test_histograms_equal_pytorch_ops_to_the_bit(results) -> None:
    triton, reference = results[0]["triton"]["histograms"], results[0]["torch"]["histograms"]
    assert triton.keys() == reference.keys()
    for name in triton:
        for field in ("counts", "edges", "underflow", "overflow"):
            np.testing.assert_array_equal(triton[name][field], reference[name][field], err_msg=f"{name} {field}")
    fixed = np.concatenate(_data()["fixed"][0])
    np.testing.assert_array_equal(triton["fixed"]["counts"], np.histogram(fixed, bins=np.linspace(-1.0, 1.0, 5))[0])
    assert triton["fixed"]["underflow"] == (fixed < -1).sum() and triton["fixed"]["overflow"] == (fixed > 1).sum()


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
