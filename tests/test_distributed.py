"""tensorlens under ``torch.distributed``: real processes on CPU with gloo.

Each scenario starts two processes running this file as a script (``python test_distributed.py
<scenario> <rank> <world> <port> <out>``) on a free port of 127.0.0.1; they save what they
recorded, and the tests compare it with a numpy reference computed here, in one process, on the
concatenated global batch. A hang fails the test: the processes have a deadline and the gloo
collectives a timeout, and every process is killed when the deadline passes.
"""

from __future__ import annotations

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
from tensorlens.config import HistogramConfig, ReductionConfig, SaveConfig
from tensorlens.dispatch.assemble import host_record
from tensorlens.stats.histogram import reject_outliers

WORLD = 2
DEADLINE_S = 150  # for a whole scenario, start-up of both interpreters included
COLLECTIVE_TIMEOUT_S = 60  # a collective that waits longer raises instead of hanging

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


# ----------------------------------------------------------------------------- shared data


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).double()


def _fsdp_model(seed: int = 1) -> nn.Sequential:
    # 5 output rows: FSDP2 shards them unevenly (3 + 2) across two ranks
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).double()


def _batch(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step; rank r trains on rows [r * rows / 2, (r + 1) * rows / 2)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 6, generator=g, dtype=torch.float64), torch.randn(rows, 3, generator=g, dtype=torch.float64)


