"""``ScaleCapture`` driven by hand as the Hook will drive it: several steps, saved and unsaved."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from scale_models import METRICS, FunctionalMLP, TinyLM, assert_data_close, numpy_metrics
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tensorlens.scales as S


class Driver:
    """What the Hook does: root forward pre-hook and forward hook (always_call) around saved steps."""

    def __init__(self, model: nn.Module, capture: S.ScaleCapture, roots: object = None) -> None:
        self.model, self.capture, self.saving = model, capture, False
        self.roots = roots if roots is not None else model
        self.handles = [
            model.register_forward_pre_hook(self.pre, with_kwargs=True),
            model.register_forward_hook(self.post, with_kwargs=True, always_call=True),
        ]

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.saving and not torch.compiler.is_compiling():
            self.capture.start(self.roots, root=module, args=args, kwargs=kwargs)

    def post(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        if self.saving and not torch.compiler.is_compiling():
            self.capture.stop(output)


def _instrumentation(model: nn.Module) -> tuple[object, list[int], list[object]]:
    """What a plain step must not carry: a torch function mode, module hooks beyond the driver's, tensor hooks."""
    hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    tensor_hooks = [p._backward_hooks for p in model.parameters() if p._backward_hooks]
    return torch.overrides._get_current_function_mode(), hooks, tensor_hooks


def test_saved_steps_record_float64_metrics_and_plain_steps_run_the_plain_model() -> None:
    torch.manual_seed(0)
    model = FunctionalMLP()
    capture = S.ScaleCapture()
    driver = Driver(model, capture)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen_modes: list[object] = []
    model.norm.register_forward_pre_hook(lambda m, a: seen_modes.append(torch.overrides._get_current_function_mode()))
    plain = _instrumentation(model)
    names_per_step = []
    for step in range(6):
        driver.saving = step % 3 == 0
        x = torch.randn(5, 8)
        if driver.saving:  # float64 reference of this step: same parameters, a copy of the model
            reference = copy.deepcopy(model)
            tensors, out_ref = reference.reference(x)
            out_ref.square().mean().backward()
        model(x).square().mean().backward()
        if driver.saving:
            metrics = capture.collect()
            names_per_step.append(sorted(metrics))
            for name, tensor in tensors.items():
                got = {m: metrics[f"scales/fwd/{name}"][m].item() for m in METRICS}
                assert_data_close(S.Metrics.Data(**got | {"numel": int(got["numel"])}), numpy_metrics(tensor),
                                  where=f"step {step} {name}")
                got = {m: metrics[f"scales/bwd/{name}"][m].item() for m in METRICS}
                assert_data_close(S.Metrics.Data(**got | {"numel": int(got["numel"])}), numpy_metrics(tensor.grad),
                                  where=f"step {step} {name} grad")
            for name, param in reference.named_parameters():
                assert math.isclose(metrics[f"scales/bwd/{name}"]["abs_max"].item(),
                                    param.grad.abs().max().item(), rel_tol=1e-12)
            assert "scales/bwd/x" not in metrics  # input_gradients=False: the user's input is left alone
            assert not x.requires_grad
        else:
            assert seen_modes[-1] is None
        assert _instrumentation(model) == plain
        optimizer.step()
        optimizer.zero_grad()
    assert seen_modes[0] is not None and seen_modes[3] is not None
    assert names_per_step[0] == names_per_step[1]  # stable names across steps
    assert all(v.dtype == torch.float64 and v.dim() == 0 for m in metrics.values() for v in m.values())


