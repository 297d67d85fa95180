"""Training dynamics under ``torch.compile`` (backend ``aot_eager``): no graph break where the
activation path has none (docs/compile.md), correct values, and what is left out inside a
compiled graph (the per-sample gradient norms, which need tensor hooks)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import tensorlens as tl

BACKEND = "aot_eager"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _batch(step: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(step))


def _train(call: Any, model: nn.Module, steps: int) -> list[dict[str, np.ndarray]]:
    """Trains and returns, per step, the eager reference of what dynamics read."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        x = _batch(step)
        with torch.no_grad():
            h = model.fc1(x)
            values = {"fc1": h.numpy().copy(), "act": torch.relu(h).numpy().copy()}
        call(x).square().mean().backward()
        values["grads"] = np.concatenate([p.grad.numpy().ravel() for p in model.parameters()]).astype(np.float64)
        optimizer.step()
        optimizer.zero_grad()
        out.append(values)
    return out


def _breaks() -> int:
    return sum(counters["graph_break"].values())


def test_compile_then_watch_with_hook_guards_records_dynamics_without_a_graph_break(tmp_path: Any) -> None:
    """The recipe of docs/compile.md: the dynamics hooks of saved steps are compiled in, no graph
    break; unit statistics and output norms are recorded; the gradient norms are not (they would
    need a tensor hook inside the graph)."""
    model = Net()
    compiled = torch.compile(model, backend=BACKEND)
    mem = tl.MemoryBackend()
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        hook = tl.watch(compiled, backends=[mem], out_dir=str(tmp_path), save_interval=2, collections=["dynamics"], dynamics=True)
        reference = _train(compiled, model, 6)
        hook.close()
    assert _breaks() == 0
    assert counters["stats"]["unique_graphs"] <= 3
    assert [r.step for r in mem.records] == [0, 2, 4]
    for record in mem.records:
        s = record.scalar_dict()
        ref = reference[record.step]
        rates = (np.abs(ref["act"]) > 0).mean(axis=0)
        assert s["activations/act/dead_fraction"] == pytest.approx(float((rates == 0).mean()))
        assert s["activations/act/active_rate_mean"] == pytest.approx(float(rates.mean()), rel=1e-6)
        norms = np.linalg.norm(ref["fc1"].astype(np.float64), axis=1)  # before the in-place ReLU
        assert s["activations/fc1/sample_norm/mean"] == pytest.approx(norms.mean(), rel=1e-5)
        assert s["dynamics/global/grad_norm"] == pytest.approx(np.linalg.norm(ref["grads"]), rel=1e-5)
        assert not any(k.startswith(("activation_gradients/", "input_gradients/")) for k in s)  # documented


def test_watch_then_compile_fullgraph_keeps_one_graph(tmp_path: Any) -> None:
    """Parameters are read at the optimizer step, outside the graph: one graph, fullgraph works."""
    model = Net()
    mem = tl.MemoryBackend()
    hook = tl.watch(model, backends=[mem], out_dir=str(tmp_path), save_interval=2, collections=["dynamics"], dynamics=True)
    compiled = torch.compile(model, backend=BACKEND, fullgraph=True)
    reference = _train(compiled, model, 5)
    hook.close()
    assert _breaks() == 0
    assert counters["stats"]["unique_graphs"] == 1
    assert [r.step for r in mem.records] == [0, 2, 4]
    for record in mem.records[1:]:
        s = record.scalar_dict()
        assert s["dynamics/global/grad_norm"] == pytest.approx(np.linalg.norm(reference[record.step]["grads"]), rel=1e-5)
        assert "dynamics/fc1.weight/grad_cosine" in s


def test_eager_steps_still_record_gradient_norms(tmp_path: Any) -> None:
    """The same hook on an eager model records the io_grad norms: only compiled calls lack them."""
    model = Net()
    mem = tl.MemoryBackend()
    hook = tl.watch(model, backends=[mem], out_dir=str(tmp_path), save_interval=1, collections=["dynamics"], dynamics=True)
    _train(model, model, 1)
    hook.close()
    assert "activation_gradients/fc1/sample_norm/mean" in mem.records[0].scalar_dict()
    assert "input_gradients/fc2.0/sample_norm/mean" in mem.records[0].scalar_dict()
