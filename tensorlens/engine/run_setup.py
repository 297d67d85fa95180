"""A recorder's setup: its constructor arguments checked, its run folder found, its cross-rank
reducer and its rules' runner made.

Kept out of engine/recorder.py so the recorder holds steps and the lifecycle; every check raises
the one clear error of :func:`tensorlens._checks.expected` at construction, before anything is created.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tensorlens._checks import expected
from tensorlens.backends.base import Backend, active_run_name
from tensorlens.config import DynamicsConfig, HistogramConfig, ReductionConfig, SaveConfig
from tensorlens.dispatch.epochs import check_epoch_statistics
from tensorlens.store import runs
from tensorlens.store.schema import store_filename

WORKER_MODES = ("reduce", "one", "all")


def check_arguments(
    save_config: Any, reduction_config: Any, histogram_config: Any, include_workers: Any, max_pending_steps: Any,
    run_name: Any, out_dir: Any, resume: Any, dynamics_config: Any, epoch_statistics: Iterable[str] | str | None,
    collective_timeout: Any,
) -> tuple[str, ...]:
    """Raise on the first argument of :class:`~tensorlens.engine.recorder.Recorder` that is not
    what it must be; return the epoch statistics chosen."""
    if save_config is not None and not isinstance(save_config, SaveConfig):
        raise expected("save_config", "a tl.SaveConfig", save_config)
    if reduction_config is not None and not isinstance(reduction_config, ReductionConfig):
        raise expected("reduction_config", "a tl.ReductionConfig", reduction_config)
    if histogram_config is not None and not isinstance(histogram_config, HistogramConfig):
        raise expected("histogram_config", "a tl.HistogramConfig", histogram_config)
    if include_workers not in WORKER_MODES:
        raise expected("include_workers", f"one of {list(WORKER_MODES)}", include_workers)
    if isinstance(max_pending_steps, bool) or not isinstance(max_pending_steps, int) or max_pending_steps < 1:
        raise expected("max_pending_steps", "an integer >= 1", max_pending_steps)
    if run_name is not None and (not isinstance(run_name, str) or not run_name):
        raise expected("run_name", "None or a non-empty string", run_name)
    if out_dir is not None and not isinstance(out_dir, (str, bytes)) and not hasattr(out_dir, "__fspath__"):
        raise expected("out_dir", "None or a path", out_dir)
    runs.check_resume(resume)
    if dynamics_config is not None and not isinstance(dynamics_config, DynamicsConfig):
        raise expected("dynamics_config", "None or a tl.DynamicsConfig", dynamics_config)
    chosen = check_epoch_statistics(epoch_statistics)
    if collective_timeout is not None and (
        isinstance(collective_timeout, bool) or not isinstance(collective_timeout, (int, float)) or not collective_timeout > 0
    ):
        raise expected("collective_timeout", "None or a positive number of seconds", collective_timeout)
    return chosen


def locate_run(
    out_dir: Any, run_name: str | None, resume: str, backends: Sequence[Backend], rank: int, world_size: int,
    include_workers: str, collective_timeout: float | None,
) -> tuple[str, str, bool]:
    """The run's name, folder and whether it is resumed (see :func:`tensorlens.store.runs.locate`);
    with several ranks, rank 0's choice is broadcast."""
    share = None
    if world_size > 1:
        from tensorlens.compute.distributed import broadcast_run

        def share(name: str, run_dir: str) -> tuple[str, str]:
            return broadcast_run(name, run_dir, timeout=collective_timeout)
    return runs.locate(
        out_dir, run_name, active_run_name(backends), resume, store_filename(f"worker_{rank}", primary=rank == 0),
        rank=rank, own_store=rank == 0 or include_workers == "all", share=share,
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
