"""What a saved step summarises: the jobs of the parameters, of their updates, of what was captured
since the step's boundary, and the optimizer's settings; each matched to the collections that save it."""

from __future__ import annotations

import torch

from tensorlens.collection import MODULE_KINDS, PARAMETER_KINDS, Kind, parameter_kind
from tensorlens.compute.jobs import TensorJob
from tensorlens.engine.pending import PendingCaptures
from tensorlens.engine.schedule import Schedule
from tensorlens.modes import ModeKeys
from tensorlens.records import ScalarEntry


def parameter_jobs(schedule: Schedule, parameters: list[tuple[str, torch.Tensor]], saving: frozenset[str]) -> list[TensorJob]:
    """Jobs for the weights, biases and gradients of ``parameters`` that ``saving`` records."""
    jobs: list[TensorJob] = []
    if not schedule.with_kinds(saving, PARAMETER_KINDS):
        return jobs
    for name, param in parameters:
        # DDP: replicated, taken as they are; FSDP2: this rank's shard, merged across ranks
        kind = parameter_kind(name)
        local, sharded = local_piece(param)
        for c in schedule.collections_for(kind, name, saving):
            jobs.append(schedule.job(c, kind, name, [local], partitioned=sharded))
        grad = param.grad
        if grad is not None:
            local_grad, grad_sharded = local_piece(grad)
            for c in schedule.collections_for(Kind.GRADIENTS, name, saving):
                jobs.append(schedule.job(c, Kind.GRADIENTS, name, [local_grad], partitioned=grad_sharded))
    return jobs


def pending_jobs(schedule: Schedule, pending: PendingCaptures, saving: frozenset[str], mode: ModeKeys) -> list[TensorJob]:
    """Jobs for everything captured in ``mode`` since its last boundary; forgets those."""
    jobs = []
    for (kind, name), pieces in pending.take_tensors(mode).items():
        # module captures were chosen by module name: match the collections the same way
        match_name = pending.module_of.get(name, name) if kind in MODULE_KINDS else name
        for c in schedule.collections_for(kind, match_name, saving):
            jobs.append(schedule.job(c, kind, name, pieces))
    for (kind, name), values in pending.take_scalars(mode).items():
        collection = schedule.collection(kind)
        # save_scalar values were kept only on steps their collection saves
        if kind != Kind.SCALARS and collection.name not in saving:
            continue
        tensors = [v if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=torch.float64) for v in values]
        device = tensors[0].device
        job = schedule.job(collection, kind, name, [t.to(device) for t in tensors])
        job.plain_scalar = True  # summarize_scalar / save_scalar / losses: the number itself
        # across ranks losses and summaries are averaged; a save_scalar value is rank 0's
        job.partitioned = kind != Kind.SCALARS
        jobs.append(job)
    for collection_name, name, tensor in pending.take_explicit(mode):
        collection = schedule.collection(collection_name)
        kind = collection.kinds[0] if collection.builtin else Kind.SUMMARIES.value
        piece, sharded = local_piece(tensor)  # a plain tensor is rank 0's, a sharded DTensor merged
        job = schedule.job(collection, kind, name, [piece], partitioned=sharded)
        job.name = f"{collection_name}/{name}"
        jobs.append(job)
    return jobs


def optimizer_scalars(optimizer: torch.optim.Optimizer | None, saving: frozenset[str]) -> list[ScalarEntry]:
    """``optimizer/group<i>.<setting>`` of every param group, when the ``optimizer`` collection saves."""
    if optimizer is None or Kind.OPTIMIZER not in saving:
        return []
    out = []
    for i, group in enumerate(optimizer.param_groups):
        for key in ("lr", "momentum", "weight_decay", "betas", "eps"):
            value = group.get(key)
            values = value if isinstance(value, (tuple, list)) else [value]
            for j, v in enumerate(values):
                if isinstance(v, torch.Tensor) and v.numel() == 1:
                    v = float(v)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    suffix = f"{key}{j}" if len(values) > 1 else key
                    out.append(ScalarEntry(f"optimizer/group{i}.{suffix}", None, float(v)))
    return out


def update_snapshot(
    schedule: Schedule, parameters: list[tuple[str, torch.Tensor]], saving: frozenset[str]
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(name, parameter, copy of its local piece)`` of the parameters whose update ``saving``
    records, taken just before the optimizer step (see :func:`update_jobs`)."""
    return [
        (name, p, local_piece(p)[0].detach().clone()) for name, p in parameters
        if schedule.collections_for(Kind.UPDATES, name, saving)
    ]


def update_jobs(
    schedule: Schedule, snapshot: list[tuple[str, torch.Tensor, torch.Tensor]], saving: frozenset[str]
) -> list[TensorJob]:
    """Jobs for the updates ``p_after - p_before`` of a :func:`update_snapshot`, after the optimizer step."""
    jobs = []
    for name, param, before in snapshot:
        after, sharded = local_piece(param)
        delta = after.detach() - before
        for c in schedule.collections_for(Kind.UPDATES, name, saving):
            jobs.append(schedule.job(c, Kind.UPDATES, name, [delta], partitioned=sharded))
    return jobs


def local_piece(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(what this rank contributes, partitioned)``; see :func:`tensorlens.compute.distributed.local_piece`."""
    if not hasattr(tensor, "placements"):  # not a DTensor: skip importing torch.distributed.tensor
        return tensor, False
    from tensorlens.compute.distributed import local_piece

    return local_piece(tensor)
