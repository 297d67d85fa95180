"""Training dynamics under ``torch.distributed``: two gloo processes on CPU (DDP with gradient
accumulation, FSDP2, ranks calling different modules), each statistic equal to the one-process
value on the concatenated batch.

The launcher follows ``tests/test_distributed.py``: this file runs as a script on each rank
(``python test_dynamics_distributed.py <rank> <world> <port> <out>``), pickles what its memory
backend received, and the tests compare with numpy references computed here in one process.

The loss is a sum over the local rows. DDP and FSDP2 average gradients over ranks, so parameter
gradients are those of one process with ``loss = sum over the whole batch / WORLD``; a rank's
gradient w.r.t. a module output is ``WORLD`` times that process's (each rank's backward runs on
its own loss): the reference multiplies per-sample gradient norms by ``WORLD``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens.config import DynamicsConfig, HistogramConfig, SaveConfig

WORLD = 2
DEADLINE_S = 180
ROWS = 4  # per rank and micro-batch
MICRO = 2
STEPS = 4
LEAVES = ("0", "1", "2", "3", "4")

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo"
)


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    with torch.no_grad():
        model[0].bias[:3] = -100.0  # dead units
        model[2].weight.mul_(4.0)  # saturating tanh units
        model[2].bias[:2] = 5.0
    return model


def _global_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    rows = ROWS * WORLD
    return torch.randn(rows, 6, generator=g, dtype=torch.float64), torch.randn(rows, 3, generator=g, dtype=torch.float64)


def _local(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    return tensor[rank * ROWS : (rank + 1) * ROWS]


def _records(mem: tl.MemoryBackend) -> list[dict[str, Any]]:
    return [
        {"step": r.step, "mode": str(r.mode), "mode_step": r.mode_step, "scalars": r.scalar_dict(),
         "histograms": {h.tensor: (h.counts.copy(), h.edges.copy()) for h in r.histograms}}
        for r in mem.records
    ]


def _hook(out: Path, name: str, mem: tl.MemoryBackend, **config: Any) -> tl.Hook:
    return tl.Hook(
        out_dir=out / name, save_config=SaveConfig(save_interval=2), include_collections=["dynamics"],
        histogram_config=HistogramConfig(bins=8), backends=[mem],
        dynamics_config=DynamicsConfig(distance_from_init=True, **config),
    )


# ----------------------------------------------------------------------------- worker side


def _ddp_part(rank: int, out: Path) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    model = _model()
    ddp = DistributedDataParallel(model)
    mem = tl.MemoryBackend()
    hook = _hook(out, "ddp", mem)
    hook.register_module(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        for micro in range(MICRO):
            x, y = _global_batch(step, micro)
            with ddp.no_sync() if micro < MICRO - 1 else contextlib.nullcontext():
                (ddp(_local(x, rank)) - _local(y, rank)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    hook.end_epoch()
    hook.close()
    return {"records": _records(mem)}


def _fsdp_part(rank: int, out: Path) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    mem = tl.MemoryBackend()
    hook = _hook(out, "fsdp", mem)
    hook.register_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = _global_batch(step, 0)
        (model(_local(x, rank)) - _local(y, rank)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    hook.close()
    sharded = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
    return {"records": _records(mem), "sharded": sharded}


class _Uneven(nn.Module):
    """Rank 0 calls ``aux``; rank 1 calls ``extra`` twice; the batches differ in size."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.trunk = nn.Linear(4, 6).double()
        self.aux = nn.Linear(6, 2).double()
        self.extra = nn.Linear(6, 3).double()

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        out = self.extra(h).sum()
        return out + (self.aux(h).sum() if rank == 0 else self.extra(h[:2]).sum())


def _uneven_x(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3 + 2 * rank, 4, generator=torch.Generator().manual_seed(10 * step + rank), dtype=torch.float64)


def _uneven_part(rank: int, out: Path) -> dict[str, Any]:
    model = _Uneven()
    mem = tl.MemoryBackend()
    hook = _hook(out, "uneven", mem, parameters=False)
    hook.register_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        model(_uneven_x(step, rank), rank).backward()
        optimizer.step()
        optimizer.zero_grad()
    hook.close()
    return {"records": _records(mem)}


