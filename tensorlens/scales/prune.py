"""Pruning a scales graph down to the nodes worth looking at, as unit_scaling's functions do.

Each function returns a new graph (the argument is left as it was) that still passes
``graph.lint()``. A removed node's users are rewired to its single floating-point input when it
has exactly one, otherwise the argument becomes ``None`` (as in unit_scaling).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from typing import Any

from torch import fx
from torch.fx.node import map_arg

from tensorlens.scales.trace import INPLACE_OPERATORS, op_name

_NOT_A_SCALES_GRAPH = (
    "Expected a graph from tracked.scales_graph() (tl.track_scales) or ScaleCapture.graph(): "
    "nodes of an arbitrary fx graph carry no metadata about the tensors they output, so it cannot be pruned"
)


def _float_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's arguments (in args and kwargs, each occurrence: ``x * x`` has two) that output a
    floating-point tensor."""
    found: list[fx.Node] = []
    map_arg((node.args, node.kwargs), lambda a: found.append(a) if a.meta.get("outputs_float_tensor", False) else None)
    return found


def _check(graph: fx.Graph) -> None:
    if not isinstance(graph, fx.Graph):
        raise TypeError(f"Expected `graph` to be a torch.fx.Graph, but got {graph!r}")
    first = next(iter(graph.nodes), None)
    if first is not None and "clean_name" not in first.meta:
        raise ValueError(_NOT_A_SCALES_GRAPH)


def _remove(graph: fx.Graph, node: fx.Node, replacement: fx.Node | None) -> None:
    for user in list(node.users):
        user.args = map_arg(user.args, lambda a: replacement if a is node else a)
        user.kwargs = map_arg(user.kwargs, lambda a: replacement if a is node else a)
    graph.erase_node(node)


def _replacement(node: fx.Node) -> fx.Node | None:
    inputs = _float_inputs(node)
    return inputs[0] if len(inputs) == 1 else None


def prune_non_float_tensors(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` without the nodes that output no floating-point tensor (integer and
    boolean tensors, tuples).

    >>> pruned = prune_non_float_tensors(tracked.scales_graph())   # doctest: +SKIP
    """
    _check(graph)
    graph = copy.deepcopy(graph)
    for node in list(graph.nodes):
        if node.op != "output" and not node.meta.get("outputs_float_tensor", False):
            _remove(graph, node, _replacement(node))
    graph.lint()
    return graph


def _same_scale(a: Any, b: Any, rtol: float) -> bool:
    """unit_scaling's test: ``mean_abs`` equal within ``rtol`` forward, and backward when both have one."""
    if a.bwd is None and b.bwd is None:
        return math.isclose(a.fwd.mean_abs, b.fwd.mean_abs, rel_tol=rtol)
    if a.bwd is None or b.bwd is None:
        return False
    return math.isclose(a.fwd.mean_abs, b.fwd.mean_abs, rel_tol=rtol) and math.isclose(
        a.bwd.mean_abs, b.bwd.mean_abs, rel_tol=rtol
    )


def prune_same_scale_tensors(graph: fx.Graph, rtol: float = 2**-16) -> fx.Graph:
    """A copy of ``graph`` without the nodes whose scale equals that of their only floating-point
    input within ``rtol`` (reshapes, views, copies); nodes with several floating-point inputs stay.

    Inputs are counted in positional and keyword arguments (unit_scaling counts positional ones).

    >>> pruned = prune_same_scale_tensors(graph, rtol=2**-16)   # doctest: +SKIP
    """
    _check(graph)
    if not isinstance(rtol, (int, float)) or isinstance(rtol, bool) or not rtol >= 0:
        raise ValueError(f"Expected `rtol` to be a number >= 0, but got {rtol!r}")
    graph = copy.deepcopy(graph)
    for node in list(graph.nodes):
        if node.op == "output" or not node.meta.get("outputs_float_tensor", False):
            continue
        inputs = _float_inputs(node)
        if len(inputs) != 1:
            continue
        mine, theirs = node.meta.get("metrics"), inputs[0].meta.get("metrics")
        if mine is not None and theirs is not None and _same_scale(mine, theirs, rtol):
            _remove(graph, node, inputs[0])
    graph.lint()
    return graph


def _target_names(targets: Iterable[Any]) -> tuple[set[Any], set[str]]:
    exact: set[Any] = set()
    names: set[str] = set()
    for target in targets:
        if isinstance(target, str):
            names.add(op_name(target))
            continue
        try:
            exact.add(target)
        except TypeError:
            pass
        name = getattr(target, "__name__", None)
        if isinstance(name, str):
            if getattr(target, "__module__", None) == "_operator" and name[:1] == "i" and name[1:] in INPLACE_OPERATORS:
                name = f"__{name}__"  # operator.iadd is `x += y`, recorded as add_
            names.add(op_name(name))
    return exact, names


def prune_selected_nodes(graph: fx.Graph, targets: Iterable[Callable[..., Any] | str]) -> fx.Graph:
    """A copy of ``graph`` without the op nodes whose function is one of ``targets``.

    A target matches the node's FX target exactly, or by op name, so ``torch.reshape``,
    ``torch.Tensor.reshape`` and ``"reshape"`` all remove ``x.reshape(...)`` calls, and
    ``operator.add`` removes ``x + y``. Users of a removed node get its single floating-point
    input (``None`` when it had several; unit_scaling always puts ``None`` and edits the graph in place).

    >>> pruned = prune_selected_nodes(graph, targets=[torch.reshape, torch.Tensor.view])   # doctest: +SKIP
    """
    _check(graph)
    if isinstance(targets, (str, bytes)) or not isinstance(targets, Iterable):
        raise ValueError(f"Expected `targets` to be an iterable of functions or op names, but got {targets!r}")
    exact, names = _target_names(list(targets))
    graph = copy.deepcopy(graph)
    for node in list(graph.nodes):
        if not node.op.startswith("call_"):
            continue
        try:
            hit = node.target in exact
        except TypeError:
            hit = False
        if hit or node.meta.get("op") in names:
            _remove(graph, node, _replacement(node))
    graph.lint()
    return graph