def _local(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    half = tensor.shape[0] // WORLD
    return tensor[rank * half : (rank + 1) * half]


HIST = HistogramConfig(bins=16)
ENGINE_STATS = ReductionConfig(
    reductions=("min", "max", "mean", "std", "sum", "median"), norms=("l1", "l2"), counts=("zero_fraction",)
).stat_names()


def _engine_data() -> dict[str, tuple[list[np.ndarray | None], bool, HistogramConfig]]:
    """name -> (piece per rank (None: the rank lacks the tensor), partitioned, histogram config)."""
    rng = np.random.default_rng(7)
    act0, act1 = rng.normal(size=5), rng.normal(size=7)
    act1[2], act1[4] = np.nan, np.inf  # rank 1 only: the NaN/Inf pass must agree on edges
    replicated = rng.normal(size=6)
    replicated_nan = replicated.copy()
    replicated_nan[1] = np.nan
    return {
        "act": ([act0, act1], True, HistogramConfig(bins=8)),
        "act32": ([rng.normal(size=9).astype(np.float32), rng.normal(size=4).astype(np.float32)], True, HistogramConfig(bins=8)),
        "zeros": ([np.array([0.0, 1.0, 0.0]), np.array([0.0, -2.0])], True, HistogramConfig(bins=4)),
        "replicated": ([replicated, replicated], False, HistogramConfig(bins=8)),
        "replicated_nan": ([replicated_nan, replicated_nan], False, HistogramConfig(bins=8)),
        "only_rank1": ([None, rng.normal(size=6)], True, HistogramConfig(bins=8)),
        "fixed": ([rng.normal(size=10) * 2, rng.normal(size=5) * 2], True, HistogramConfig(bins=4, range=(-1.0, 1.0))),
        "outliers": ([rng.normal(size=20), rng.normal(size=10) * 3], True, HistogramConfig(bins=8, reject_outliers=0.2)),
    }


# ----------------------------------------------------------------------------- worker side


def _records(mem: tl.MemoryBackend) -> list[dict[str, Any]]:
    return [
        {
            "step": r.step,
            "mode": str(r.mode),
            "mode_step": r.mode_step,
            "worker": r.worker,
            "scalars": r.scalar_dict(),
            "histograms": {
                h.tensor: {"counts": h.counts, "edges": h.edges, "count": h.count, "nan": h.nan_count, "inf": h.inf_count,
                           "rejected": h.rejected, "underflow": h.underflow, "overflow": h.overflow}
                for h in r.histograms
            },
        }
        for r in mem.records
    ]


def _host_entries(host: Any) -> dict[str, Any]:
    _record = host_record(host)
    scalars, histograms, _ = list(_record.scalars), list(_record.histograms), list(_record.tensors)
    return {
        "scalars": {s.key: s.value for s in scalars},
        "histograms": {
            h.tensor: {"counts": h.counts, "edges": h.edges, "count": h.count, "nan": h.nan_count, "inf": h.inf_count,
                       "rejected": h.rejected, "underflow": h.underflow, "overflow": h.overflow}
            for h in histograms
        },
    }


def _engine_part(rank: int) -> dict[str, Any]:
    """StepStatistics with the CollectiveReducer, no hook: the slow (differing jobs) and fast paths."""
    from tensorlens.compute.distributed import CollectiveReducer
    from tensorlens.compute.jobs import TensorJob
    from tensorlens.compute.step import StepStatistics

    reducer = CollectiveReducer()
    jobs = []
    for name, (pieces, partitioned, hist) in _engine_data().items():
        if pieces[rank] is not None:
            jobs.append(TensorJob(name, [torch.from_numpy(pieces[rank])], ENGINE_STATS, hist, partitioned=partitioned))
    jobs.reverse()  # a rank's own order must not matter
    differing = StepStatistics().compute(reducer.agree_jobs(jobs), reducer)
    same = [job for job in jobs if job.name != "only_rank1"]
    same.sort(key=lambda job: job.name)
    agreed_same = reducer.agree_jobs(same)
    fast = [j.name for j in agreed_same] == [j.name for j in same]
    identical = StepStatistics().compute(agreed_same, reducer)
    return {"differing": _host_entries(differing), "same": _host_entries(identical), "fast_path_order": fast}


def _ddp_part(rank: int, out: Path) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    model = _mlp()
    ddp = DistributedDataParallel(model)
    mem = tl.MemoryBackend()
    hook = tl.Hook(
        out_dir=out / "ddp",
        save_config=SaveConfig(save_interval=1),
        include_collections=["weights", "biases", "gradients", "activations", "losses"],
        histogram_config=HIST,
        backends=[mem],
    )
    hook.register_module(ddp)  # the wrapper is looked through: names stay "0.weight", not "module.0.weight"
    criterion = nn.MSELoss()
    hook.register_loss(criterion)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    # the values this rank really saw: histogram edges are exact, so a reference one ulp off
    # (another summation order) could fall on the other side of an edge
    actual: dict[Any, dict[str, np.ndarray]] = {}
    outputs: dict[str, np.ndarray] = {}
    for i, child in enumerate(model):
        child.register_forward_hook(lambda m, a, o, i=i: outputs.__setitem__(f"activations/{i}", o.detach().numpy().copy()))
    for step in range(2):
        x, y = _batch(step)
        criterion(ddp(_local(x, rank)), _local(y, rank)).backward()
        actual[step] = dict(outputs)
        for name, p in model.named_parameters():
            actual[step][f"{'biases' if name.endswith('bias') else 'weights'}/{name}"] = p.detach().numpy().copy()
            actual[step][f"gradients/{name}"] = p.grad.numpy().copy()
        optimizer.step()
        optimizer.zero_grad()
    ddp.eval()
    with torch.no_grad():
        for k in range(2):
            ddp(_local(_batch(10 + k)[0], rank))
            actual[("eval", k)] = dict(outputs)
    hook.close()  # closes the last eval step: a collective, so every rank closes
    return {"records": _records(mem), "backends": [b.name for b in hook.backends], "run_dir": hook.run_dir, "actual": actual}


class _Uneven(nn.Module):
    """Rank 0 calls ``aux``; rank 1 calls ``extra`` twice; the batches differ in size."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.trunk = nn.Linear(4, 6).double()
        self.aux = nn.Linear(6, 2).double()
        self.extra = nn.Linear(6, 3).double()

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = self.trunk(x)
        out = self.extra(h).sum()
        if rank == 0:
            out = out + self.aux(h).sum()
        else:
            out = out + self.extra(h[:2]).sum()
        return out


def _uneven_part(rank: int, out: Path) -> dict[str, Any]:
    model = _Uneven()
    mem = tl.MemoryBackend()
    hook = tl.Hook(
        out_dir=out / "uneven",
        save_config=SaveConfig(save_interval=2),
        include_collections=["activations", "gradients", "summaries", "scalars"],
        histogram_config=HistogramConfig(bins=8),
        backends=[mem],
    )
    hook.register_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    local: dict[int, dict[str, np.ndarray]] = {}
    for step in range(3):
        x = torch.randn(3 + 2 * rank, 4, generator=torch.Generator().manual_seed(10 * step + rank), dtype=torch.float64)
        with torch.no_grad():
            h = model.trunk(x)
            local[step] = {"trunk": h.numpy().copy(), "extra": torch.cat([model.extra(h), model.extra(h[:2])]).numpy()
                           if rank else model.extra(h).numpy().copy(), "aux": model.aux(h).numpy().copy()}
        model(x, rank).backward()
        if rank == 1:
            hook.save_scalar("only_rank1", 5.0)  # also on step 1, which saves nothing: no collective then
        else:
            tl.summarize_scalar("rank0_summary", 3.0)
        optimizer.step()
        optimizer.zero_grad()
    hook.close()
    return {"records": _records(mem), "local": local}


class _Tracker(tl.MemoryBackend):
    """Stands for W&B or MLflow: a backend that only rank 0 may have."""

    name = "tracker"
    main_process_only = True


def _workers_part(rank: int, out: Path, mode: str) -> dict[str, Any]:
    cwd = out / f"{mode}_cwd"
    cwd.mkdir(exist_ok=True)
    os.chdir(cwd)  # out_dir=None: the default ./tensorlens_runs/<name>, which the ranks must share
    mem = tl.MemoryBackend()
    hook = tl.Hook(
        save_config=SaveConfig(save_interval=1),
        include_collections=["activations"],
        include_workers=mode,
        backends=[_Tracker(), mem],
    )
    model = _mlp()
    hook.register_module(model)
    x = _local(_batch(0)[0], rank)
    model(x)
    hook.step()
    hook.close()
    with torch.no_grad():
        act = model[0](x).numpy()
    return {
        "run_dir": hook.run_dir,
        "backends": [b.name for b in hook.backends],
        "records": _records(mem),
        "local_act": act,
        "will_save": hook.will_save("activations", "train"),
    }


def _scenario_reduce(rank: int, out: Path) -> dict[str, Any]:
    return {
        "engine": _engine_part(rank),
        "ddp": _ddp_part(rank, out),
        "uneven": _uneven_part(rank, out),
        "all": _workers_part(rank, out, "all"),
        "one": _workers_part(rank, out, "one"),
    }


def _scenario_fsdp(rank: int, out: Path) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    model = _fsdp_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # an HSDP-like placement: replicated over mesh dim 0, sharded over dim 1 (of size 1 here)
    hybrid = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))
    mem = tl.MemoryBackend()
    hook = tl.Hook(
        out_dir=out / "fsdp",
        save_config=SaveConfig(save_interval=1),
        include_collections=["weights", "biases", "gradients", "updates", "summaries"],
        histogram_config=HistogramConfig(bins=8),
        backends=[mem],
    )
    hook.register_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    placements = {name: (type(p).__name__, str(p.placements), tuple(p.to_local().shape)) for name, p in model.named_parameters()}
    shards: dict[int, dict[str, np.ndarray]] = {}
    for step in range(2):
        x, y = _batch(step)
        nn.functional.mse_loss(model(_local(x, rank)), _local(y, rank)).backward()
        full = torch.arange(6.0, dtype=torch.float64).reshape(3, 2) + step
        hook.save_tensor("hybrid", distribute_tensor(full, hybrid, [Replicate(), Shard(0)]), "summaries")
        shards[step] = {}
        for name, p in model.named_parameters():
            kind = "biases" if name.endswith("bias") else "weights"
            shards[step][f"{kind}/{name}"] = p.to_local().detach().numpy().copy()
            shards[step][f"gradients/{name}"] = p.grad.to_local().numpy().copy()
        optimizer.step()
        optimizer.zero_grad()
        for name, p in model.named_parameters():
            kind = "biases" if name.endswith("bias") else "weights"
            shards[step][f"updates/{name}"] = p.to_local().detach().numpy() - shards[step][f"{kind}/{name}"]
    hook.close()
    return {"records": _records(mem), "placements": placements, "shards": shards}


STALL_TIMEOUT_S = 3  # TENSORLENS_COLLECTIVE_TIMEOUT for the scenarios where a rank stops taking part
STALL_STEPS, STALL_AT = 4, 2


def _stall_part(rank: int, out: Path, how: str) -> dict[str, Any]:
    """From step ``STALL_AT`` rank 1 stops taking part in tensorlens's collectives: ``"hang"``
    sleeps (a failed rank that does not exit), ``"leave"`` closes its hook and trains on."""
    import warnings

    model = _mlp()
    mem = tl.MemoryBackend()
    hook = tl.Hook(
        out_dir=out / how, save_config=SaveConfig(save_interval=1), include_collections=["activations"], backends=[mem]
    )
    hook.register_module(model)
    # lr=0: the model stays the same on both ranks, so the test computes every reference itself
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    durations: dict[int, float] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STALL_STEPS):
            if rank == 1 and step == STALL_AT:
                if how == "hang":
                    time.sleep(3600)  # killed by the launcher once rank 0 is done
                hook.close()
            x, y = _batch(step)
            started = time.monotonic()
            nn.functional.mse_loss(model(_local(x, rank)), _local(y, rank)).backward()
            optimizer.step()
            optimizer.zero_grad()
            durations[step] = time.monotonic() - started
        hook.close()
        # a later hook that needs a collective (include_workers="all" agrees on the run folder)
        # does not wait again: this process's collectives are known to be broken
        started = time.monotonic()
        later = tl.Hook(out_dir=out / f"{how}-later", include_workers="all", backends=[]) if rank == 0 else None
        later_s = time.monotonic() - started
        if later is not None:
            later.close()
    messages = [str(w.message) for w in caught if str(w.message).startswith("tensorlens: a collective")]
    return {"records": _records(mem), "durations": durations, "warnings": messages,
            "later_s": later_s, "later_dir": later.run_dir if later is not None else None}


def _scenario_hang(rank: int, out: Path) -> dict[str, Any]:
    return _stall_part(rank, out, "hang")


def _scenario_leave(rank: int, out: Path) -> dict[str, Any]:
    return _stall_part(rank, out, "leave")


def _worker_main(argv: list[str]) -> None:
    scenario, rank, world, port, out = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    scenarios = {"reduce": _scenario_reduce, "fsdp": _scenario_fsdp, "hang": _scenario_hang, "leave": _scenario_leave}
    if scenario == "hang":  # rank 1 never comes back: no barrier, no teardown that could wait for it
        result = scenarios[scenario](rank, out)
        with open(out / f"{scenario}-rank{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
        os._exit(0)
    try:
        result = scenarios[scenario](rank, out)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    with open(out / f"{scenario}-rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


# ----------------------------------------------------------------------------- launcher


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(scenario: str, out: Path, hanging: frozenset[int] = frozenset(), env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``scenario`` on WORLD processes; kill them all if they pass the deadline.

    ``hanging``: ranks expected to be still running when the others are done (they are killed
    then, and must not have finished); their results are ``{}``.
    """
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    logs = [out / f"{scenario}-rank{rank}.log" for rank in range(WORLD)]
    procs = []
    for rank in range(WORLD):
        with open(logs[rank], "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), scenario, str(rank), str(WORLD), str(port), str(out)],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out,
            ))
    deadline = time.monotonic() + DEADLINE_S
    try:
        for rank, proc in enumerate(procs):
            if rank not in hanging:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        hung = [rank for rank, proc in enumerate(procs) if proc.poll() is None]
        for rank in hung:
            procs[rank].kill()
        for proc in procs:
            proc.wait()
    text = "\n".join(f"--- rank {r} ---\n{logs[r].read_text()[-4000:]}" for r in range(WORLD))
    if set(hung) != set(hanging):
        pytest.fail(f"{scenario}: rank(s) {hung} still running after {DEADLINE_S}s, expected {sorted(hanging)}\n{text}")
    failed = [r for r, proc in enumerate(procs) if proc.returncode != 0 and r not in hanging]
    if failed:
        pytest.fail(f"{scenario}: rank(s) {failed} failed\n{text}")
    results = []
    for rank in range(WORLD):
        if rank in hanging:
            results.append({})
            continue
        with open(out / f"{scenario}-rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results


@pytest.fixture(scope="module")
def reduce_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    out = tmp_path_factory.mktemp("reduce")
    return _launch("reduce", out), out


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    out = tmp_path_factory.mktemp("fsdp")
    return _launch("fsdp", out), out


# ----------------------------------------------------------------------------- references


def _np_stats(values: np.ndarray) -> dict[str, float]:
    v = np.asarray(values, dtype=np.float64).ravel()
    with np.errstate(all="ignore"):
        return {
            "min": v.min(),
            "max": v.max(),
            "mean": v.mean(),
            "std": v.std(),
            "sum": v.sum(),
            "l1": np.abs(v).sum(),
            "l2": np.sqrt((v * v).sum()),
            "numel": float(v.size),
            "nan_count": float(np.isnan(v).sum()),
            "inf_count": float(np.isinf(v).sum()),
            "zero_fraction": float((v == 0).mean()),
        }


def _check_stats(scalars: dict[str, float], tensor: str, values: np.ndarray, rel: float = 1e-9,
                 stats: tuple[str, ...] = ("min", "max", "mean", "std", "l2", "numel", "nan_count", "inf_count")) -> None:
    reference = _np_stats(values)
    for stat in stats:
        got = scalars[f"{tensor}/{stat}"]
        np.testing.assert_allclose(got, reference[stat], rtol=rel, atol=1e-12, equal_nan=True, err_msg=f"{tensor}/{stat}")


def _check_histogram(hist: dict[str, Any], values: np.ndarray, bins: int) -> None:
    """The edges span the finite values of every rank, and numpy bins the concatenation into the
    recorded counts with the recorded edges."""
    v = np.asarray(values, dtype=np.float64).ravel()
    finite = v[np.isfinite(v)]
    edges = hist["edges"]
    assert edges.shape == (bins + 1,)
    np.testing.assert_allclose(edges[[0, -1]], [finite.min(), finite.max()], rtol=1e-6)
    np.testing.assert_allclose(edges, np.linspace(finite.min(), finite.max(), bins + 1), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(hist["counts"], np.histogram(finite, bins=edges)[0])
    assert hist["count"] == finite.size


def _seen(results: list[dict[str, Any]], part: str, step: Any, tensor: str) -> np.ndarray:
    """What the ranks really held: activations concatenated, replicated tensors rank 0's."""
    if tensor.startswith("activations/"):
        return np.concatenate([results[rank][part]["actual"][step][tensor] for rank in range(WORLD)])
    return results[0][part]["actual"][step][tensor]


def _reference_training() -> dict[int, dict[str, np.ndarray]]:
    """One process, the global batch: the values a DDP run of ``_ddp_part`` must report."""
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref: dict[Any, dict[str, np.ndarray]] = {}
    for step in range(2):
        x, y = _batch(step)
        h = model[0](x)
        a = model[1](h)
        out = model[2](a)
        loss = nn.functional.mse_loss(out, y)
        loss.backward()
        ref[step] = {f"activations/{i}": t.detach().numpy().copy() for i, t in enumerate((h, a, out))}
        ref[step]["losses/mseloss"] = loss.detach().numpy().copy()
        for name, p in model.named_parameters():
            kind = "biases" if name.endswith("bias") else "weights"
            ref[step][f"{kind}/{name}"] = p.detach().numpy().copy()
            ref[step][f"gradients/{name}"] = p.grad.numpy().copy()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        for k in range(2):
            x = _batch(10 + k)[0]
            h = model[0](x)
            a = model[1](h)
            ref[("eval", k)] = {f"activations/{i}": t.numpy().copy() for i, t in enumerate((h, a, model[2](a)))}
    return ref


# ----------------------------------------------------------------------------- tests: engine


def test_engine_ranks_agree_bitwise(reduce_results: Any) -> None:
    results, _ = reduce_results
    for part in ("differing", "same"):
        a, b = results[0]["engine"][part], results[1]["engine"][part]
        assert a["scalars"].keys() == b["scalars"].keys()
        for key in a["scalars"]:
            np.testing.assert_array_equal(a["scalars"][key], b["scalars"][key], err_msg=key)
        assert a["histograms"].keys() == b["histograms"].keys()
        for key in a["histograms"]:
            for field in ("counts", "edges"):
                np.testing.assert_array_equal(a["histograms"][key][field], b["histograms"][key][field])


def test_engine_merged_statistics_equal_the_concatenation(reduce_results: Any) -> None:
    results, _ = reduce_results
    engine = results[0]["engine"]
    data = _engine_data()
    scalars, hists = engine["differing"]["scalars"], engine["differing"]["histograms"]
    everything = ("min", "max", "mean", "std", "sum", "l1", "l2", "numel", "nan_count", "inf_count", "zero_fraction")
    for name in ("act", "act32", "zeros", "only_rank1", "fixed", "outliers"):
        pieces, _, config = data[name]
        whole = np.concatenate([p.astype(np.float64) for p in pieces if p is not None])
        _check_stats(scalars, name, whole, rel=1e-5 if name == "act32" else 1e-12, stats=everything)
        if config.range is None and not config.reject_outliers:
            _check_histogram(hists[name], whole, config.bins)
    # NaN and Inf on rank 1 only: counted once each, the bins span the finite values of both ranks
    assert scalars["act/nan_count"] == 1 and scalars["act/inf_count"] == 1 and hists["act"]["nan"] == 1
    # a median cannot be merged: NaN once two ranks hold values, exact when only one does
    assert np.isnan(scalars["act32/median"])
    assert scalars["only_rank1/median"] == pytest.approx(np.median(data["only_rank1"][0][1]))
    # a fixed range: the bins and what falls outside are summed over ranks
    fixed = np.concatenate(data["fixed"][0])
    edges = np.linspace(-1.0, 1.0, 5)
    np.testing.assert_array_equal(hists["fixed"]["counts"], np.histogram(fixed, bins=edges)[0])
    assert hists["fixed"]["underflow"] == (fixed < -1).sum() and hists["fixed"]["overflow"] == (fixed > 1).sum()
    # outlier rejection runs per rank; the edges span the values kept on every rank
    kept = []
    rejected = 0
    for piece in data["outliers"][0]:
        mask, n = reject_outliers(torch.from_numpy(piece), 0.2)
        kept.append(piece[mask.numpy()])
        rejected += int(n)
    kept_all = np.concatenate(kept)
    assert hists["outliers"]["rejected"] == rejected
    assert hists["outliers"]["edges"][0] == kept_all.min() and hists["outliers"]["edges"][-1] == kept_all.max()
    np.testing.assert_array_equal(hists["outliers"]["counts"], np.histogram(kept_all, bins=hists["outliers"]["edges"])[0])


def test_engine_replicated_tensors_are_not_counted_twice(reduce_results: Any) -> None:
    results, _ = reduce_results
    for part in ("differing", "same"):
        scalars = results[0]["engine"][part]["scalars"]
        hists = results[0]["engine"][part]["histograms"]
        replicated, _, _ = _engine_data()["replicated"]
        _check_stats(scalars, "replicated", replicated[0], rel=1e-12)
        assert scalars["replicated/median"] == pytest.approx(np.median(replicated[0]))  # one piece: exact
        _check_histogram(hists["replicated"], replicated[0], 8)
        with_nan, _, _ = _engine_data()["replicated_nan"]
        assert scalars["replicated_nan/numel"] == 6 and scalars["replicated_nan/nan_count"] == 1
        _check_histogram(hists["replicated_nan"], with_nan[0], 8)


def test_engine_fast_path_keeps_the_order(reduce_results: Any) -> None:
    results, _ = reduce_results
    assert results[0]["engine"]["fast_path_order"] and results[1]["engine"]["fast_path_order"]
    assert "only_rank1/mean" not in results[0]["engine"]["same"]["scalars"]


# ----------------------------------------------------------------------------- tests: DDP


def test_ddp_reduced_statistics_equal_the_global_batch(reduce_results: Any) -> None:
    results, _ = reduce_results
    ref = _reference_training()
    train = [r for r in results[0]["ddp"]["records"] if r["mode"] == "train"]
    assert [r["step"] for r in train] == [0, 1]
    for record in train:
        assert record["worker"] == "reduced"
        scalars, hists = record["scalars"], record["histograms"]
        for tensor, values in ref[record["step"]].items():
            if tensor.startswith("losses/"):
                assert scalars[tensor] == pytest.approx(float(values), rel=1e-12)
                continue
            # gradients: DDP's average of the two halves equals the gradient of the global batch
            _check_stats(scalars, tensor, values)
            _check_histogram(hists[tensor], _seen(results, "ddp", record["step"], tensor), HIST.bins)
        assert scalars["activations/1/zero_fraction"] == pytest.approx(_np_stats(ref[record["step"]]["activations/1"])["zero_fraction"])
        assert scalars["activations/0/numel"] == 8 * 16  # both ranks' 4 rows


def test_ddp_eval_steps_are_reduced_too(reduce_results: Any) -> None:
    results, _ = reduce_results
    ref = _reference_training()
    evals = [r for r in results[0]["ddp"]["records"] if r["mode"] == "eval"]
    assert [r["mode_step"] for r in evals] == [0, 1]
    for record in evals:
        for tensor, values in ref[("eval", record["mode_step"])].items():
            _check_stats(record["scalars"], tensor, values)
            seen = _seen(results, "ddp", ("eval", record["mode_step"]), tensor)
            _check_histogram(record["histograms"][tensor], seen, HIST.bins)


def test_ddp_only_rank_0_records_in_reduce_mode(reduce_results: Any) -> None:
    results, out = reduce_results
    assert results[1]["ddp"]["records"] == []
    assert not any(name.startswith("tensorlens-") for name in os.listdir(out / "ddp"))  # no file of rank 1
    with tl.open_run(str(out / "ddp")) as run:
        assert run.workers() == ["reduced"]
        ref = _reference_training()
        grad = run.tensor("gradients/0.weight").reduction_value(step=1, name="l2")
        assert grad == pytest.approx(np.linalg.norm(ref[1]["gradients/0.weight"]), rel=1e-9)


# ----------------------------------------------------------------------------- tests: uneven calls


def test_ranks_with_different_module_calls_do_not_hang(reduce_results: Any) -> None:
    results, _ = reduce_results
    records = results[0]["uneven"]["records"]
    assert [r["step"] for r in records] == [0, 2]  # step 1 saves nothing and makes no collective
    local = [results[rank]["uneven"]["local"] for rank in range(WORLD)]
    for record in records:
        step, scalars = record["step"], record["scalars"]
        trunk = np.concatenate([local[r][step]["trunk"] for r in range(WORLD)])
        _check_stats(scalars, "activations/trunk", trunk)
        # called once on rank 0, twice on rank 1: all three calls merged
        extra = np.concatenate([local[r][step]["extra"] for r in range(WORLD)])
        _check_stats(scalars, "activations/extra", extra)
        assert scalars["activations/extra/numel"] == (3 + 5 + 2) * 3
        # called on rank 0 only: rank 1 stood in with an empty piece
        _check_stats(scalars, "activations/aux", local[0][step]["aux"])
        _check_histogram(record["histograms"]["activations/aux"], local[0][step]["aux"], 8)
        # a value only one rank saved is recorded as that rank's
        assert scalars["scalars/only_rank1"] == 5.0
        assert scalars["summaries/rank0_summary"] == 3.0
        assert "gradients/aux.weight/l2" in scalars  # rank 1 has no gradient for aux: rank 0's is kept


# ----------------------------------------------------------------------------- tests: "all" and "one"


def test_all_mode_each_rank_writes_its_own_file(reduce_results: Any) -> None:
    results, _ = reduce_results
    r0, r1 = results[0]["all"], results[1]["all"]
    assert r0["run_dir"] == r1["run_dir"]  # rank 0's default run name, broadcast
    assert sorted(r0["backends"]) == ["local", "memory", "tracker"] and sorted(r1["backends"]) == ["local", "memory"]
    files = {name for name in os.listdir(r0["run_dir"]) if name.endswith(".sqlite")}
    assert files == {"tensorlens.sqlite", "tensorlens-worker_1.sqlite"}
    with tl.open_run(r0["run_dir"]) as run:
        assert run.workers() == ["worker_0", "worker_1"]
        view = run.tensor("activations/0")
        for rank in range(WORLD):
            mean = view.reduction_value(step=0, name="mean", worker=f"worker_{rank}")
            assert mean == pytest.approx(results[rank]["all"]["local_act"].mean(), rel=1e-12)
    assert [r["worker"] for r in r1["records"]] == ["worker_1"]


def test_one_mode_records_rank_0_only(reduce_results: Any) -> None:
    results, _ = reduce_results
    r0, r1 = results[0]["one"], results[1]["one"]
    assert [r["worker"] for r in r0["records"]] == ["worker_0"]
    _check_stats(r0["records"][0]["scalars"], "activations/0", r0["local_act"])
    assert r1["records"] == [] and "tracker" not in r1["backends"]
    assert r1["will_save"] is False  # rank 1 captures nothing at all
    files = {name for name in os.listdir(r0["run_dir"]) if name.endswith(".sqlite")}
    assert files == {"tensorlens.sqlite"}


# ----------------------------------------------------------------------------- tests: FSDP2


def _reference_fsdp() -> dict[int, dict[str, np.ndarray]]:
    model = _fsdp_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref: dict[int, dict[str, np.ndarray]] = {}
    for step in range(2):
        x, y = _batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        ref[step] = {}
        before = {}
        for name, p in model.named_parameters():
            kind = "biases" if name.endswith("bias") else "weights"
            ref[step][f"{kind}/{name}"] = before[name] = p.detach().numpy().copy()
            ref[step][f"gradients/{name}"] = p.grad.numpy().copy()
        optimizer.step()
        optimizer.zero_grad()
        for name, p in model.named_parameters():
            ref[step][f"updates/{name}"] = p.detach().numpy() - before[name]
        ref[step]["summaries/hybrid"] = np.arange(6.0).reshape(3, 2) + step
    return ref


def test_fsdp2_sharded_statistics_equal_the_unsharded_model(fsdp_results: Any) -> None:
    results, _ = fsdp_results
    placements = results[0]["placements"]
    assert placements["0.weight"][0] == "DTensor" and "Shard(dim=0)" in placements["0.weight"][1]
    assert placements["0.weight"][2] == (3, 6) and results[1]["placements"]["0.weight"][2] == (2, 6)  # uneven shards
    ref = _reference_fsdp()
    records = results[0]["records"]
    assert [r["step"] for r in records] == [0, 1] and results[1]["records"] == []
    for record in records:
        scalars, step = record["scalars"], record["step"]
        for tensor, values in ref[step].items():
            # the hybrid tensor is replicated over one mesh dimension: counted once, not twice
            _check_stats(scalars, tensor, values)
            if tensor == "summaries/hybrid":
                seen = values
            else:  # the shards the ranks held, in rank order (FSDP2 shards dim 0)
                seen = np.concatenate([results[rank]["shards"][step][tensor] for rank in range(WORLD)])
                np.testing.assert_allclose(seen, values, rtol=1e-9, atol=1e-12)
            _check_histogram(record["histograms"][tensor], seen, 8)


# ----------------------------------------------------------------------------- a rank stops taking part


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["hang", "leave"])
def test_a_rank_that_stops_taking_part_holds_the_others_only_for_the_collective_timeout(tmp_path: Path, how: str) -> None:
    """Rank 1 sleeps (``hang``: a failed rank that does not exit) or closes its hook and trains
    on (``leave``) from step 2. Rank 0 waits ``TENSORLENS_COLLECTIVE_TIMEOUT`` seconds once, warns
    once, and records every step: merged before, its own values after."""
    results = _launch(how, tmp_path, hanging=frozenset({1}) if how == "hang" else frozenset(),
                      env={"TENSORLENS_COLLECTIVE_TIMEOUT": str(STALL_TIMEOUT_S)})
    rank0 = results[0]
    print(f"{how}: rank 0 step durations {[round(d, 2) for d in rank0['durations'].values()]} s; "
          f"a later hook needing a collective: {rank0['later_s']:.2f} s")
    records = rank0["records"]
    assert [r["step"] for r in records] == list(range(STALL_STEPS)) and {r["worker"] for r in records} == {"reduced"}
    first_layer = _mlp()[0]
    for record in records:
        x = _batch(record["step"])[0]
        # both ranks' halves of the batch until rank 1 stopped, then rank 0's own half
        with torch.no_grad():
            seen = first_layer(x if record["step"] < STALL_AT else _local(x, 0)).numpy()
        _check_stats(record["scalars"], "activations/0", seen)
    assert len(rank0["warnings"]) == 2, rank0["warnings"]  # the step's collective, then the later hook
    first, later = rank0["warnings"]
    assert f"waited more than {STALL_TIMEOUT_S} s" in first and "TENSORLENS_COLLECTIVE_TIMEOUT" in first
    assert "agreeing on the step's tensors" in first and "broadcast of the run folder" in later
    assert rank0["later_dir"] == str(tmp_path / f"{how}-later")  # its own folder, no broadcast
    if how == "leave":
        assert results[1]["warnings"] == []  # it left: it never waited
        assert [r["step"] for r in results[1]["records"]] == []  # reduce mode: rank 0 records


# ----------------------------------------------------------------------------- worker entry point

if __name__ == "__main__":
    _worker_main(sys.argv[1:])
