"""Gradients as the optimizer sees them: unscaled under ``torch.amp.GradScaler``, summed over the
micro-batches of gradient accumulation, one record per optimizer step.

The hook reads gradients in a ``torch.optim`` step pre-hook. ``GradScaler.step`` unscales the
gradients before it calls ``optimizer.step`` (and skips the call when they hold Inf/NaN), so the
hook sees what the optimizer uses. ``torch.amp.GradScaler("cpu")`` works on CPU in torch 2.13.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens.config import HistogramConfig, SaveConfig

STATS = ("min", "max", "mean", "std", "l2")


def _model(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)


def _clone(model: nn.Module) -> nn.Module:
    """A copy without the watched model's hooks (``copy.deepcopy`` would copy tensorlens' root
    hooks too, and calling the copy would then count as a forward of the watched model)."""
    dtype = next(model.parameters()).dtype
    clone = _model(dtype)
    clone.load_state_dict(model.state_dict())
    return clone


def _batch(i: int, rows: int = 6, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(rows, 5, generator=g).to(dtype), torch.randn(rows, 2, generator=g).to(dtype)


def _hook(mem: tl.MemoryBackend, tmp_path: object, collections: list[str]) -> tl.Hook:
    return tl.Hook(
        out_dir=str(tmp_path),
        save_config=SaveConfig(save_interval=1),
        include_collections=collections,
        histogram_config=HistogramConfig(bins=0),
        backends=[mem],
    )


def _check(scalars: dict[str, float], tensor: str, values: np.ndarray, rel: float) -> None:
    v = values.astype(np.float64).ravel()
    reference = {"min": v.min(), "max": v.max(), "mean": v.mean(), "std": v.std(), "l2": np.linalg.norm(v)}
    for stat in STATS:
        assert scalars[f"{tensor}/{stat}"] == pytest.approx(reference[stat], rel=rel, abs=1e-9), f"{tensor}/{stat}"


def _reference_grads(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], scale: float = 1.0,
                     autocast: bool = False) -> dict[str, np.ndarray]:
    """Gradients of the summed micro-batch losses (each divided by ``scale``), without any scaler."""
    total: dict[str, np.ndarray] = {}
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
            loss = nn.functional.mse_loss(out.float() if autocast else out, y) / scale
        grads = torch.autograd.grad(loss, list(model.parameters()))
        for (name, _), grad in zip(model.named_parameters(), grads, strict=True):
            total[name] = total.get(name, 0.0) + grad.double().numpy()
    return total


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_gradscaler_gradients_are_recorded_unscaled(tmp_path: object, autocast: bool) -> None:
    model = _model()
    reference_model = _clone(model)
    mem = tl.MemoryBackend()
    hook = _hook(mem, tmp_path, ["gradients"])
    hook.register_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    reference_optimizer = torch.optim.SGD(reference_model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    expected = []
    for i in range(3):
        x, y = _batch(i)
        expected.append(_reference_grads(reference_model, [(x, y)], autocast=autocast))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # unscales, then optimizer.step -> the hook's pre-hook
        scaler.update()
        optimizer.zero_grad()
        for p, g in zip(reference_model.parameters(), expected[-1].values(), strict=True):
            p.grad = torch.from_numpy(g).to(p.dtype)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    hook.close()
    assert [r.step for r in mem.records] == [0, 1, 2]
    for record, grads in zip(mem.records, expected, strict=True):
        scalars = record.scalar_dict()
        for name, values in grads.items():
            # a power-of-two scale is undone exactly: only float32 rounding of the two runs differs
            _check(scalars, f"gradients/{name}", values, rel=1e-5)
        assert scalars["gradients/0.weight/l2"] < 1e3  # not 4096 times too large


def test_a_step_the_scaler_skips_is_not_recorded(tmp_path: object) -> None:
    model = _model()
    mem = tl.MemoryBackend()
    hook = _hook(mem, tmp_path, ["gradients"])
    hook.register_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    last = None
    for i in range(3):
        x, y = _batch(i)
        loss = nn.functional.mse_loss(model(x), y)
        if i == 1:
            loss = loss * float("inf")  # Inf gradients: GradScaler skips optimizer.step
        else:
            last = _reference_grads(_clone(model), [(x, y)])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    hook.close()
    assert scaler.get_scale() == 2.0**11  # the skip happened
    # two optimizer steps, two records; steps count optimizer steps, not loop iterations
    assert [r.step for r in mem.records] == [0, 1]
    assert hook.global_step == 2
    for name, values in last.items():
        _check(mem.records[-1].scalar_dict(), f"gradients/{name}", values, rel=1e-5)


def test_accumulated_gradients_one_record_per_optimizer_step(tmp_path: object) -> None:
    model = _model(torch.float64)
    mem = tl.MemoryBackend()
    hook = _hook(mem, tmp_path, ["gradients", "activations"])
    hook.register_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    accumulate = 3
    expected, activations = [], []
    for step in range(2):
        micro = [_batch(10 * step + k, rows=4, dtype=torch.float64) for k in range(accumulate)]
        expected.append(_reference_grads(_clone(model), micro, scale=accumulate))
        with torch.no_grad():
            activations.append(np.concatenate([model[0](x).numpy() for x, _ in micro]))
        for x, y in micro:
            (nn.functional.mse_loss(model(x), y) / accumulate).backward()
        optimizer.step()
        optimizer.zero_grad()
    hook.close()
    assert [r.step for r in mem.records] == [0, 1]  # not one per micro-batch
    for record, grads, acts in zip(mem.records, expected, activations, strict=True):
        scalars = record.scalar_dict()
        for name, values in grads.items():
            _check(scalars, f"gradients/{name}", values, rel=1e-10)
        # the activations of all micro-batches of the step, merged
        assert scalars["activations/0/numel"] == accumulate * 4 * 8
        _check(scalars, "activations/0", acts, rel=1e-10)


def test_accumulation_with_gradscaler_records_the_unscaled_sum(tmp_path: object) -> None:
    model = _model()
    mem = tl.MemoryBackend()
    hook = _hook(mem, tmp_path, ["gradients"])
    hook.register_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    micro = [_batch(k, rows=4) for k in range(4)]
    expected = _reference_grads(_clone(model), micro, scale=len(micro))
    for x, y in micro:
        scaler.scale(nn.functional.mse_loss(model(x), y) / len(micro)).backward()
    scaler.step(optimizer)
    scaler.update()
    hook.close()
    assert len(mem.records) == 1
    for name, values in expected.items():
        _check(mem.records[0].scalar_dict(), f"gradients/{name}", values, rel=1e-5)
