"""A watched model's parameters, read at every saved step.

``nn.Module.named_parameters`` builds every name through nested generators; reading each module's
``_parameters`` dict gives the same names, objects and order at a fraction of the cost, which
matters for models of thousands of parameter tensors (``benchmarks/overhead.py --per-tensor``).

An uninitialised parameter (``nn.LazyLinear`` before its first call) holds no values and no
shape yet: it is left out, as if the module had no such parameter, and listed from the first
saved step after it materialises. ``materialize()`` changes the object's class in place (same
``id``), so it is the *list of names* that changes then, which is what the job cache keys on
(:class:`tensorlens.engine.parameter_jobs.ParameterJobs`).
"""

from __future__ import annotations

import torch
from torch import nn


def append_parameters(root: nn.Module, prefix: str, seen: set[int], out: list[tuple[str, torch.Tensor]]) -> bool:
    """``root.named_parameters()`` (names under ``prefix``, tied parameters once), appended to
    ``out``, read straight from each module's ``_parameters``: the same names in the same order at a
    fraction of the cost (it runs at every saved step); uninitialised (lazy) parameters left out. ``False``, with ``out`` and ``seen``
    unchanged, where a module overrides ``named_parameters`` or ``named_modules`` (the caller then
    asks the module itself)."""
    found: list[tuple[str, torch.Tensor]] = []
    ids: list[int] = []
    modules: set[int] = set()
    stack = [(prefix, root)]
    while stack:
        at, module = stack.pop()
        if id(module) in modules:  # a module registered twice is walked once, as named_modules does
            continue
        modules.add(id(module))
        kind = type(module)
        if kind.named_modules is not _NAMED_MODULES or (module is root and kind.named_parameters is not _NAMED_PARAMETERS):
            seen.difference_update(ids)
            return False
        for name, param in module._parameters.items():
            if param is not None and id(param) not in seen and not isinstance(param, _LAZY):
                seen.add(id(param))
                ids.append(id(param))
                found.append((at + name, param))
        children = [(f"{at}{name}.", child) for name, child in module._modules.items() if child is not None]
        stack.extend(reversed(children))
    out.extend(found)
    return True


_LAZY = nn.parameter.UninitializedTensorMixin  # nn.parameter.is_lazy, without a call per parameter
_NAMED_MODULES = nn.Module.named_modules
_NAMED_PARAMETERS = nn.Module.named_parameters
