"""A recorder's setup: its run folder found and named, its cross-rank reducer and its rules' runner made.

Kept out of engine/recorder.py so the recorder holds steps and the lifecycle. Its arguments are
checked before, in one place for every entry point: :class:`tensorlens.options.Options`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensorlens.backends.base import Backend
from tensorlens.engine.run_names import Naming, current_naming, run_name_from
from tensorlens.store import runs
from tensorlens.store.schema import store_filename


def locate_run(
    out_dir: Any, run_name: str | None, resume: str, backends: Sequence[Backend], rank: int, world_size: int,
    include_workers: str, collective_timeout: float | None, naming: Naming | None = None,
) -> tuple[str, str, bool]:
    """The run's name, folder and whether it is resumed (see :func:`tensorlens.store.runs.locate`);
    with several ranks, rank 0's choice is broadcast. Without ``run_name`` the run is named after
    the user's run (``naming``, default :func:`~tensorlens.engine.run_names.current_naming`): its
    folder is made unique as any derived name's, inside ``naming.runs_dir`` when it says."""
    naming = current_naming() if naming is None else naming
    share = None
    if world_size > 1:
        from tensorlens.compute.distributed import broadcast_run

        def share(name: str, run_dir: str) -> tuple[str, str]:
            return broadcast_run(name, run_dir, timeout=collective_timeout)
    return runs.locate(
        out_dir, run_name, run_name_from(naming, backends), resume, store_filename(f"worker_{rank}", primary=rank == 0),
        rank=rank, own_store=rank == 0 or include_workers == "all", share=share, runs_dir=naming.runs_dir,
    )


def collective_reducer(world_size: int, include_workers: str, timeout: float | None) -> Any:
    """The cross-rank reducer of ``include_workers="reduce"`` with several ranks, else ``None``."""
    if world_size > 1 and include_workers == "reduce":
        from tensorlens.compute.distributed import CollectiveReducer

        return CollectiveReducer(timeout=timeout)
    return None


def rule_runner(rules: Sequence[Any] | None, backends: list[Backend], rank: int) -> Any:
    """The online rules' runner (it checks the rules, before anything is created), added to
    ``backends`` on rank 0 (rules read rank 0's records, as trackers do); ``None`` elsewhere or
    without rules. Imported here: a recorder without rules never loads them."""
    if rules is None:
        return None
    from tensorlens.rules.online import RuleRunner

    runner = RuleRunner(rules)
    if rank != 0:
        return None
    backends.append(runner)
    return runner
