"""Pruning: the same nodes kept as unit_scaling's own pruning functions keep, new graphs that lint."""

from __future__ import annotations

import operator

import pytest
import torch
from scale_models import Block, TinyLM
from torch import fx

import tensorlens.scales as S


def _graph(model: torch.nn.Module, x: torch.Tensor) -> fx.Graph:
    torch.manual_seed(0)
    tracked = S.track_scales(model)
    tracked(x).float().square().mean().backward()
    return tracked.scales_graph()


def _names(graph: fx.Graph) -> list[str]:
    return [n.meta["clean_name"] for n in graph.nodes]


@pytest.fixture
def lm_graph() -> fx.Graph:
    torch.manual_seed(0)
    return _graph(TinyLM(2), torch.randint(0, 50, (2, 5)))


def test_non_float_pruning_matches_unit_scaling(lm_graph: fx.Graph) -> None:
    from unit_scaling.transforms import prune_non_float_tensors as theirs

    before = _names(lm_graph)
    pruned = S.prune_non_float_tensors(lm_graph)
    pruned.lint()
    assert _names(pruned) == _names(theirs(lm_graph))  # their function reads our metadata
    assert _names(lm_graph) == before  # the argument is left as it was
    assert "ids" not in _names(pruned) and "layers.0.chunk" not in _names(pruned)
    chunk_0 = next(n for n in pruned.nodes if n.meta["clean_name"] == "layers.0.chunk.0")
    assert chunk_0.args[0].meta["clean_name"] == "layers.0.qkv.linear"  # rewired to the tuple's float input
    assert all(n.meta["outputs_float_tensor"] for n in pruned.nodes if n.op != "output")


def test_same_scale_pruning_matches_unit_scaling(lm_graph: fx.Graph) -> None:
    from unit_scaling.transforms import prune_same_scale_tensors as theirs

    graph = S.prune_non_float_tensors(lm_graph)
    ours = S.prune_same_scale_tensors(graph)
    ours.lint()
    assert _names(ours) == _names(theirs(graph))
    removed = set(_names(graph)) - set(_names(ours))
    # views and transposes keep their input's scale; adds, matmuls and linears have several float inputs
    assert {"layers.0.view", "layers.0.transpose", "layers.1.reshape"} <= removed
    assert not any(name.endswith(("add", "matmul", "linear", "softmax")) for name in removed)
    assert S.prune_same_scale_tensors(graph, rtol=0.0) is not graph


def test_same_scale_tolerance_and_the_input_rule() -> None:
    """A slice changes the scale a little: kept at a tight rtol, removed at a loose one."""

    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x[:, :-1] * x[:, :-1]).sum()

    torch.manual_seed(0)
    graph = S.prune_non_float_tensors(_graph(Net(), torch.randn(4, 50)))
    assert "getitem" in _names(S.prune_same_scale_tensors(graph, rtol=2**-16))
    assert "getitem" not in _names(S.prune_same_scale_tensors(graph, rtol=0.5))
    assert "mul" in _names(S.prune_same_scale_tensors(graph, rtol=1e9))  # two float inputs: never removed
    with pytest.raises(ValueError, match="Expected `rtol` to be a number >= 0"):
        S.prune_same_scale_tensors(graph, rtol=-1)


def test_selected_nodes_by_function_method_or_name() -> None:
    torch.manual_seed(0)
    graph = S.prune_non_float_tensors(_graph(Block(), torch.randn(2, 5, 32)))
    ops = [n.meta["op"] for n in graph.nodes]
    assert ops.count("view") == 3 and ops.count("reshape") == 1 and ops.count("add") == 2

    pruned = S.prune_selected_nodes(graph, targets=[torch.reshape, torch.Tensor.view])
    pruned.lint()
    left = [n.meta["op"] for n in pruned.nodes]
    assert "reshape" not in left and "view" not in left and left.count("transpose") == 5
    assert [n.meta["op"] for n in graph.nodes] == ops  # a new graph
    transpose = next(n for n in pruned.nodes if n.meta["op"] == "transpose")
    assert transpose.args[0].meta["clean_name"] == "chunk.0"  # the removed view's input

    no_adds = S.prune_selected_nodes(graph, targets=[operator.add])
    no_adds.lint()
    assert "add" not in [n.meta["op"] for n in no_adds.nodes]
    for node in no_adds.nodes:  # an add had two float inputs: its users get None, as in unit_scaling
        if node.meta["clean_name"] == "ln2.layer_norm":
            assert node.args[0] is None
    assert [n.meta["op"] for n in S.prune_selected_nodes(graph, ["softmax"]).nodes].count("softmax") == 0


def test_inplace_operator_targets() -> None:
    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            y += 1
            return y

    graph = _graph(Net(), torch.randn(3))
    assert "add_" in _names(graph)
    assert "add_" not in _names(S.prune_selected_nodes(graph, [operator.iadd]))
    assert "add_" in _names(S.prune_selected_nodes(graph, [operator.add]))


def test_arbitrary_graphs_and_bad_targets_fail_clearly(lm_graph: fx.Graph) -> None:
    plain = fx.symbolic_trace(torch.nn.Linear(2, 2)).graph
    for prune in (S.prune_non_float_tensors, S.prune_same_scale_tensors):
        with pytest.raises(ValueError, match="scales_graph"):
            prune(plain)
    with pytest.raises(ValueError, match="scales_graph"):
        S.prune_selected_nodes(plain, [torch.reshape])
    with pytest.raises(ValueError, match="Expected `targets`"):
        S.prune_selected_nodes(lm_graph, "reshape")
    with pytest.raises(TypeError, match="torch.fx.Graph"):
        S.prune_non_float_tensors(object())
