"""A recorded trace as a ``torch.fx.Graph`` whose nodes carry unit_scaling's metadata.

Each node's ``meta`` holds what unit_scaling's graph holds (``clean_name``,
``outputs_float_tensor``, ``requires_grad``, and ``metrics`` on floating-point nodes), so its
pruning functions and plots read our graphs too, plus ``module`` (the module path that ran the
op), ``op`` (the short op name), ``dtype`` and ``shape``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from tensorlens.scales.metrics import Metrics, data_from_row, finalize
from tensorlens.scales.trace import Partials, Ref, TraceNode


def resolve_metrics(pairs: Sequence[tuple[Partials | None, Partials | None]]) -> list[Metrics | None]:
    """``Metrics`` for each ``(fwd, bwd)`` partials pair: one finalize and one host copy per device."""
    flat: list[Partials] = [p for pair in pairs for p in pair if p is not None]
    rows: dict[int, list[float]] = {}
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, partials) in enumerate(flat):
        by_device.setdefault(partials.device, []).append(i)
    for indices in by_device.values():
        table = finalize(torch.stack([flat[i][1] for i in indices]))
        for i, row in zip(indices, table.cpu().tolist(), strict=True):
            rows[i] = row
    out: list[Metrics | None] = []
    k = 0
    for fwd, bwd in pairs:
        if fwd is None:
            if bwd is not None:
                k += 1
            out.append(None)
            continue
        metrics = Metrics(data_from_row(rows[k]))
        k += 1
        if bwd is not None:
            metrics.bwd = data_from_row(rows[k])
            k += 1
        out.append(metrics)
    return out


def build_graph(nodes: Sequence[TraceNode], output: Any, metrics: Sequence[Metrics | None]) -> fx.Graph:
    """The trace as an FX graph in execution order, ``metrics[i]`` on node ``i``."""
    graph = fx.Graph()
    env: dict[int, fx.Node] = {}
    for node, node_metrics in zip(nodes, metrics, strict=True):
        fx_node = graph.create_node(
            node.kind, node.target, _resolve(node.args, env), _resolve(node.kwargs, env), name=node.name
        )
        fx_node.meta.update(
            clean_name=node.name,
            outputs_float_tensor=node.is_float,
            requires_grad=node.is_parameter,
            module=node.module,
            op=node.op,
            dtype=node.dtype,
            shape=node.shape,
        )
        if node.is_float and node_metrics is not None:
            fx_node.meta["metrics"] = node_metrics
        env[node.index] = fx_node
    out = graph.output(_resolve(output, env))
    out.meta.update(clean_name="output", outputs_float_tensor=False, requires_grad=False, module="", op="output",
                    dtype=None, shape=None)
    return graph


def _resolve(value: Any, env: Mapping[int, fx.Node]) -> Any:
    if isinstance(value, Ref):
        return env[value.index]
    if isinstance(value, tuple):
        return tuple(_resolve(v, env) for v in value)
    if isinstance(value, list):
        return [_resolve(v, env) for v in value]
    if isinstance(value, dict):
        return {k: _resolve(v, env) for k, v in value.items()}
    return value
