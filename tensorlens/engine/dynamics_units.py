"""The module statistics of the ``dynamics`` collection as one flat vector: every module output's
per-unit activity counts side by side, then each output's ``(positions, saturated, values)``.

One vector per saved step, whatever the number of modules: one ``all_reduce`` sums it across
ranks, and :func:`tensorlens.stats.derived.segment_unit_statistics` turns it into the rates and
fractions of every output with a few ops (segment sums), where a vector and ~10 ops per module
cost more than their arithmetic on small models. What the layout decides (segment indices,
widths, the scalars' names and where they are) is a :class:`UnitPlan`, built once while the
layout stays the same (almost always: the same modules every saved step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from tensorlens.stats import derived


@dataclasses.dataclass
class UnitPlan:
    """The fixed part of the module statistics' vector for one layout."""

    sizes: list[int]  # units per output
    outputs: list[tuple[str, bool]]  # (name, has unit counts) per output
    names: tuple[tuple[str, str], ...]  # the scalars' names
    segment: torch.Tensor  # [sum(sizes)]: the output of each count
    width: torch.Tensor  # float64 [M]: units per output
    index: torch.Tensor  # [len(names)]: where each scalar is in [dead (M), active (M), saturation (M)]


def unit_plan(layout: list[tuple[str, int]], device: torch.device) -> UnitPlan:
    """The plan of a layout: ``(name + "\\x00" + flags, units + 3)`` per output, the flags saying
    whether it has unit counts and a saturated count (``"10"``: counts only)."""
    sizes = [size - 3 for _, size in layout]
    m = len(sizes)
    outputs, names, index = [], [], []
    for i, (key, _) in enumerate(layout):
        name, flags = key.split("\x00", 1)
        outputs.append((name, flags[0] == "1"))
        if flags[0] == "1":
            names += [(f"activations/{name}", "dead_fraction"), (f"activations/{name}", "active_rate_mean")]
            index += [i, m + i]
        if flags[1] == "1":
            names.append((f"activations/{name}", "saturation_fraction"))
            index.append(2 * m + i)
    return UnitPlan(
        sizes=sizes, outputs=outputs, names=tuple(names),
        segment=derived.segment_index(tuple(sizes), device),
        width=torch.tensor(sizes, dtype=torch.float64).to(device),
        index=torch.tensor(index, dtype=torch.long).to(device),
    )


def unit_vector(units: Mapping[str, Any], plan: UnitPlan, device: torch.device) -> torch.Tensor:
    """``[counts of every output..., (positions, saturated, values) of every output...]``, float64,
    from each output's sums over the step (``counts``, ``positions``, ``saturated``, ``values``);
    zeros for an output this rank did not see (or saw with another number of units)."""
    pieces: list[torch.Tensor] = []
    rows: list[tuple[float, float, float]] = []
    counted: list[tuple[int, torch.Tensor]] = []  # saturated counts still on the device
    for i, ((name, _), width) in enumerate(zip(plan.outputs, plan.sizes, strict=True)):
        acc = units.get(name)
        if acc is None or (acc.counts.numel() if acc.counts is not None else 0) != width:
            rows.append((0.0, 0.0, 0.0))
            if width:
                pieces.append(torch.zeros(width, dtype=torch.float64, device=device))
            continue
        if acc.counts is not None:
            pieces.append(acc.counts.to(device))
        saturated = 0.0
        if isinstance(acc.saturated, torch.Tensor):
            counted.append((i, acc.saturated))
        elif acc.saturated is not None:  # a number from the compiled kernel
            saturated = float(acc.saturated)
        rows.append((float(acc.positions), saturated, float(acc.values)))
    tail = torch.tensor(rows, dtype=torch.float64)
    if device.type != "cpu":  # pageable memory, not waited for: no host sync on a saved step
        tail = tail.to(device, non_blocking=True)
    if counted:
        at = torch.tensor([i for i, _ in counted], dtype=torch.long).to(device, non_blocking=True)
        tail[:, 1].index_put_((at,), torch.stack([c.to(device) for _, c in counted]).to(torch.float64), accumulate=True)
    if not pieces:
        return tail.reshape(-1)
    return torch.cat([torch.cat(pieces).to(torch.float64), tail.reshape(-1)])
