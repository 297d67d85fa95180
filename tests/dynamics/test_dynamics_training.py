"""Training dynamics on real (small) training, against numpy float64 references computed on a twin
model trained in lockstep without tensorlens.

The watched model uses ``ReLU(inplace=True)`` after a Linear (the in-place op must keep working,
and the Linear's output statistics must be those before the ReLU modified it); the twin uses
``inplace=False`` and ``retain_grad`` to read gradients w.r.t. every module output.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens.config import DynamicsConfig, HistogramConfig, SaveConfig

LR, MOMENTUM = 0.05, 0.9
BATCH = 10
LEAVES = ("fc1", "act1", "fc2", "act2", "fc3")


class Net(nn.Module):
    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(6, 16)
        self.act1 = nn.ReLU(inplace=inplace)
        self.fc2 = nn.Linear(16, 8)
        self.act2 = nn.Tanh()
        self.fc3 = nn.Linear(8, 3)
        with torch.no_grad():
            self.fc1.bias[:3] = -100.0  # three units of act1 never fire: dead
            self.fc2.weight.mul_(4.0)
            self.fc2.bias[:2] = 5.0  # some tanh outputs saturate
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


def _batch(step: int, micro: int) -> torch.Tensor:
    return torch.randn(BATCH, 6, generator=torch.Generator().manual_seed(1000 * step + micro), dtype=torch.float64)


def _loss(out: torch.Tensor, micro_batches: int) -> torch.Tensor:
    return out.square().mean() / micro_batches


def reference(steps: int, micro_batches: int = 1) -> list[dict[str, Any]]:
    """Per optimizer step of the twin: parameters before and after, gradients, the value
    ``clip_grad_norm_`` returns, module outputs and the gradients w.r.t. them (all micro-batches)."""
    model = Net(inplace=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    kept: dict[str, list[torch.Tensor]] = {}

    def keep(name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            out.retain_grad()
            kept.setdefault(name, []).append(out)

        return hook

    for name in LEAVES:
        getattr(model, name).register_forward_hook(keep(name))
    out = []
    for step in range(steps):
        kept.clear()
        for micro in range(micro_batches):
            _loss(model(_batch(step, micro)), micro_batches).backward()
        rec: dict[str, Any] = {
            "before": {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
            "grads": {n: p.grad.numpy().copy() for n, p in model.named_parameters()},
            "outputs": {n: torch.cat([t.detach() for t in ts]).numpy() for n, ts in kept.items()},
            "output_grads": {n: torch.cat([t.grad for t in ts]).numpy() for n, ts in kept.items()},
        }
        rec["clip"] = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf).item()  # max_norm inf: no change
        optimizer.step()
        rec["after"] = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        optimizer.zero_grad()
        out.append(rec)
    return out


def watched_run(tmp_path: Any, steps: int, micro_batches: int = 1, save_interval: int = 3, **config: Any) -> tuple[tl.Hook, tl.MemoryBackend]:
    model = Net(inplace=True)
    mem = tl.MemoryBackend()
    hook = tl.watch(
        model, backends=[mem], out_dir=str(tmp_path / "run"), save_interval=save_interval,
        collections=["gradients", "dynamics"], histograms=HistogramConfig(bins=8),
        dynamics=DynamicsConfig(**config) if config else True,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        for micro in range(micro_batches):
            _loss(model(_batch(step, micro)), micro_batches).backward()
        optimizer.step()
        optimizer.zero_grad()
    hook.close()
    return hook, mem


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a.ravel(), b.ravel()) / (np.linalg.norm(a) * np.linalg.norm(b)))


def _norm(a: np.ndarray) -> float:
    return float(np.linalg.norm(a.ravel()))


@pytest.mark.parametrize("save_interval", [3, 1])  # 1: each step reuses the previous one's sums
def test_parameter_dynamics_equal_numpy_with_cosines_across_optimizer_steps(tmp_path: Any, save_interval: int) -> None:
    steps = 8
    ref = reference(steps)
    _, mem = watched_run(tmp_path, steps, save_interval=save_interval, distance_from_init=True)
    assert [r.step for r in mem.records] == list(range(0, steps, save_interval))
    init = ref[0]["before"]
    for record in mem.records:
        t, s = record.step, record.scalar_dict()
        now = ref[t]
        for name in now["grads"]:
            g, p, d = now["grads"][name], now["before"][name], now["after"][name] - now["before"][name]
            key = f"dynamics/{name}"
            assert s[f"{key}/update_l2"] == pytest.approx(_norm(d), rel=1e-10)
            assert s[f"{key}/update_ratio"] == pytest.approx(_norm(d) / _norm(p), rel=1e-10)
            assert s[f"{key}/grad_to_weight"] == pytest.approx(_norm(g) / _norm(p), rel=1e-10)
            assert s[f"{key}/distance_from_init"] == pytest.approx(_norm(p - init[name]), rel=1e-9, abs=1e-15)
            assert s[f"{key}/nan_count"] == 0.0
            if t == 0:  # no previous optimizer step: no cosines
                assert f"{key}/grad_cosine" not in s and f"{key}/update_cosine" not in s
                continue
            # with the previous *optimizer* step (t - 1), not the previous saved step (t - 3)
            prev = ref[t - 1]
            prev_d = prev["after"][name] - prev["before"][name]
            assert s[f"{key}/grad_cosine"] == pytest.approx(_cos(g, prev["grads"][name]), rel=1e-9, abs=1e-12)
            assert s[f"{key}/update_cosine"] == pytest.approx(_cos(d, prev_d), rel=1e-9, abs=1e-12)
            assert abs(s[f"{key}/grad_cosine"] - _cos(g, ref[t - 3]["grads"][name])) > 1e-6 or t < 3
        grads = np.concatenate([v.ravel() for v in now["grads"].values()])
        befores = np.concatenate([v.ravel() for v in now["before"].values()])
        afters = np.concatenate([v.ravel() for v in now["after"].values()])
        inits = np.concatenate([v.ravel() for v in init.values()])
        assert s["dynamics/global/grad_norm"] == pytest.approx(now["clip"], rel=1e-12)  # what clip_grad_norm_ returns
        assert s["dynamics/global/grad_norm"] == pytest.approx(_norm(grads), rel=1e-12)
        assert s["dynamics/global/weight_norm"] == pytest.approx(_norm(befores), rel=1e-12)
        assert s["dynamics/global/update_norm"] == pytest.approx(_norm(afters - befores), rel=1e-10)
        assert s["dynamics/global/distance_from_init"] == pytest.approx(_norm(befores - inits), rel=1e-9, abs=1e-15)
        assert s["dynamics/global/grad_nonfinite_count"] == 0.0
        if t:
            prev = ref[t - 1]
            prev_grads = np.concatenate([v.ravel() for v in prev["grads"].values()])
            prev_updates = np.concatenate([(prev["after"][n] - prev["before"][n]).ravel() for n in prev["grads"]])
            assert s["dynamics/global/grad_cosine"] == pytest.approx(_cos(grads, prev_grads), rel=1e-9)
            assert s["dynamics/global/update_cosine"] == pytest.approx(_cos(afters - befores, prev_updates), rel=1e-9)
        # the gradients collection's own l2 agrees with the dynamics' squared norms
        assert s["gradients/fc1.weight/l2"] == pytest.approx(_norm(now["grads"]["fc1.weight"]), rel=1e-12)


def _unit_reference(values: np.ndarray) -> tuple[np.ndarray, float, float]:
    """monitorch's activation rates along the last axis of a [samples, ..., features] output."""
    active = np.abs(values.reshape(-1, values.shape[-1])) > 0
    rates = active.mean(axis=0)
    return rates, float((rates == 0).mean()), float(rates.mean())


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_module_dynamics_equal_numpy_over_the_whole_batch(tmp_path: Any, micro_batches: int) -> None:
    """Dead units, activation rates, saturation and per-sample norms of outputs and of the gradients
    w.r.t. outputs and inputs; with gradient accumulation, over every micro-batch of the step."""
    steps = 4
    ref = reference(steps, micro_batches)
    _, mem = watched_run(tmp_path, steps, micro_batches, save_interval=3)
    assert [r.step for r in mem.records] == [0, 3]
    for record in mem.records:
        s, now = record.scalar_dict(), ref[record.step]
        for i, name in enumerate(LEAVES):
            values, grads = now["outputs"][name], now["output_grads"][name]
            assert values.shape[0] == BATCH * micro_batches
            rates, dead, active = _unit_reference(values)
            assert s[f"activations/{name}/dead_fraction"] == pytest.approx(dead)
            assert s[f"activations/{name}/active_rate_mean"] == pytest.approx(active)
            unit = f"activations/{name}/unit_active_rate"
            assert s[f"{unit}/numel"] == rates.size
            assert s[f"{unit}/min"] == pytest.approx(rates.min()) and s[f"{unit}/max"] == pytest.approx(rates.max())
            hist = record.histogram(unit)
            assert hist is not None and hist.edges[0] == 0.0 and hist.edges[-1] == 1.0 and hist.counts.sum() == rates.size
            np.testing.assert_array_equal(hist.counts, np.histogram(rates, bins=8, range=(0.0, 1.0))[0])
            norms = np.linalg.norm(values.reshape(values.shape[0], -1), axis=1)
            sample = f"activations/{name}/sample_norm"
            assert s[f"{sample}/numel"] == norms.size
            for stat, want in (("mean", norms.mean()), ("min", norms.min()), ("max", norms.max()), ("std", norms.std())):
                assert s[f"{sample}/{stat}"] == pytest.approx(want, rel=1e-10), (sample, stat)
            grad_norms = np.linalg.norm(grads.reshape(grads.shape[0], -1), axis=1)
            for stat, want in (("mean", grad_norms.mean()), ("max", grad_norms.max()), ("std", grad_norms.std())):
                assert s[f"activation_gradients/{name}/sample_norm/{stat}"] == pytest.approx(want, rel=1e-9)
            if i:  # the input of each later module is the previous module's output (its only reader)
                previous = now["output_grads"][LEAVES[i - 1]]
                want = np.linalg.norm(previous.reshape(previous.shape[0], -1), axis=1)
                assert s[f"input_gradients/{name}.0/sample_norm/mean"] == pytest.approx(want.mean(), rel=1e-9)
                assert s[f"input_gradients/{name}.0/sample_norm/numel"] == want.size
        assert "input_gradients/fc1.0/sample_norm/mean" not in s  # the data needs no gradient
        assert s["activations/act1/dead_fraction"] >= 3 / 16  # the three units biased off, at least
        tanh = now["outputs"]["act2"]
        assert s["activations/act2/saturation_fraction"] == pytest.approx(float((np.abs(tanh) >= 0.99).mean()))
        assert 0 < s["activations/act2/saturation_fraction"] < 1
        assert "activations/act1/saturation_fraction" not in s  # ReLU has no upper bound