def _worker_main(argv: list[str]) -> None:
    rank, world, port, out = int(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        result = {"ddp": _ddp_part(rank, out), "fsdp": _fsdp_part(rank, out), "uneven": _uneven_part(rank, out)}
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    with open(out / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


# ----------------------------------------------------------------------------- launcher


def _launch(out: Path) -> list[dict[str, Any]]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    logs = [out / f"rank{rank}.log" for rank in range(WORLD)]
    procs = []
    for rank in range(WORLD):
        with open(logs[rank], "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(rank), str(WORLD), str(port), str(out)],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out,
            ))
    deadline = time.monotonic() + DEADLINE_S
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        hung = [proc for proc in procs if proc.poll() is None]
        for proc in hung:
            proc.kill()
        for proc in procs:
            proc.wait()
    text = "\n".join(f"--- rank {r} ---\n{logs[r].read_text()[-4000:]}" for r in range(WORLD))
    if hung or any(proc.returncode != 0 for proc in procs):
        pytest.fail(f"ranks hung or failed\n{text}")
    return [pickle.loads((out / f"rank{rank}.pkl").read_bytes()) for rank in range(WORLD)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch(tmp_path_factory.mktemp("dynamics_dist"))


# ----------------------------------------------------------------------------- references


def _reference(micro_batches: int) -> list[dict[str, Any]]:
    """One process, the concatenated batch, loss = sum / WORLD: what the ranks must report."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    kept: dict[str, list[torch.Tensor]] = {}

    def keep(name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            output.retain_grad()
            kept.setdefault(name, []).append(output)

        return hook

    for name in LEAVES:
        model.get_submodule(name).register_forward_hook(keep(name))
    out = []
    for step in range(STEPS):
        kept.clear()
        for micro in range(micro_batches):
            x, y = _global_batch(step, micro)
            ((model(x) - y).square().sum() / WORLD).backward()
        rec = {
            "before": {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
            "grads": {n: p.grad.numpy().copy() for n, p in model.named_parameters()},
            "outputs": {n: torch.cat([t.detach() for t in v]).numpy() for n, v in kept.items()},
            "output_grads": {n: torch.cat([t.grad for t in v]).numpy() * WORLD for n, v in kept.items()},
            "clip": torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item(),
        }
        optimizer.step()
        rec["after"] = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        optimizer.zero_grad()
        out.append(rec)
    return out


def _norm(a: np.ndarray) -> float:
    return float(np.linalg.norm(a.ravel()))


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a.ravel(), b.ravel()) / (_norm(a) * _norm(b)))


def _check_parameters(records: list[dict[str, Any]], ref: list[dict[str, Any]]) -> None:
    saved = [r for r in records if r["mode"] == "train"]
    assert [r["step"] for r in saved] == [0, 2]
    for record in saved:
        t, s = record["step"], record["scalars"]
        now = ref[t]
        for name in now["grads"]:
            g, p = now["grads"][name], now["before"][name]
            d = now["after"][name] - p
            key = f"dynamics/{name}"
            assert s[f"{key}/update_l2"] == pytest.approx(_norm(d), rel=1e-9)
            assert s[f"{key}/update_ratio"] == pytest.approx(_norm(d) / _norm(p), rel=1e-9)
            assert s[f"{key}/grad_to_weight"] == pytest.approx(_norm(g) / _norm(p), rel=1e-9)
            assert s[f"{key}/distance_from_init"] == pytest.approx(_norm(p - ref[0]["before"][name]), rel=1e-9, abs=1e-14)
            if t:
                prev = ref[t - 1]
                assert s[f"{key}/grad_cosine"] == pytest.approx(_cos(g, prev["grads"][name]), rel=1e-9, abs=1e-12)
                assert s[f"{key}/update_cosine"] == pytest.approx(
                    _cos(d, prev["after"][name] - prev["before"][name]), rel=1e-9, abs=1e-12)
        assert s["dynamics/global/grad_norm"] == pytest.approx(now["clip"], rel=1e-10)
        befores = np.concatenate([v.ravel() for v in now["before"].values()])
        assert s["dynamics/global/weight_norm"] == pytest.approx(_norm(befores), rel=1e-10)


def _check_modules(records: list[dict[str, Any]], ref: list[dict[str, Any]]) -> None:
    for record in [r for r in records if r["mode"] == "train"]:
        s, now = record["scalars"], ref[record["step"]]
        for name in LEAVES:
            values = now["outputs"][name]
            active = (np.abs(values) > 0).mean(axis=0)
            assert s[f"activations/{name}/dead_fraction"] == pytest.approx(float((active == 0).mean()))
            assert s[f"activations/{name}/active_rate_mean"] == pytest.approx(float(active.mean()), rel=1e-12)
            counts, edges = record["histograms"][f"activations/{name}/unit_active_rate"]
            np.testing.assert_array_equal(counts, np.histogram(active, bins=8, range=(0.0, 1.0))[0])
            norms = np.linalg.norm(values, axis=1)
            for stat, want in (("numel", norms.size), ("mean", norms.mean()), ("std", norms.std()), ("max", norms.max())):
                assert s[f"activations/{name}/sample_norm/{stat}"] == pytest.approx(want, rel=1e-10)
            grads = np.linalg.norm(now["output_grads"][name], axis=1)
            for stat, want in (("numel", grads.size), ("mean", grads.mean()), ("min", grads.min())):
                assert s[f"activation_gradients/{name}/sample_norm/{stat}"] == pytest.approx(want, rel=1e-9)
        tanh = now["outputs"]["3"]
        assert s["activations/3/saturation_fraction"] == pytest.approx(float((np.abs(tanh) >= 0.99).mean()))
        assert s["activations/1/dead_fraction"] >= 3 / 16


def test_ranks_agree(results: list[dict[str, Any]]) -> None:
    for part in ("ddp", "fsdp", "uneven"):
        # under include_workers="reduce" only rank 0 records; every rank computed the same
        assert results[1][part]["records"] == []
        assert results[0][part]["records"]


def test_ddp_with_accumulation_equals_one_process_on_the_whole_batch(results: list[dict[str, Any]]) -> None:
    ref = _reference(MICRO)
    records = results[0]["ddp"]["records"]
    _check_parameters(records, ref)
    _check_modules(records, ref)
    # the epoch aggregates are those of the merged records
    (epoch,) = [r for r in records if r["mode"] == "epoch"]
    train = [r for r in records if r["mode"] == "train"]
    values = [r["scalars"]["dynamics/global/grad_norm"] for r in train]
    assert epoch["scalars"]["epochs/dynamics/global/grad_norm_mean"] == pytest.approx(np.mean(values), rel=1e-12)
    assert epoch["scalars"]["epochs/dynamics/global/grad_norm_std"] == pytest.approx(np.std(values), rel=1e-9)


def test_fsdp2_sharded_dynamics_equal_the_unsharded_model(results: list[dict[str, Any]]) -> None:
    assert results[0]["fsdp"]["sharded"]["0.weight"] == (8, 6)  # really sharded: 16 rows over two ranks
    ref = _reference(1)
    _check_parameters(results[0]["fsdp"]["records"], ref)
    _check_modules(results[0]["fsdp"]["records"], ref)


def test_ranks_calling_different_modules_merge_over_the_ranks_that_called_them(results: list[dict[str, Any]]) -> None:
    model = _Uneven()
    records = results[0]["uneven"]["records"]
    assert [r["step"] for r in records] == [0, 2]
    for record in records:
        s, step = record["scalars"], record["step"]
        with torch.no_grad():
            h = [torch.relu(model.trunk(_uneven_x(step, rank))) for rank in range(WORLD)]
            aux = model.aux(h[0]).numpy()  # rank 0 only
            extra = torch.cat([model.extra(h[0]), model.extra(h[1]), model.extra(h[1][:2])]).numpy()
        for name, values in (("aux", aux), ("extra", extra)):
            active = (np.abs(values) > 0).mean(axis=0)
            assert s[f"activations/{name}/active_rate_mean"] == pytest.approx(float(active.mean()))
            assert s[f"activations/{name}/sample_norm/numel"] == values.shape[0]
            assert s[f"activations/{name}/sample_norm/mean"] == pytest.approx(np.linalg.norm(values, axis=1).mean(), rel=1e-12)
        assert not any(k.startswith("dynamics/") for k in s)  # parameters=False
        # the model is updated on each rank apart (no DDP): only step 0 matches the fresh model
        if step == 0:
            break


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
