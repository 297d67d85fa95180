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

A rank that fails without exiting (stuck in a data loader, killed by the job's scheduler
while its peers live on, or no longer recording) must not hold the others inside tensorlens's
collective until the process group's own timeout (30 minutes by default). So tensorlens makes
its collectives on a ``gloo`` group of its own, created on first use with its own timeout
(``timeout``, default 60 s, or ``$TENSORLENS_COLLECTIVE_TIMEOUT`` in seconds): a collective that
fails or waits longer raises there, and the reducer warns once and goes on with this rank's own
values for the rest of the run (:attr:`CollectiveReducer.active` turns ``False``). Training's
own process group is never touched. Being ``gloo``, the group moves CUDA tensors to the CPU for
the collective (a few small arrays per saved step); where gloo is missing, the default backend
is used with the same timeout. Results come back on the device of the inputs.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from tensorlens._checks import expected
from tensorlens.compute.jobs import TensorJob
from tensorlens.config import HistogramConfig
from tensorlens.stats.moments import merge_partials

__all__ = ["COLLECTIVE_TIMEOUT_S", "CollectiveReducer", "broadcast_run", "collective_timeout", "is_sharded", "local_piece"]

#: How long one of tensorlens's collectives may wait for the other ranks, in seconds.
COLLECTIVE_TIMEOUT_S = 60.0
_TIMEOUT_ENV = "TENSORLENS_COLLECTIVE_TIMEOUT"
_T = TypeVar("_T")


def collective_timeout(timeout: float | None = None) -> float:
    """``timeout``, else ``$TENSORLENS_COLLECTIVE_TIMEOUT``, else 60 s (checked: a positive number).

    >>> collective_timeout(5)
    5.0
    """
    source = "timeout"
    if timeout is None:
        raw = os.environ.get(_TIMEOUT_ENV)
        if raw is None:
            return COLLECTIVE_TIMEOUT_S
        source = _TIMEOUT_ENV
        try:
            timeout = float(raw)
        except ValueError:
            raise expected(source, "a positive number of seconds", raw) from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise expected(source, "a positive number of seconds", timeout)
    return float(timeout)


# One timed group per (world, ranks, timeout) and process: every hook in reduce mode shares it, so
# the groups are created in the same order on every rank however many hooks there are. Once a
# collective on it failed, the ranks no longer agree on how far they got (nor, if creating it
# failed, on how many groups exist), so it is never used, nor created, again in this world.
_TIMED_GROUPS: dict[tuple[int, tuple[int, ...] | None, float], Any] = {}
_BROKEN = object()


def _group_key(group: Any, timeout: float) -> tuple[int, tuple[int, ...] | None, float]:
    ranks = None if group is None else tuple(dist.get_process_group_ranks(group))
    return id(dist.group.WORLD), ranks, timeout


def _timed_group(group: Any, timeout: float) -> Any:
    """tensorlens's own group with the ranks of ``group`` (None: the world) and its own timeout."""
    key = _group_key(group, timeout)
    found = _TIMED_GROUPS.get(key)
    if found is _BROKEN:
        raise RuntimeError("an earlier collective of tensorlens failed in this process group")
    if found is None:
        _TIMED_GROUPS[key] = _BROKEN  # until it exists: a failed creation is final too
        _, ranks, _ = key
        options: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout)}
        if dist.is_gloo_available():
            options["backend"] = "gloo"
        if ranks is not None:  # only the members call this: they synchronise among themselves
            options.update(ranks=list(ranks), use_local_synchronization=True)
        found = _TIMED_GROUPS[key] = dist.new_group(**options)
    return found


def _broken(group: Any, timeout: float) -> None:
    _TIMED_GROUPS[_group_key(group, timeout)] = _BROKEN


def _warn_collective_failed(what: str, err: BaseException, timeout: float) -> None:
    warnings.warn(
        f"tensorlens: a collective across ranks ({what}) failed or waited more than {timeout:g} s "
        f"({type(err).__name__}: {str(err)[:300]}); a rank may have failed or stopped recording, so this rank "
        f"records its own values from now on, without merging (set {_TIMEOUT_ENV} to wait longer) "
        "(training continues; this warning is shown once)",
        stacklevel=4,
    )


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


