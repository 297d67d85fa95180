"""Statistics of the whole across ``torch.distributed`` ranks: exact merges with collectives.

Under DDP each rank sees its own slice of the batch, under FSDP2 its own shard of every
parameter. With ``include_workers="reduce"`` every rank computes the partial rows of its pieces
(:mod:`tensorlens.stats.moments`), then :class:`CollectiveReducer` merges them:

- ``merge_rows``: one ``all_gather`` of the ``[N, K]`` partial rows, then :func:`merge_partials`
  (Chan's update for the centred moments) on every rank, so every rank holds the same exact
  statistics of the concatenation;
- ``min_max``: one ``all_reduce(MIN)`` that agrees on histogram edges;
- ``sum``: ``all_reduce(SUM)`` of histogram counts over those agreed edges.

Replicated tensors (DDP parameters and their already all-reduced gradients, a ``Replicate``
DTensor) are not merged: every rank holds the same values, and merging would count them
``world_size`` times. :func:`local_piece` says which tensors are partitioned.

Collectives only work if every rank makes the same calls, in the same order, with tensors of
the same shapes. Ranks may capture different tensors in one step (a module called only on
rank 0, or called a different number of times), so before a step is computed
:meth:`CollectiveReducer.agree_jobs` makes every rank hold the union of the step's jobs, in the
same order, with an empty piece for a tensor it did not see. One 8-byte ``all_gather`` of a
digest of the job list settles the common case (every rank saw the same tensors); only when the
digests differ are the job lists themselves exchanged (``all_gather_object``).

Works with ``gloo`` (CPU tensors; CUDA tensors are moved to the CPU for the collective) and
``nccl`` (CUDA tensors; CPU tensors are moved to the current CUDA device), and leaves tensors
where they are for other backends. Results come back on the device of the inputs.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorlens.config import HistogramConfig
from tensorlens.engine.jobs import TensorJob
from tensorlens.stats.moments import merge_partials

__all__ = ["CollectiveReducer", "broadcast_run", "is_sharded", "local_piece"]


def _is_dtensor(tensor: torch.Tensor) -> bool:
    # checked by attribute so that plain tensors never import torch.distributed.tensor
    return hasattr(tensor, "placements") and hasattr(tensor, "device_mesh") and callable(getattr(tensor, "to_local", None))


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor split across ranks (FSDP2: a ``Shard`` placement).

    >>> is_sharded(torch.zeros(3))
    False
    """
    if not _is_dtensor(tensor):
        return False
    from torch.distributed.tensor import Shard

    return any(isinstance(p, Shard) for p in tensor.placements)


