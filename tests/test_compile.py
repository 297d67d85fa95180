"""tensorlens with ``torch.compile``: watching then compiling, compiling then watching, no graph break.

Weights and gradients are read at the optimizer step, outside any compiled graph, so they add no
graph break and no recompilation whatever the order. The root module's forward hooks (mode
detection, attaching activation hooks) do nothing while dynamo traces them, so they put no guard
on tensorlens' step counters into the graph either. Activation hooks are attached per saved step;
what dynamo does with them is documented in ``docs/compile.md`` and pinned down below.

Backend ``aot_eager`` keeps the tests fast and exercises AOTAutograd (the backward graph) too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import tensorlens as tl

BACKEND = "aot_eager"
STEPS = 4


class Net(nn.Module):
    """A user-defined module: dynamo treats it differently from ``torch.nn`` containers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def _sequential() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


MODELS = {"custom": _net, "sequential": _sequential}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _batch(step: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(step))


def _train(call: Callable[[torch.Tensor], torch.Tensor], params: nn.Module, steps: int = STEPS) -> None:
    optimizer = torch.optim.SGD(params.parameters(), lr=0.1)
    for step in range(steps):
        call(_batch(step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _eager_reference(factory: Callable[[], nn.Module], steps: int = STEPS) -> list[dict[str, np.ndarray]]:
    """Weights, gradients and first-layer outputs of each step, without tensorlens or compile."""
    model = factory()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        x = _batch(step)
        first = next(model.children())
        with torch.no_grad():
            values = {"first_output": first(x).numpy().copy()}
        model(x).square().mean().backward()
        for name, p in model.named_parameters():
            kind = "biases" if name.endswith("bias") else "weights"
            values[f"{kind}/{name}"] = p.detach().numpy().copy()
            values[f"gradients/{name}"] = p.grad.numpy().copy()
        out.append(values)
        optimizer.step()
        optimizer.zero_grad()
    return out


def _check_parameters(mem: tl.MemoryBackend, reference: list[dict[str, np.ndarray]]) -> None:
    assert [r.step for r in mem.records] == list(range(len(reference)))
    for record, values in zip(mem.records, reference, strict=True):
        scalars = record.scalar_dict()
        assert not any("_orig_mod" in key for key in scalars)  # names are the model's own
        for tensor, v in values.items():
            if tensor == "first_output":
                continue
            v = v.astype(np.float64)
            assert scalars[f"{tensor}/l2"] == pytest.approx(np.linalg.norm(v), rel=1e-5)
            assert scalars[f"{tensor}/mean"] == pytest.approx(v.mean(), rel=1e-4, abs=1e-7)
            assert scalars[f"{tensor}/max"] == pytest.approx(v.max(), rel=1e-5, abs=1e-7)


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def _watch(model: nn.Module, mem: tl.MemoryBackend, tmp_path: object, **kwargs: object) -> tl.Hook:
    return tl.watch(model, backends=[mem], save_interval=1, out_dir=str(tmp_path), **kwargs)


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_watch_then_compile(tmp_path: object, model_name: str, how: str) -> None:
    factory = MODELS[model_name]
    model = factory()
    mem = tl.MemoryBackend()
    hook = _watch(model, mem, tmp_path)
    if how == "torch.compile":
        call = torch.compile(model, backend=BACKEND)
    else:
        model.compile(backend=BACKEND)
        call = model
    _train(call, model)
    hook.close()
    _check_parameters(mem, _eager_reference(factory))
    assert _graph_breaks() == 0
    # one graph for all steps: the root hooks put no guard on tensorlens' step counters
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("model_name", list(MODELS))
def test_compile_then_watch(tmp_path: object, model_name: str) -> None:
    factory = MODELS[model_name]
    model = factory()
    compiled = torch.compile(model, backend=BACKEND)
    mem = tl.MemoryBackend()
    hook = _watch(compiled, mem, tmp_path)  # the wrapper is looked through: no "_orig_mod." in names
    _train(compiled, model)
    hook.close()
    _check_parameters(mem, _eager_reference(factory))
    assert _graph_breaks() == 0
    assert counters["stats"]["unique_graphs"] == 1


def test_fullgraph_compiles_with_the_hook_attached(tmp_path: object) -> None:
    model = _net()
    mem = tl.MemoryBackend()
    hook = _watch(model, mem, tmp_path)
    compiled = torch.compile(model, backend=BACKEND, fullgraph=True)  # a graph break would raise
    _train(compiled, model)
    hook.close()
    _check_parameters(mem, _eager_reference(_net))


@pytest.mark.parametrize("model_name", list(MODELS))
def test_explain_reports_no_graph_break(tmp_path: object, model_name: str) -> None:
    model = MODELS[model_name]()
    mem = tl.MemoryBackend()
    hook = _watch(model, mem, tmp_path)
    explanation = torch._dynamo.explain(model)(_batch(0))
    hook.close()
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1


def test_eager_calls_still_mark_eval_steps(tmp_path: object) -> None:
    """Root hooks are no-ops only while dynamo traces them; an eager call still opens an eval step."""
    model = _net()
    mem = tl.MemoryBackend()
    hook = _watch(model, mem, tmp_path, activations=True)
    compiled = torch.compile(model, backend=BACKEND)
    _train(compiled, model, steps=1)
    model.eval()
    with torch.no_grad():
        model(_batch(9))  # eager: hooks run, the eval step is recorded with its activations
    hook.close()
    evals = [r for r in mem.records if str(r.mode) == "eval"]
    assert len(evals) == 1 and "activations/fc1/mean" in evals[0].scalar_dict()


def test_activations_compile_then_watch_with_hook_guards(tmp_path: object) -> None:
    """The recipe of docs/compile.md: with dynamo guarding module hooks, activation hooks
    attached on saved steps are compiled in (one extra graph) and every saved step records them."""
    model = _net()
    compiled = torch.compile(model, backend=BACKEND)
    mem = tl.MemoryBackend()
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        hook = tl.watch(compiled, backends=[mem], out_dir=str(tmp_path), activations=True, save_interval=2)
        _train(compiled, model, steps=8)
        hook.close()
    reference = _eager_reference(_net, steps=8)
    assert [r.step for r in mem.records] == [0, 2, 4, 6]
    for record in mem.records:
        scalars = record.scalar_dict()
        expected = reference[record.step]["first_output"].astype(np.float64)
        assert scalars["activations/fc1/mean"] == pytest.approx(expected.mean(), rel=1e-5, abs=1e-7)
        assert scalars["activations/fc1/l2"] == pytest.approx(np.linalg.norm(expected), rel=1e-5)
    assert _graph_breaks() == 0
    assert counters["stats"]["unique_graphs"] <= 3  # with and without the hooks, not one per step


def test_activations_on_compiled_modules_by_default(tmp_path: object) -> None:
    """What happens without that setting (documented in docs/compile.md): dynamo does not guard
    on module hooks, so hooks attached after a graph was compiled without them do not fire.
    Parameters and gradients are unaffected; activations recorded are always correct."""
    model = _net()
    compiled = torch.compile(model, backend=BACKEND)
    mem = tl.MemoryBackend()
    hook = tl.watch(compiled, backends=[mem], out_dir=str(tmp_path), activations=True, save_interval=2)
    _train(compiled, model, steps=6)
    hook.close()
    reference = _eager_reference(_net, steps=6)
    assert [r.step for r in mem.records] == [0, 2, 4]
    # the first saved step compiles the graph with the hooks in it
    assert "activations/fc1/mean" in mem.records[0].scalar_dict()
    for record in mem.records:
        scalars = record.scalar_dict()
        assert "gradients/fc1.weight/l2" in scalars
        if "activations/fc1/mean" in scalars:
            expected = reference[record.step]["first_output"].astype(np.float64)
            assert scalars["activations/fc1/mean"] == pytest.approx(expected.mean(), rel=1e-5, abs=1e-7)
    assert _graph_breaks() == 0


def test_watch_then_compile_records_no_activations_inside_the_graph(tmp_path: object) -> None:
    """Watched first, the root hooks are traced into the graph and stay silent there, so the
    activation hooks are never attached from a compiled call (docs/compile.md); the step's
    weights and gradients are recorded as usual."""
    model = _net()
    mem = tl.MemoryBackend()
    hook = _watch(model, mem, tmp_path, activations=True)
    compiled = torch.compile(model, backend=BACKEND)
    _train(compiled, model, steps=2)
    hook.close()
    assert [r.step for r in mem.records] == [0, 1]
    for record in mem.records:
        assert not any(key.startswith("activations/") for key in record.scalar_dict())
        assert "gradients/fc2.weight/l2" in record.scalar_dict()
    assert _graph_breaks() == 0
    assert counters["stats"]["unique_graphs"] == 1


class _Summarized(nn.Module):
    """Calls ``tl.summarize_*`` and its loss module inside ``forward``, so both get compiled."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)
        self.criterion = nn.MSELoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        tl.summarize_tensor("fc_out", out)
        tl.summarize_scalar("out_mean", out.mean())
        return self.criterion(out, y)


def test_summaries_and_losses_inside_a_compiled_forward(tmp_path: object) -> None:
    """No graph break and one graph: while traced they keep the value instead of reading the step
    counters (which would recompile every step); unsaved steps drop it at the boundary."""
    model = _Summarized()
    reference = _Summarized()
    compiled = torch.compile(model, backend=BACKEND)
    mem = tl.MemoryBackend()
    hook = tl.watch(compiled, criterion=model.criterion, backends=[mem], out_dir=str(tmp_path), save_interval=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = {}
    for step in range(6):
        x, y = _batch(step), _batch(100 + step)[:, :3]
        with torch.no_grad():
            out = reference.fc(x)
            expected[step] = (out.numpy().astype(np.float64), nn.functional.mse_loss(out, y).item())
        compiled(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        nn.functional.mse_loss(reference.fc(x), y).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    hook.close()
    assert [r.step for r in mem.records] == [0, 2, 4]
    for record in mem.records:
        scalars = record.scalar_dict()
        values, loss = expected[record.step]
        assert scalars["summaries/fc_out/numel"] == values.size  # this step's call only
        assert scalars["summaries/fc_out/mean"] == pytest.approx(values.mean(), rel=1e-5, abs=1e-7)
        assert scalars["summaries/out_mean"] == pytest.approx(values.mean(), rel=1e-5, abs=1e-7)
        assert scalars["losses/mseloss"] == pytest.approx(loss, rel=1e-5)
    assert _graph_breaks() == 0
    assert counters["stats"]["unique_graphs"] == 1