def broadcast_run(run_name: str, run_dir: str, group: Any = None, timeout: float | None = None) -> tuple[str, str]:
    """Rank 0's run name and folder on every rank, so that ``include_workers="all"`` writes
    one folder (each rank's default name holds a time and a random id).

    Bounded by ``timeout`` (see :func:`collective_timeout`): when rank 0 does not take part in
    time, one warning, and this rank keeps its own name and folder.
    """
    seconds = collective_timeout(timeout)
    payload: list[Any] = [(run_name, run_dir)]
    try:
        timed = _timed_group(group, seconds)
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(payload, src=src, group=timed)
    except Exception as err:  # a rank that failed or never creates its hook: go on alone
        _broken(group, seconds)
        _warn_collective_failed("broadcast of the run folder", err, seconds)
        return run_name, run_dir
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
    """The :class:`~tensorlens.compute.step.WorkerReducer` for ``torch.distributed``.

    Every method is a collective: all ranks of ``group`` (default: the world) must call it in
    the same order with tensors of the same shapes; :meth:`agree_jobs` arranges that for a step.
    They run on tensorlens's own group of the same ranks, each bounded by ``timeout`` seconds
    (see :func:`collective_timeout`); after one fails, every method returns this rank's own
    values without communicating, and :attr:`active` is ``False``.

    >>> reducer = CollectiveReducer(timeout=60)            # doctest: +SKIP
    >>> StepStatistics().compute(reducer.agree_jobs(jobs), reducer)  # doctest: +SKIP
    """

    def __init__(self, group: Any = None, timeout: float | None = None) -> None:
        self.group = group
        self.timeout = collective_timeout(timeout)
        self.failed: str | None = None  # what failed, once a collective did

    @property
    def active(self) -> bool:
        """Whether collectives are still made: the process group exists and none has failed."""
        return self.failed is None and dist.is_available() and dist.is_initialized()

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def _collective(self, what: str, run: Callable[[Any], _T], local: Callable[[], _T]) -> _T:
        """``run(group)`` on the timed group, or ``local()`` once a collective failed."""
        if self.failed is not None:
            return local()
        try:
            return run(_timed_group(self.group, self.timeout))
        except Exception as err:  # a timeout, a rank that left: never again, never a hang
            self.failed = what
            _broken(self.group, self.timeout)
            _warn_collective_failed(what, err, self.timeout)
            return local()

    def _device(self, tensor: torch.Tensor | None = None) -> torch.device:
        """The device collectives of the timed group need: CPU for gloo, the current GPU for nccl."""
        backend = str(dist.get_backend(_timed_group(self.group, self.timeout))).lower()
        if backend == "gloo":
            return torch.device("cpu")
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        # mpi, device-dispatching groups ("cpu:gloo,cuda:nccl"), other accelerators: as they are
        return tensor.device if tensor is not None else torch.device("cpu")

    def _all_reduce(self, values: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
        device = self._device(values)
        buffer = values.detach().reshape(-1).to(device, copy=True)  # never reduce into the caller's tensor
        dist.all_reduce(buffer, op=op, group=group)
        return buffer.reshape(values.shape).to(values.device)

    def merge_rows(self, rows: torch.Tensor, partitioned: torch.Tensor) -> torch.Tensor:
        """The partial rows of the whole: merged across ranks where ``partitioned``, this rank's
        own (identical on every rank) elsewhere."""

        def run(group: Any) -> torch.Tensor:
            device = self._device(rows)
            local = rows.detach().to(device).contiguous()
            gathered = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.all_gather(gathered, local, group=group)
            merged = merge_partials(torch.stack(gathered, dim=-2)).to(rows.device)  # [N, W, K] -> [N, K]
            keep = partitioned.to(device=rows.device, dtype=torch.bool).reshape(-1, 1)
            return torch.where(keep, merged, rows.to(merged.dtype))

        return self._collective("all_gather of the partial statistics", run, lambda: rows)

    def min_max(self, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest ``low`` and the largest ``high`` of all ranks, in one ``all_reduce``."""

        def run(group: Any) -> tuple[torch.Tensor, torch.Tensor]:
            both = torch.stack([low.to(torch.float64), -high.to(torch.float64)])
            reduced = self._all_reduce(both, dist.ReduceOp.MIN, group)
            return reduced[0].to(low.dtype), (-reduced[1]).to(high.dtype)

        return self._collective("all_reduce of the histogram ranges", run, lambda: (low, high))

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over all ranks (histogram counts, NaN/Inf counts)."""
        return self._collective(
            "all_reduce of the histogram counts", lambda group: self._all_reduce(values, dist.ReduceOp.SUM, group),
            lambda: values,
        )

    # ------------------------------------------------------------------ agreeing on a step's jobs

    def agree_jobs(self, jobs: Sequence[TensorJob]) -> list[TensorJob]:
        """The union of every rank's jobs of this step, in one order shared by all ranks.

        A job this rank did not see gets an empty piece (it adds nothing to the merge). A job
        missing on some rank is treated as partitioned, so the ranks that have it are merged and
        its histogram counts summed. Also agrees on each job's histogram config, which decides
        how many collectives the step makes.
        """
        specs = [_spec(job) for job in jobs]
        return self._collective("agreeing on the step's tensors", lambda group: self._agree(jobs, specs, group), lambda: list(jobs))

    def _agree(self, jobs: Sequence[TensorJob], specs: list[_JobSpec], group: Any) -> list[TensorJob]:
        keys = _keys(specs)
        digest = hashlib.blake2b(repr(specs).encode(), digest_size=8).digest()
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        device = self._device(mine)
        gathered = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine.to(device), group=group)
        digests = torch.cat(gathered).cpu()  # one host copy, whatever the device
        if bool((digests == digests[0]).all()):
            return list(jobs)  # every rank holds the same job list, in the same order

        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, specs, group=group)
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
        return self._collective("agreeing on the dynamics' layout", lambda group: self._agree_sizes(listed, group), lambda: listed)

    def _agree_sizes(self, listed: list[tuple[str, int]], group: Any) -> list[tuple[str, int]]:
        digest = hashlib.blake2b(repr(listed).encode(), digest_size=8).digest()
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        device = self._device(mine)
        gathered = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine.to(device), group=group)
        digests = torch.cat(gathered).cpu()
        if bool((digests == digests[0]).all()):
            return listed
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, listed, group=group)
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