def test_unsaved_steps_keep_no_copies(tmp_path: Any) -> None:
    """Copies are made on the step before a saved step only (for the cosines), and dropped after."""
    model = Net()
    mem = tl.MemoryBackend()
    hook = tl.watch(model, backends=[mem], out_dir=str(tmp_path / "r"), save_interval=4, collections=["dynamics"], dynamics=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    held = []
    for step in range(9):
        model(_batch(step, 0)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        prev = hook.dynamics._prev
        held.append(prev.step if prev is not None else None)
        assert hook.dynamics._step is None  # the copy of the parameters before the step is gone
    hook.close()
    # after step 3 (the step before saved step 4) its gradient and update are held, used at step 4 and dropped
    assert held == [None, None, None, 3, None, None, None, 7, None]
    assert [r.step for r in mem.records] == [0, 4, 8]
    assert "dynamics/fc1.weight/grad_cosine" in mem.records[1].scalar_dict()
    # without cosines nothing is held, ever
    hook = tl.watch(Net(), backends=[tl.MemoryBackend()], out_dir=str(tmp_path / "n"), save_interval=4,
                    collections=["dynamics"], dynamics=DynamicsConfig(cosines=False))
    model = hook._taps.roots[0][1]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(5):
        model(_batch(step, 0)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert hook.dynamics._prev is None
    hook.close()


def test_frozen_zero_parameter_gives_counted_undefined_ratios_not_nan(tmp_path: Any) -> None:
    model = Net()
    with torch.no_grad():
        model.fc3.bias.zero_()
    model.fc3.bias.requires_grad_(False)  # no gradient, never updated: 0 / 0
    mem = tl.MemoryBackend()
    hook = tl.watch(model, backends=[mem], out_dir=str(tmp_path / "r"), save_interval=1, collections=["dynamics"], dynamics=True)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step in range(2):
        model(_batch(step, 0)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    hook.close()
    s = mem.records[-1].scalar_dict()
    assert s["dynamics/fc3.bias/update_l2"] == 0.0
    # 0/0 (zero update of a zero weight; the cosine of two zero updates): left out, not NaN
    assert "dynamics/fc3.bias/update_ratio" not in s and "dynamics/fc3.bias/update_cosine" not in s
    assert s["dynamics/global/undefined_count"] == 2.0  # counted, not hidden
    assert s["dynamics/fc3.bias/nan_count"] == 0.0
    assert "dynamics/fc3.bias/grad_to_weight" not in s and "dynamics/fc3.bias/grad_cosine" not in s  # no gradient
    assert s["dynamics/global/nan_count"] == 0.0
    assert s["dynamics/fc1.weight/nan_count"] == 0.0
    assert mem.records[0].scalar_dict()["dynamics/global/undefined_count"] == 1.0  # no cosine at the first step


def test_nonfinite_gradients_are_counted_and_grad_norm_is_nan_like_clip_grad_norm(tmp_path: Any) -> None:
    model = Net()
    mem = tl.MemoryBackend()
    hook = tl.watch(model, backends=[mem], out_dir=str(tmp_path / "r"), save_interval=1, collections=["dynamics"], dynamics=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model(_batch(0, 0)).square().mean().backward()
    model.fc2.weight.grad[0, :3] = math.nan
    model.fc3.weight.grad[1, 1] = math.inf
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    optimizer.step()
    hook.close()
    s = mem.records[0].scalar_dict()
    assert math.isnan(expected) and math.isnan(s["dynamics/global/grad_norm"])
    assert s["dynamics/global/grad_nonfinite_count"] == 4.0


def test_distance_from_init_with_the_copy_on_the_cpu(tmp_path: Any) -> None:
    steps = 3
    ref = reference(steps)
    _, mem = watched_run(tmp_path, steps, save_interval=1, distance_from_init=True, init_on_cpu=True, cosines=False)
    for record in mem.records:
        s = record.scalar_dict()
        p, p0 = ref[record.step]["before"]["fc2.weight"], ref[0]["before"]["fc2.weight"]
        assert s["dynamics/fc2.weight/distance_from_init"] == pytest.approx(_norm(p - p0), rel=1e-9, abs=1e-15)
        assert "dynamics/fc2.weight/grad_cosine" not in s


def test_channel_first_outputs_of_a_conv_net(tmp_path: Any) -> None:
    """Conv outputs and the ReLU after them count units per channel (axis 1), as monitorch does
    for [batch, channels, ...]; the ReLU learns it from the Conv that produced its input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU()).double()
    with torch.no_grad():
        model[0].bias[1] = -100.0  # channel 1 is dead after the ReLU
    mem = tl.MemoryBackend()
    hook = tl.watch(model, backends=[mem], out_dir=str(tmp_path / "r"), save_interval=1, collections=["dynamics"], dynamics=True)
    x = torch.randn(5, 2, 7, dtype=torch.float64)
    model(x).sum().backward()
    hook.step()
    hook.close()
    s = mem.records[0].scalar_dict()
    relu = torch.relu(model[0](x)).detach().numpy()  # [5, 4, 5]: 4 channels
    rates = (np.abs(relu) > 0).mean(axis=(0, 2))
    assert s["activations/1/unit_active_rate/numel"] == 4  # channels, not the 5 positions of the last axis
    assert s["activations/1/dead_fraction"] == pytest.approx(float((rates == 0).mean())) == 0.25
    assert s["activations/0/unit_active_rate/numel"] == 4


def test_channel_axis_is_configurable(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU()).double()
    mem = tl.MemoryBackend()
    hook = tl.watch(model, backends=[mem], out_dir=str(tmp_path / "r"), save_interval=1, collections=["dynamics"],
                    dynamics=DynamicsConfig(channel_last={r"^1$": False}))
    model(torch.randn(3, 4, 5, dtype=torch.float64)).sum().backward()
    hook.step()
    hook.close()
    s = mem.records[0].scalar_dict()
    assert s["activations/0/unit_active_rate/numel"] == 6  # auto: channel-last for a Linear
    assert s["activations/1/unit_active_rate/numel"] == 4  # forced channel-first: axis 1 of [3, 4, 6]


def test_eval_steps_record_module_dynamics_without_gradients(tmp_path: Any) -> None:
    model = Net()
    mem = tl.MemoryBackend()
    hook = tl.watch(model, backends=[mem], out_dir=str(tmp_path / "r"), save_interval=1, collections=["dynamics"], dynamics=True)
    model.eval()
    with torch.no_grad():
        model(_batch(0, 0))
    hook.close()
    (record,) = mem.records
    s = record.scalar_dict()
    assert str(record.mode) == "eval"
    assert s["activations/act1/dead_fraction"] >= 3 / 16
    assert not any(k.startswith(("dynamics/", "activation_gradients/", "input_gradients/")) for k in s)


def test_bad_configuration_fails_at_construction(tmp_path: Any) -> None:
    for kwargs, message in (
        ({"active_threshold": -1.0}, "active_threshold"),
        ({"saturation_threshold": 0.0}, "saturation_threshold"),
        ({"saturation_bounds": {"tanh": (1.0, -1.0)}}, "saturation_bounds"),
        ({"channel_last": {"(": True}}, "channel_last"),
        ({"cosines": "yes"}, "cosines"),
    ):
        with pytest.raises(ValueError, match=f"Expected `{message}`"):
            DynamicsConfig(**kwargs)
    with pytest.raises(ValueError, match="Expected `dynamics`"):
        tl.watch(Net(), backends=[], out_dir=str(tmp_path / "a"), dynamics="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Expected `dynamics_config`"):
        tl.Hook(out_dir=str(tmp_path / "b"), backends=[], dynamics_config=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Expected `name`"):
        tl.Collection("epochs")
    assert "dynamics" not in tl.Hook(out_dir=str(tmp_path / "c"), backends=[], include_collections=["all"]).enabled_collections()


def test_dynamics_follow_the_collection_save_config_and_patterns(tmp_path: Any) -> None:
    model = Net()
    mem = tl.MemoryBackend()
    hook = tl.Hook(out_dir=str(tmp_path / "r"), backends=[mem], save_config=SaveConfig(save_interval=1),
                   include_collections=["gradients", "dynamics"])
    hook.register_module(model)
    hook.get_collection("dynamics").include(r"^fc2")
    hook.get_collection("dynamics").save_config = SaveConfig(save_interval=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(3):
        model(_batch(step, 0)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    hook.close()
    names = [{k.split("/")[0] + "/" + k.split("/")[1] for k in r.scalar_dict()} for r in mem.records]
    assert [r.step for r in mem.records] == [0, 1, 2]
    assert "dynamics/fc2.weight" in names[0] and "dynamics/fc1.weight" not in names[0]
    assert "activations/fc2" in names[0] and "activations/fc1" not in names[0]
    assert not any(n.startswith("dynamics/") for n in names[1])  # not a step dynamics saves
    assert "dynamics/fc2.weight" in names[2]


class _SameTwice(nn.Module):
    """Checks identity the way attention does (``query is key``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        self.seen.append(q is k)
        return q * k


def test_a_tensor_passed_twice_stays_one_tensor_and_attention_is_unchanged(tmp_path: Any) -> None:
    """The input views keep identities: a module checking ``q is k`` takes the same path, and an
    attention module chosen by name computes bit for bit what it computes unwatched."""
    torch.manual_seed(0)
    same = _SameTwice()
    attn = nn.MultiheadAttention(8, 2, batch_first=True)
    twin = nn.MultiheadAttention(8, 2, batch_first=True)
    twin.load_state_dict(attn.state_dict())
    root = nn.ModuleDict({"same": same, "attn": attn})
    mem = tl.MemoryBackend()
    hook = tl.Hook(out_dir=str(tmp_path / "r"), backends=[mem], save_config=SaveConfig(save_interval=1), include_collections=["dynamics"])
    hook.register_module(root)
    hook.get_collection("dynamics").include(r"^(same|attn)$")
    x = torch.randn(2, 5, 8, requires_grad=True)
    hook.begin_step()
    h = x * 2
    out, _ = attn(h, h, h, need_weights=False)
    h_twin = x.detach().clone().requires_grad_() * 2  # the same conditions, unwatched
    reference, _ = twin(h_twin, h_twin, h_twin, need_weights=False)
    (same(h, h).sum() + out.sum()).backward()
    hook.step()
    hook.close()
    assert same.seen == [True]
    assert torch.equal(out.detach(), reference.detach())
    s = mem.records[0].scalar_dict()
    # one view of h for both arguments: the gradient through the module of both uses together
    grad = (2 * h).detach().reshape(2, -1)
    assert s["input_gradients/same.0/sample_norm/mean"] == pytest.approx(torch.linalg.vector_norm(grad, dim=1).mean().item(), rel=1e-6)
    assert "input_gradients/same.1/sample_norm/mean" not in s
    assert "input_gradients/attn.0/sample_norm/mean" in s


def test_the_run_metadata_holds_the_dynamics_config(tmp_path: Any) -> None:
    import json

    from tensorlens.engine.metadata import run_metadata

    hook = tl.watch(Net(), backends=[tl.MemoryBackend()], out_dir=str(tmp_path / "r"),
                    dynamics=DynamicsConfig(distance_from_init=True, saturation_bounds={"act2": (-1.0, 1.0)}))
    config = json.loads(json.dumps(run_metadata(hook, hook._sources)))["config"]
    hook.close()
    assert "dynamics" in config["collections"]
    assert config["dynamics"]["distance_from_init"] is True and config["dynamics"]["saturation_bounds"] == {"act2": [-1.0, 1.0]}


def test_an_empty_batch_records_no_made_up_rate(tmp_path: Any) -> None:
    """A step whose batch is empty saw no position: its unit rates are 0/0. They are left out (not
    a NaN vector that ExplodingTensor would read as a collapse) and counted as undefined."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU()).double()
    mem = tl.MemoryBackend()
    hook = tl.watch(model, backends=[mem], out_dir=str(tmp_path / "r"), save_interval=1, collections=["dynamics"], dynamics=True)
    for rows in (64, 0):
        model(torch.randn(rows, 5, dtype=torch.float64)).sum().backward()
        hook.step()
    hook.close()
    full, empty = (record.scalar_dict() for record in mem.records)
    assert full["activations/1/unit_active_rate/numel"] == 6
    assert not any(key.startswith("activations/1/unit_active_rate/") for key in empty)
    assert "activations/1/dead_fraction" not in empty
    assert empty["dynamics/global/undefined_count"] >= 2
    # what is NaN belongs to an empty tensor (numel 0: "NaN for the rest", as for any empty tensor)
    nan = {k.rsplit("/", 1)[0] for k, v in empty.items() if isinstance(v, float) and math.isnan(v)}
    assert nan and all(empty[f"{t}/numel"] == 0 and empty[f"{t}/nan_count"] == 0 for t in nan)
    assert not [f for f in tl.rules.evaluate(tmp_path / "r").findings]  # no rule reads a made-up value


def test_the_compiled_kernel_and_the_pytorch_ops_record_the_same_dynamics(tmp_path: Any, monkeypatch: Any) -> None:
    """Module outputs, gradient norms and parameter sums read by the compiled kernel (the default on
    a CPU with a compiler) or by PyTorch ops (``TENSORLENS_NATIVE=0``): the same records, counts
    exactly, sums to float64 rounding."""
    from tensorlens.stats import native

    monkeypatch.delenv("TENSORLENS_NATIVE", raising=False)
    native.reset()
    if not native.available():
        pytest.skip("no C compiler here: the compiled kernel is not built")
    calls: dict[str, int] = {"output_statistics": 0, "dots": 0}

    def counting(name: str) -> Any:
        read = getattr(native, name)

        def counted(*args: Any) -> Any:
            calls[name] += 1
            return read(*args)

        return counted

    for name in calls:
        monkeypatch.setattr(native, name, counting(name))
    _, fast = watched_run(tmp_path / "kernel", 4, save_interval=3, distance_from_init=True)
    assert calls["output_statistics"] > 0 and calls["dots"] > 0  # the kernel did read them
    monkeypatch.setenv("TENSORLENS_NATIVE", "0")
    _, slow = watched_run(tmp_path / "torch", 4, save_interval=3, distance_from_init=True)
    assert [r.step for r in fast.records] == [r.step for r in slow.records] == [0, 3]
    for a, b in zip(fast.records, slow.records, strict=True):
        got, want = a.scalar_dict(), b.scalar_dict()
        assert got.keys() == want.keys()
        for key, value in want.items():
            if key.endswith(("dead_fraction", "saturation_fraction", "/numel", "nan_count", "undefined_count")):
                assert got[key] == value, key  # counts: exactly
            elif math.isfinite(value):
                assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-300), key
            else:
                assert str(got[key]) == str(value), key