def test_gradient_accumulation_merges_micro_batches_exactly() -> None:
    torch.manual_seed(0)
    model = FunctionalMLP()
    capture = S.ScaleCapture()
    driver = Driver(model, capture)
    driver.saving = True
    xs = [torch.randn(4, 8), torch.randn(6, 8)]
    reference = copy.deepcopy(model)
    refs = []
    for x in xs:
        tensors, out = reference.reference(x)
        out.square().mean().backward()
        refs.append(tensors)
        model(x).square().mean().backward()
    metrics = capture.collect()
    for name in ("fc1.linear", "gelu", "norm.layer_norm", "add_1"):
        whole = torch.cat([refs[0][name].detach().reshape(-1), refs[1][name].detach().reshape(-1)])
        grads = torch.cat([refs[0][name].grad.reshape(-1), refs[1][name].grad.reshape(-1)])
        for direction, tensor in (("fwd", whole), ("bwd", grads)):
            got = {m: metrics[f"scales/{direction}/{name}"][m].item() for m in METRICS}
            assert_data_close(S.Metrics.Data(**got | {"numel": int(got["numel"])}), numpy_metrics(tensor),
                              rtol=1e-12, where=f"{direction} {name}")


class NoHostSync(TorchDispatchMode):
    """Fails on the ops that copy a device value to the host (``.item()``, ``bool(tensor)``, ``.tolist()``)."""

    SYNCS = {"_local_scalar_dense", "is_nonzero", "equal"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func.__name__.split(".")[0] in self.SYNCS:
            raise AssertionError(f"host sync: {func}")
        return func(*args, **(kwargs or {}))


def test_a_saved_step_makes_no_host_sync() -> None:
    torch.manual_seed(0)
    model = TinyLM(1)
    capture = S.ScaleCapture()
    driver = Driver(model, capture)
    driver.saving = True
    ids = torch.randint(0, 50, (2, 5))
    with NoHostSync():
        model(ids).square().mean().backward()
        metrics = capture.collect()
    assert len(metrics) > 40 and "scales/bwd/layers.0.attn" not in metrics
    assert metrics["scales/fwd/layers.0.softmax"]["abs_max"].item() <= 1.0


def test_graph_and_plot_of_the_last_step(tmp_path) -> None:
    torch.manual_seed(0)
    model = TinyLM(1)
    capture = S.ScaleCapture(parameters=False)
    with pytest.raises(RuntimeError, match="no step collected"):
        capture.graph()
    driver = Driver(model, capture)
    driver.saving = True
    model(torch.randint(0, 50, (2, 5))).square().mean().backward()
    metrics = capture.collect()
    assert not any(k.endswith(".weight") or k.endswith(".bias") for k in metrics)
    graph = capture.graph()
    graph.lint()
    for node in graph.nodes:
        if "metrics" in node.meta:
            key = node.meta["clean_name"]
            assert node.meta["metrics"].fwd.abs_max == metrics[f"scales/fwd/{key}"]["abs_max"].item()
            assert node.meta["metrics"].bwd.mean_abs == metrics[f"scales/bwd/{key}"]["mean_abs"].item()
    png = S.render_scales_png(S.prune_same_scale_tensors(S.prune_non_float_tensors(graph)))
    assert png.startswith(b"\x89PNG")


def test_several_roots_are_named_by_their_prefix() -> None:
    torch.manual_seed(0)
    student, teacher = nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    capture = S.ScaleCapture()
    x = torch.randn(2, 3)
    roots = {"student": student, "teacher": teacher}
    capture.start(roots, root=student, args=(x,))
    out = student(x)
    capture.stop(out)
    capture.start(roots, root=teacher, args=(out,))
    out2 = teacher(out)
    capture.stop(out2)
    out2.sum().backward()
    metrics = capture.collect()
    assert {k.split("/", 2)[2] for k in metrics} == {
        "input", "student.weight", "student.bias", "student.linear", "teacher.0.weight", "teacher.0.bias",
        "teacher.0.linear", "teacher.1.tanh"}
    assert "scales/bwd/input" in metrics  # the teacher's input is the student's output: it has a gradient


def test_paused_exception_in_forward_and_bad_arguments() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            with S.paused():
                F.relu(y).sum()  # what tensorlens' own activation statistics look like: not a node
            if x.shape[0] == 1:
                raise ValueError("boom")
            return y

    model = Net()
    capture = S.ScaleCapture()
    driver = Driver(model, capture)
    driver.saving = True
    with pytest.raises(ValueError, match="boom"):
        model(torch.randn(1, 3))
    assert torch.overrides._get_current_function_mode() is None and not capture.capturing
    model(torch.randn(2, 3))
    assert sorted(k.split("/", 2)[2] for k in capture.collect() if k.startswith("scales/fwd/")) == [
        "fc.bias", "fc.linear", "fc.weight", "x"]
    with pytest.raises(ValueError, match="Expected `roots`"):
        capture.start([object()])
    with pytest.raises(ValueError, match="Expected `input_gradients`"):
        S.ScaleCapture(input_gradients="yes")


def test_warns_once_when_the_ops_cannot_be_seen() -> None:
    scripted = torch.jit.script(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    capture = S.ScaleCapture()
    with pytest.warns(RuntimeWarning, match="not produced by any recorded op"):
        capture.start(scripted, root=scripted, args=(torch.randn(2, 3),))
        capture.stop(scripted(torch.randn(2, 3)))
    assert not any(k.endswith((".linear", ".relu")) for k in capture.collect())


def test_input_gradients_and_close() -> None:
    model = nn.Linear(3, 3)
    capture = S.ScaleCapture(input_gradients=True)
    x = torch.randn(2, 3)
    capture.start(model, root=model, args=(x,))
    out = model(x)
    capture.stop(out)
    out.sum().backward()
    assert x.requires_grad and "scales/bwd/input" in capture.collect()
    capture.start(model, root=model, args=(x,))
    capture.close()  # drops the step, leaves nothing behind
    assert torch.overrides._get_current_function_mode() is None and capture.collect() == {}


def test_collect_table_is_the_same_numbers_in_one_tensor() -> None:
    torch.manual_seed(0)
    model = FunctionalMLP()
    capture = S.ScaleCapture()
    driver = Driver(model, capture)
    driver.saving = True
    x = torch.randn(3, 8)
    model(x).sum().backward()
    keys, table = capture.collect_table()
    assert table.shape == (len(keys), 6) and table.dtype == torch.float64
    driver.saving = True
    model(x).sum().backward()
    metrics = capture.collect()  # the same step again: the same numbers, as 0-d views
    assert list(metrics) == keys
    for i, key in enumerate(keys):
        assert [metrics[key][m].item() for m in METRICS] == table[i].tolist()
    assert capture.collect_table()[1].shape == (0, 6)  # nothing recorded since


def test_a_collected_step_draws_on_another_thread_from_the_engines_host_copy() -> None:
    """The Hook's plot path: the engine copies ``step.table`` to the host with the rest of the step;
    the dispatcher thread builds the graph from that copy while training records the next step."""
    import threading

    torch.manual_seed(0)
    model = FunctionalMLP()
    capture = S.ScaleCapture()
    driver = Driver(model, capture)
    driver.saving = True
    model(torch.randn(3, 8)).sum().backward()
    step = capture.collect_step()
    host = step.table.cpu()  # the engine's one host copy
    graphs: list[torch.fx.Graph] = []
    pngs: list[bytes] = []

    def draw() -> None:
        graphs.append(step.graph(host))
        pngs.append(S.render_scales_png(graphs[0]))

    worker = threading.Thread(target=draw)
    worker.start()
    model(torch.randn(3, 8)).sum().backward()  # the next saved step, recording meanwhile
    worker.join()
    assert capture.collect_step().keys == step.keys  # stable names
    rows = {key: host[i].tolist() for i, key in enumerate(step.keys)}
    for node in graphs[0].nodes:
        if "metrics" in node.meta:
            assert node.meta["metrics"].fwd.abs_max == rows[f"scales/fwd/{node.meta['clean_name']}"][3]
    assert pngs[0].startswith(b"\x89PNG")
