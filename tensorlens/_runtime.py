"""What torch is doing right now: compiling the caller, running a backward pass, distributed."""

from __future__ import annotations

import torch


def compiling() -> bool:
    """Whether ``torch.compile`` is tracing the caller (``torch.compiler.is_compiling``, torch >= 2.3)."""
    check = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(check()) if check is not None else False


def in_backward() -> bool:
    """Whether autograd is running a backward pass in this thread (a checkpointed forward being
    recomputed: ``use_reentrant`` either way)."""
    return torch._C._current_graph_task_id() != -1


def distributed_rank() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group, ``(0, 1)`` without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