def local_piece(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(piece, partitioned)``: what this rank contributes to the statistics of ``tensor``.

    - a plain tensor: itself, not partitioned (under DDP parameters and gradients are replicated);
    - a DTensor with a ``Shard`` placement (FSDP2): its local shard, partitioned. On a mesh that
      also replicates (HSDP: ``(Replicate(), Shard(0))``), only the first replica of each shard
      contributes and the others give an empty piece, so no shard is counted twice;
    - a DTensor that is only replicated: its local copy, not partitioned.

    >>> local_piece(torch.ones(2))
    (tensor([1., 1.]), False)
    """
    if not _is_dtensor(tensor):
        return tensor, False
    local = tensor.to_local()  # type: ignore[attr-defined]
    if not is_sharded(tensor):
        return local, False
    from torch.distributed.tensor import Replicate

    coordinate = tensor.device_mesh.get_coordinate()  # type: ignore[attr-defined]
    placements = tensor.placements  # type: ignore[attr-defined]
    if coordinate is not None and any(
        isinstance(p, Replicate) and coordinate[dim] != 0 for dim, p in enumerate(placements)
    ):
        return local.reshape(-1)[:0], True
    return local, True


def broadcast_run(run_name: str, run_dir: str, group: Any = None) -> tuple[str, str]:
    """Rank 0's run name and folder on every rank, so that ``include_workers="all"`` writes
    one folder (each rank's default name holds a time and a random id)."""
    payload: list[Any] = [(run_name, run_dir)]
    dist.broadcast_object_list(payload, src=0, group=group)
    name, directory = payload[0]
    return str(name), str(directory)


@dataclasses.dataclass(frozen=True)
class _JobSpec:
    """What another rank needs to stand in for a job it did not see (picklable, printable)."""

    name: str
    stats: tuple[str, ...]
    histogram: HistogramConfig | None
    save_raw: bool
    save_shape: bool
    plain_scalar: bool
    partitioned: bool
    dtype: str


def _spec(job: TensorJob) -> _JobSpec:
    dtype = str(job.pieces[0].dtype).removeprefix("torch.") if job.pieces else "float32"
    return _JobSpec(
        job.name, tuple(job.stats), job.histogram, job.save_raw, job.save_shape, job.plain_scalar, job.partitioned, dtype
    )


class CollectiveReducer:
    """The :class:`~tensorlens.engine.step.WorkerReducer` for ``torch.distributed``.

    Every method is a collective: all ranks of ``group`` (default: the world) must call it in
    the same order with tensors of the same shapes; :meth:`agree_jobs` arranges that for a step.

    >>> reducer = CollectiveReducer()                      # doctest: +SKIP
    >>> StepStatistics().compute(reducer.agree_jobs(jobs), reducer)  # doctest: +SKIP
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group

    @property
    def active(self) -> bool:
        """Whether the process group can still be used (not yet destroyed)."""
        return dist.is_available() and dist.is_initialized()

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def _device(self, tensor: torch.Tensor | None = None) -> torch.device:
        """The device collectives of this group need: CPU for gloo, the current GPU for nccl."""
        backend = str(dist.get_backend(self.group)).lower()
        if backend == "gloo":
            return torch.device("cpu")
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        # mpi, device-dispatching groups ("cpu:gloo,cuda:nccl"), other accelerators: as they are
        return tensor.device if tensor is not None else torch.device("cpu")

    def _all_reduce(self, values: torch.Tensor, op: Any) -> torch.Tensor:
        device = self._device(values)
        buffer = values.detach().reshape(-1).to(device, copy=True)  # never reduce into the caller's tensor
        dist.all_reduce(buffer, op=op, group=self.group)
        return buffer.reshape(values.shape).to(values.device)

    def merge_rows(self, rows: torch.Tensor, partitioned: torch.Tensor) -> torch.Tensor:
        """The partial rows of the whole: merged across ranks where ``partitioned``, this rank's
        own (identical on every rank) elsewhere."""
        device = self._device(rows)
        local = rows.detach().to(device).contiguous()
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local, group=self.group)
        merged = merge_partials(torch.stack(gathered, dim=-2)).to(rows.device)  # [N, W, K] -> [N, K]
        keep = partitioned.to(device=rows.device, dtype=torch.bool).reshape(-1, 1)
        return torch.where(keep, merged, rows.to(merged.dtype))

    def min_max(self, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest ``low`` and the largest ``high`` of all ranks, in one ``all_reduce``."""
        both = torch.stack([low.to(torch.float64), -high.to(torch.float64)])
        reduced = self._all_reduce(both, dist.ReduceOp.MIN)
        return reduced[0].to(low.dtype), (-reduced[1]).to(high.dtype)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over all ranks (histogram counts, NaN/Inf counts)."""
        return self._all_reduce(values, dist.ReduceOp.SUM)

    # ------------------------------------------------------------------ agreeing on a step's jobs

    def agree_jobs(self, jobs: Sequence[TensorJob]) -> list[TensorJob]:
        """The union of every rank's jobs of this step, in one order shared by all ranks.

        A job this rank did not see gets an empty piece (it adds nothing to the merge). A job
        missing on some rank is treated as partitioned, so the ranks that have it are merged and
        its histogram counts summed. Also agrees on each job's histogram config, which decides
        how many collectives the step makes.
        """
        specs = [_spec(job) for job in jobs]
        keys = _keys(specs)
        digest = hashlib.blake2b(repr(specs).encode(), digest_size=8).digest()
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        device = self._device(mine)
        gathered = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine.to(device), group=self.group)
        digests = torch.cat(gathered).cpu()  # one host copy, whatever the device
        if bool((digests == digests[0]).all()):
            return list(jobs)  # every rank holds the same job list, in the same order

        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, specs, group=self.group)
        first: dict[tuple[str, int], _JobSpec] = {}
        holders: dict[tuple[str, int], int] = {}
        partitioned: dict[tuple[str, int], bool] = {}
        for rank_specs in everyone:  # rank 0's order first, then what other ranks add
            for key, spec in zip(_keys(rank_specs), rank_specs, strict=True):
                first.setdefault(key, spec)
                holders[key] = holders.get(key, 0) + 1
                partitioned[key] = partitioned.get(key, False) or spec.partitioned

        local = dict(zip(keys, jobs, strict=True))
        device_hint = next((job.pieces[0].device for job in jobs if job.pieces), self._device())
        out = []
        for key, spec in first.items():
            job = local.get(key)
            if job is None:
                empty = torch.empty(0, dtype=getattr(torch, spec.dtype, torch.float32), device=device_hint)
                job = TensorJob(
                    name=spec.name,
                    pieces=[empty],
                    stats=spec.stats,
                    histogram=spec.histogram,
                    save_raw=spec.save_raw,
                    save_shape=spec.save_shape,
                    plain_scalar=spec.plain_scalar,
                )
            else:
                # the first holder's histogram settings decide the collectives for everyone
                job.histogram, job.plain_scalar = spec.histogram, spec.plain_scalar
            job.partitioned = partitioned[key] or holders[key] < self.world_size
            out.append(job)
        return out


    def agree_sizes(self, sizes: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
        """The union of every rank's ``(name, size)`` list, in one order shared by all ranks
        (rank 0's first): the layout of a vector that is then summed with :meth:`sum`, such as
        the per-unit activity counts of modules some rank may not have called. A name is kept
        with the size its first holder gave it.

        One 8-byte ``all_gather`` when every rank holds the same list; the lists themselves are
        exchanged only when they differ.
        """
        listed = [(str(n), int(k)) for n, k in sizes]
        digest = hashlib.blake2b(repr(listed).encode(), digest_size=8).digest()
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        device = self._device(mine)
        gathered = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine.to(device), group=self.group)
        digests = torch.cat(gathered).cpu()
        if bool((digests == digests[0]).all()):
            return listed
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, listed, group=self.group)
        union: dict[str, int] = {}
        for rank_sizes in everyone:
            for name, size in rank_sizes:
                union.setdefault(name, size)
        return list(union.items())


def _keys(specs: Sequence[_JobSpec]) -> list[tuple[str, int]]:
    """``(name, occurrence)``: a name seen twice in one step (rare) stays two jobs."""
    seen: dict[str, int] = {}
    keys = []
    for spec in specs:
        seen[spec.name] = seen.get(spec.name, -1) + 1
        keys.append((spec.name, seen[spec.name]))
    return keys
