"""``tl.track_scales``: unit_scaling's contract, checked against float64 references and unit_scaling itself."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from scale_models import (
    METRICS,
    Block,
    BranchNet,
    ConvNet,
    FunctionalMLP,
    InPlaceNet,
    TinyLM,
    assert_data_close,
    numpy_metrics,
)
from torch import fx, nn

import tensorlens.scales as S


def _by_name(graph: fx.Graph) -> dict[str, fx.Node]:
    return {n.meta["clean_name"]: n for n in graph.nodes}


def _check_against_reference(model: nn.Module, x: torch.Tensor, rtol: float = 1e-10) -> fx.Graph:
    """Track ``model`` on ``x``, run the written-out ``reference`` on a copy, compare every node in float64."""
    reference_model = copy.deepcopy(model)
    x_ref = x.clone().requires_grad_()
    tensors, out_ref = reference_model.reference(x_ref)
    out_ref.float().square().mean().backward()

    tracked = S.track_scales(model)
    out = tracked(x)
    out.float().square().mean().backward()
    graph = tracked.scales_graph()
    graph.lint()
    nodes = _by_name(graph)
    for name, tensor in tensors.items():
        metrics = nodes[name].meta["metrics"]
        assert_data_close(metrics.fwd, numpy_metrics(tensor), rtol, where=f"{name} fwd")
        assert_data_close(metrics.bwd, numpy_metrics(tensor.grad), rtol, where=f"{name} bwd")
    for name, param in reference_model.named_parameters():
        metrics = nodes[name].meta["metrics"]
        assert nodes[name].op == "get_attr" and nodes[name].meta["requires_grad"] is True
        assert_data_close(metrics.fwd, numpy_metrics(param), rtol, where=f"{name} fwd")
        assert_data_close(metrics.bwd, numpy_metrics(param.grad), rtol, where=f"{name} bwd")
    # the input: requires_grad was set on it, so the gradient reaching the first op is tracked
    assert x.requires_grad
    assert_data_close(nodes["x"].meta["metrics"].fwd, numpy_metrics(x_ref), rtol, where="x fwd")
    assert_data_close(nodes["x"].meta["metrics"].bwd, numpy_metrics(x_ref.grad), rtol, where="x bwd")
    return graph


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_functional_mlp_equals_float64_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = FunctionalMLP().to(dtype)
    graph = _check_against_reference(model, torch.randn(3, 8).to(dtype))
    ops = [n.meta["op"] for n in graph.nodes if n.op.startswith("call_")]
    assert ops == ["linear", "gelu", "sigmoid", "mul", "layer_norm", "add", "reshape", "t", "matmul", "add"]
    assert {n.meta["dtype"] for n in graph.nodes if n.op != "output"} == {str(dtype).removeprefix("torch.")}


def test_inplace_ops_record_the_value_after_each_op() -> None:
    """``out += x``, ``mul_``, ``out[:, 0] = 0``, ReLU(inplace=True): each node holds the tensor as it was
    right after its op, and the gradient of that value (tensor hooks fire for the version they saw)."""
    torch.manual_seed(0)
    graph = _check_against_reference(InPlaceNet(), torch.randn(5, 6))
    ops = [n.meta["op"] for n in graph.nodes if n.op.startswith("call_") and n.meta["outputs_float_tensor"]]
    assert ops == ["linear", "batch_norm", "add_", "mul_", "setitem", "relu", "linear"]


@pytest.mark.parametrize("positive", [True, False])
def test_graph_break_keeps_ops_on_both_sides(positive: bool) -> None:
    """A data-dependent branch and torch._dynamo.graph_break(): dynamo hands a backend one graph per piece
    (unit_scaling keeps the last); the eager recording has every op, the branch taken included."""
    torch.manual_seed(0)
    model = BranchNet()
    with torch.no_grad():
        model.fc1.bias.fill_(5.0 if positive else -5.0)
    x = torch.randn(3, 4)
    tracked = S.track_scales(model)
    tracked(x).square().mean().backward()
    nodes = _by_name(tracked.scales_graph())
    branch = "mul" if positive else "sub"
    for name in ["fc1.linear", "gelu", "sum", "gt", branch, "fc2.linear", "tanh", "fc3.linear"]:
        assert name in nodes, name
    assert ("sub" if positive else "mul") not in nodes
    assert nodes["gt"].meta["outputs_float_tensor"] is False and "metrics" not in nodes["gt"].meta

    # float64 reference of the ops after the break
    ref = copy.deepcopy(model)
    h1 = F.gelu(ref.fc1(x.clone().requires_grad_()))
    h2 = h1 * 2.0 if positive else h1 - 1.0
    h3 = torch.tanh(ref.fc2(h2))
    for t in (h1, h2, h3):
        t.retain_grad()
    ref.fc3(h3).square().mean().backward()
    for name, t in (("gelu", h1), (branch, h2), ("tanh", h3)):
        assert_data_close(nodes[name].meta["metrics"].fwd, numpy_metrics(t), where=name)
        assert_data_close(nodes[name].meta["metrics"].bwd, numpy_metrics(t.grad), where=name)


def _unit_scaling_param_name(name: str) -> str:
    """``layers.0.qkv.weight`` as dynamo lifts it: ``self_modules_layers_modules_0_modules_qkv_parameters_weight``."""
    *modules, leaf = name.split(".")
    kind = "buffers" if leaf.startswith("running_") else "parameters"
    return "self_" + "".join(f"modules_{m}_" for m in modules) + f"{kind}_{leaf}"


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    return node.target.__name__


CASES = {
    "mlp": (FunctionalMLP, lambda: torch.randn(3, 8)),
    "transformer_block": (Block, lambda: torch.randn(2, 5, 32)),
    "conv": (ConvNet, lambda: torch.randn(2, 3, 8, 8)),
    "lm": (lambda: TinyLM(1), lambda: torch.randint(0, 50, (2, 5))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_nodes_and_values_as_unit_scaling(case: str) -> None:
    """Against unit_scaling's own track_scales (dynamo): the same ops in the same order, the same
    parameters and inputs, the same metrics (theirs in float32, hence the tolerance)."""
    from unit_scaling.transforms import prune_non_float_tensors as us_prune
    from unit_scaling.transforms import track_scales as us_track

    factory, make_input = CASES[case]
    torch.manual_seed(0)
    model, x = factory(), make_input()
    theirs_model, ours_model = copy.deepcopy(model), copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # their std of one element warns
        theirs = us_track(theirs_model)
        theirs(x.clone()).float().square().mean().backward()
        their_graph = us_prune(theirs.scales_graph())
    ours = S.track_scales(ours_model)
    ours(x.clone()).float().square().mean().backward()
    our_graph = S.prune_non_float_tensors(ours.scales_graph())

    their_ops = [n for n in their_graph.nodes if n.op.startswith("call_")]
    our_ops = [n for n in our_graph.nodes if n.op.startswith("call_")]
    assert [_op_name(n) for n in their_ops] == [n.meta["op"] for n in our_ops]
    pairs = list(zip(their_ops, our_ops, strict=True))
    their_inputs = {n.meta["clean_name"]: n for n in their_graph.nodes if n.op == "placeholder"}
    our_inputs = {_unit_scaling_param_name(n.meta["clean_name"]) if n.op == "get_attr" else n.meta["clean_name"]: n
                  for n in our_graph.nodes if n.op in ("placeholder", "get_attr")}
    assert set(their_inputs) == set(our_inputs)
    pairs += [(their_inputs[k], our_inputs[k]) for k in their_inputs]
    for their, our in pairs:
        assert their.meta["requires_grad"] == our.meta["requires_grad"], our.meta["clean_name"]
        for direction in ("fwd", "bwd"):
            a, b = getattr(their.meta["metrics"], direction), getattr(our.meta["metrics"], direction)
            assert (a is None) == (b is None), (our.meta["clean_name"], direction)
            if a is None:
                continue
            for name in METRICS:
                x_a, x_b = getattr(a, name), getattr(b, name)
                # a mean near zero (gradients through a layer norm) is float32 rounding noise in theirs
                abs_tol = 1e-5 * b.mean_abs if name == "abs_mean" else 1e-30
                assert (math.isnan(x_a) and math.isnan(x_b)) or math.isclose(x_a, x_b, rel_tol=1e-4, abs_tol=abs_tol), (
                    our.meta["clean_name"], direction, name, x_a, x_b)


def test_names_and_metadata() -> None:
    torch.manual_seed(0)
    tracked = S.track_scales(TinyLM(2))
    ids = torch.randint(0, 50, (2, 5))
    tracked(ids).square().mean().backward()
    graph = tracked.scales_graph()
    graph.lint()
    nodes = _by_name(graph)
    for name in ["emb.embedding", "layers.0.ln1.layer_norm", "layers.0.qkv.linear", "layers.0.chunk",
                 "layers.0.chunk.0", "layers.0.chunk.2", "layers.0.view_2", "layers.1.softmax", "layers.1.gelu",
                 "layers.1.add_1", "ln.layer_norm", "head.linear", "layers.1.fc2.weight", "emb.weight"]:
        assert name in nodes, name
    assert nodes["ids"].op == "placeholder" and nodes["ids"].meta["outputs_float_tensor"] is False
    assert not ids.requires_grad  # integer inputs are left alone
    assert nodes["layers.0.chunk"].meta["outputs_float_tensor"] is False  # the tuple
    assert nodes["layers.0.chunk.1"].args == (nodes["layers.0.chunk"], 1)
    assert {n.meta["clean_name"] for n in graph.nodes if n.meta["requires_grad"]} == {
        name for name, _ in tracked.module.named_parameters()}
    assert all(("metrics" in n.meta) == n.meta["outputs_float_tensor"] for n in graph.nodes)
    assert list(graph.nodes)[-1].op == "output" and list(graph.nodes)[-1].args == (nodes["head.linear"],)


def test_model_is_shared_not_copied_and_left_untouched() -> None:
    """No copy (training through the tracked module trains the model) and nothing set on the user's
    modules: no attribute, no hook left after forward and backward."""
    torch.manual_seed(0)
    model = TinyLM(1)

    def snapshot() -> list[tuple[str, list[str], int, int, int]]:
        return [(name, sorted(vars(m)), len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
                for name, m in model.named_modules()]

    before = snapshot()
    tracked = S.track_scales(model)
    tracked(torch.randint(0, 50, (2, 5))).sum().backward()
    tracked.scales_graph()
    assert snapshot() == before
    assert tracked.module is model and tracked.layers is model.layers
    assert [p for p in tracked.parameters()] == [p for p in model.parameters()]
    assert all(p._backward_hooks in (None, {}) or len(p._backward_hooks) == 1 for p in model.parameters())
    assert torch.overrides._get_current_function_mode() is None
    tracked(torch.randint(0, 50, (2, 5)))  # the next forward removes the previous forward's tensor hooks
    assert S.track_scales(tracked) is tracked


def test_no_backward_no_grad_and_repeated_modules() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    tracked = S.track_scales(model)
    x = torch.randn(2, 4)
    tracked(x)
    nodes = _by_name(tracked.scales_graph())
    assert {"0.linear", "0.linear_1", "1.relu"} <= set(nodes)  # a module called twice: a counter, same path
    assert all(n.meta["metrics"].bwd is None for n in nodes.values() if "metrics" in n.meta)
    h = F.linear(x, shared.weight, shared.bias)
    assert_data_close(nodes["0.linear"].meta["metrics"].fwd, numpy_metrics(h))
    assert_data_close(nodes["0.linear_1"].meta["metrics"].fwd, numpy_metrics(F.linear(h.relu(), shared.weight,
                                                                                         shared.bias)))
    with torch.no_grad():
        tracked(torch.randn(2, 4))
    assert all(n.meta["metrics"].bwd is None for n in tracked.scales_graph().nodes if "metrics" in n.meta)


def test_outputs_in_containers_and_paused_ops() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor, scale: float = 1.0) -> dict[str, object]:
            y = self.fc(x) * scale
            with S.paused():
                unseen = y.detach().abs().max()  # tensorlens' own statistics: never nodes
            return {"y": y, "pair": (y.argmax(-1), y.exp()), "unseen": unseen}

    tracked = S.track_scales(Net())
    with pytest.warns(RuntimeWarning, match="1 output tensor.* not produced by a recorded op"):
        out = tracked(torch.randn(2, 3), scale=2.0)  # `unseen` is an output no recorded op produced
    graph = tracked.scales_graph()
    nodes = _by_name(graph)
    assert set(nodes) == {"x", "fc.weight", "fc.bias", "fc.linear", "mul", "argmax", "exp", "output"}
    output = list(graph.nodes)[-1]
    assert output.args == ({"y": nodes["mul"], "pair": (nodes["argmax"], nodes["exp"]), "unseen": None},)
    assert set(out) == {"y", "pair", "unseen"}


def test_scales_graph_before_any_forward_and_bad_arguments() -> None:
    with pytest.raises(RuntimeError, match="call the tracked module first"):
        S.track_scales(nn.Linear(2, 2)).scales_graph()
    with pytest.raises(ValueError, match="Expected `module` to be a torch.nn.Module"):
        S.track_scales(lambda x: x)
    with pytest.raises(ValueError, match="TorchScript"):
        S.track_scales(torch.jit.script(nn.Linear(2, 2)))


def test_hugging_face_model_with_keyword_inputs_and_a_model_output() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    tracked = S.track_scales(transformers.GPT2LMHeadModel(config))
    ids = torch.randint(0, 100, (2, 8))
    out = tracked(input_ids=ids, labels=ids)
    out.loss.backward()
    graph = tracked.scales_graph()
    graph.lint()
    nodes = _by_name(graph)
    assert nodes["input_ids"].op == "placeholder"
    for name in ["transformer.wte.embedding", "transformer.h.0.attn.c_attn.addmm", "transformer.h.1.mlp.act.mul",
                 "transformer.ln_f.layer_norm", "lm_head.linear", "cross_entropy"]:
        assert name in nodes, name
        assert nodes[name].meta["metrics"].bwd is not None, name
    output = list(graph.nodes)[-1]
    assert output.args[0]["loss"] is nodes["cross_entropy"]  # the ModelOutput's structure, tensors as nodes


def test_activation_checkpointing_and_autocast() -> None:
    """Recomputation in backward records nothing twice; autocast's bf16 outputs are nodes in bf16."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(checkpoint(lambda y: torch.relu(self.a(y)), x, use_reentrant=False))

    torch.manual_seed(0)
    model = Net()
    tracked = S.track_scales(model)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tracked(x)
    out.float().square().mean().backward()
    nodes = _by_name(tracked.scales_graph())
    assert [n for n in nodes if n.endswith(("linear", "relu"))] == ["a.linear", "relu", "b.linear"]
    assert nodes["relu"].meta["dtype"] == "bfloat16" and nodes["a.weight"].meta["dtype"] == "float32"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.relu(F.linear(x, model.a.weight, model.a.bias))
    h.retain_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model.b(h)
    ref.float().square().mean().backward()
    assert_data_close(nodes["relu"].meta["metrics"].fwd, numpy_metrics(h))
    assert_data_close(nodes["relu"].meta["metrics"].bwd, numpy_metrics(h.grad))
