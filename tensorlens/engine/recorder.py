"""The recorder: steps and modes, the save schedule, what was captured, and one record per saved step.

It knows nothing of module hooks, optimizer hooks or Lightning. Its drivers (the :class:`Hook`,
the Lightning and Hugging Face callbacks) tell it where steps begin and end through its public
API; sources (the watched modules) give it parameters and attach captures on saved steps:

- ``begin_step(mode)``: a step of ``mode`` begins; on a saved step the sources attach their
  captures (train: call it before every micro-batch; eval/predict: one mode step per call);
- ``prepare_step(optimizer)``: read weights, gradients and what was captured, just before the
  optimizer updates (gradients are accumulated, unscaled);
- ``step()``: close the train step (updates, after the optimizer) and advance the counters;
- ``end_step()``: close an eval/predict step.

Statistics of a saved step are computed on the tensors' device in a few batched kernels, copied
to the host once and handed to the dispatcher, whose thread builds the step's one record.

What the recorder is given (``save_scalar``, ``save_tensor``, captures, its sources' parameters)
is in engine/inputs.py, when it feeds the ``dynamics`` collection and ``end_epoch`` in
engine/recorder_dynamics.py (both mixins of :class:`Recorder`), and its argument checks and run
folder in engine/run_setup.py.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from tensorlens._checks import expected, names_list
from tensorlens._runtime import distributed_rank
from tensorlens.backends.base import Backend, RunInfo, resolve_backends
from tensorlens.collection import DEFAULT_KINDS, MODULE_KINDS, Collection, Kind
from tensorlens.compute.jobs import DerivedScalars, TensorJob
from tensorlens.compute.step import StepStatistics
from tensorlens.config import DynamicsConfig, HistogramConfig, ReductionConfig, SaveConfig
from tensorlens.dispatch import BackendStats, Dispatcher
from tensorlens.dispatch.assemble import HostStatistics, PendingStep, build_record
from tensorlens.dispatch.epochs import EpochAggregator
from tensorlens.engine import gather, summary_targets
from tensorlens.engine.dynamics import Dynamics
from tensorlens.engine.inputs import REDUCE_WHEN_CAPTURED, CallerValues
from tensorlens.engine.metadata import metadata_of
from tensorlens.engine.parameter_jobs import ParameterJobs
from tensorlens.engine.pending import PendingCaptures
from tensorlens.engine.recorder_dynamics import DynamicsSteps
from tensorlens.engine.run_setup import WORKER_MODES, check_arguments, locate_run, stored_step_counters
from tensorlens.engine.schedule import Schedule
from tensorlens.engine.sources import ScalarSource, SourceHooks, TensorSource
from tensorlens.modes import ModeKeys
from tensorlens.records import ScalarEntry
from tensorlens.stats import native
from tensorlens.store import runs
from tensorlens.store.schema import store_filename

if TYPE_CHECKING:
    from tensorlens.findings import Finding
    from tensorlens.rules.base import Rule

__all__ = ["REDUCE_WHEN_CAPTURED", "Recorder", "ScalarSource", "TensorSource", "WORKER_MODES"]


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a callback of a driver so that no error of ours can take the training step down."""

    @functools.wraps(fn)
    def wrapper(self: Recorder, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except Exception as err:
            self.warn_once(f"{fn.__name__}: {type(err).__name__}: {err}")
            return None

    return wrapper


class Recorder(CallerValues, DynamicsSteps):
    """Records statistics of the tensors its sources and callers give it, one record per saved step.

    Most users want :func:`tensorlens.watch` or :class:`tensorlens.Hook` (a recorder driven by
    module and optimizer hooks); a framework callback drives a recorder directly.

    >>> rec = Recorder(out_dir="runs/exp1", save_config=SaveConfig(save_interval=1))  # doctest: +SKIP
    >>> rec.save_scalar("lr", 0.1); rec.step(); rec.close()                            # doctest: +SKIP

    Args: see :class:`tensorlens.Hook`.
    """

    def __init__(
        self,
        out_dir: str | Any | None = None,
        save_config: SaveConfig | None = None,
        reduction_config: ReductionConfig | None = None,
        histogram_config: HistogramConfig | None = None,
        include_collections: Iterable[str] | None = None,
        include_regex: Iterable[str] | str | None = None,
        backends: str | Sequence[str | Backend | type[Backend]] = "auto",
        run_name: str | None = None,
        include_workers: str = "reduce",
        max_pending_steps: int = 64,
        resume: str = "never",
        dynamics_config: DynamicsConfig | None = None,
        epoch_statistics: Iterable[str] | str | None = None,
        rules: Sequence[Rule] | None = None,
        collective_timeout: float | None = None,
    ) -> None:
        chosen_epoch_statistics = check_arguments(
            save_config, reduction_config, histogram_config, include_workers, max_pending_steps, run_name, out_dir, resume,
            dynamics_config, epoch_statistics, collective_timeout,
        )
        self.collective_timeout = collective_timeout

        self.schedule = Schedule(
            save_config or SaveConfig(),
            reduction_config,
            histogram_config or HistogramConfig(),
            DEFAULT_KINDS if include_collections is None else names_list("include_collections", include_collections),
            include_regex,
        )
        self.include_workers = include_workers
        self.rank, self.world_size = distributed_rank()
        self.worker = "reduced" if self.world_size > 1 and include_workers == "reduce" else f"worker_{self.rank}"
        self._reducer: Any = None
        if self.world_size > 1 and include_workers == "reduce":
            from tensorlens.compute.distributed import CollectiveReducer

            self._reducer = CollectiveReducer(timeout=collective_timeout)

        self._backends = resolve_backends(backends, self.rank)
        self._rules: Any = None
        if rules is not None:  # imported here: a recorder without rules never loads them
            from tensorlens.rules.online import RuleRunner

            runner = RuleRunner(rules)  # checks the rules before anything is created
            if self.rank == 0:  # rules read rank 0's records, as trackers do
                self._rules = runner
                self._backends.append(runner)
        self.run_name, self.run_dir, self.resumed = self._run_location(out_dir, run_name, resume)
        run = RunInfo(
            self.run_name, self.run_dir, self.rank, self.world_size, {"include_workers": include_workers},
            metadata=metadata_of(self), modules=self._describe_modules,
        )
        # epoch aggregates are taken from the records on the dispatcher thread (see dispatch/epochs.py)
        self._epochs = EpochAggregator(chosen_epoch_statistics, build_record, self.worker)
        self._dispatcher = Dispatcher(self._backends, run, max_pending=max_pending_steps, build=self._epochs.build)

        self.global_step = 0  # optimizer steps taken (Lightning's global_step)
        self._mode_steps = dict.fromkeys(ModeKeys, 0)
        if self.resumed:
            self._continue_stored_steps()
        self._explicit_mode: ModeKeys | None = None
        self._mode = ModeKeys.TRAIN
        self._open_eval: ModeKeys | None = None  # an eval/predict step that has begun
        self._sources: list[TensorSource] = []
        self._hooks = SourceHooks(self._sources)
        self._pending = PendingCaptures()
        self._mark: tuple[dict[object, int], ...] | None = None  # pending at the last begin_step
        self._dynamics_mark: Any = None  # the dynamics' module captures at the last begin_step
        self._pre_step: tuple[HostStatistics, list[ScalarEntry]] | None = None
        self._update_snapshot: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self._engine = StepStatistics()
        self._parameter_job_cache = ParameterJobs()  # the jobs of the parameters, reused across steps
        #: The bookkeeping of the ``dynamics`` collection (module taps feed it; see engine/dynamics.py).
        self.dynamics = Dynamics(
            dynamics_config or DynamicsConfig(), self.schedule, self.warn_once, lambda: self._mode,
            lambda: not (self._paused or self._closed),
        )
        native.prepare()  # compile the CPU kernel off the training thread, before the first saved step
        self._warned: set[str] = set()
        self._closed = False
        self._paused = False
        summary_targets.register(self)

    # ------------------------------------------------------------------ run location

    def _run_location(self, out_dir: Any, run_name: str | None, resume: str) -> tuple[str, str, bool]:
        return locate_run(
            out_dir, run_name, resume, self._backends, self.rank, self.world_size, self.include_workers, self.collective_timeout,
        )

    def _describe_modules(self) -> list[dict[str, Any]]:
        return [entry for source in self._sources if hasattr(source, "describe") for entry in source.describe()]

    def _store_file(self) -> str:
        return store_filename(f"worker_{self.rank}", primary=self.rank == 0)

    def _continue_stored_steps(self) -> None:
        """A resumed run goes on after its last stored steps, so nothing stored is overwritten;
        ``set_step`` sets the true step (the Lightning callback does it from the trainer)."""
        self.global_step, found = stored_step_counters(self.run_dir, self._store_file(), self.global_step)
        self._mode_steps.update(found)

    # ------------------------------------------------------------------ configuration

    @property
    def planner(self) -> Schedule:
        """The :attr:`schedule` under its former name (the Hook's ``scales`` option and a test
        still use it)."""
        return self.schedule

    @property
    def save_config(self) -> SaveConfig:
        return self.schedule.save_config

    @property
    def reduction_config(self) -> ReductionConfig | None:
        return self.schedule.reduction_config

    @property
    def histogram_config(self) -> HistogramConfig:
        return self.schedule.histogram_config

    def get_collection(self, name: str) -> Collection:
        """The collection called ``name``, created (as a custom collection) if new.

        Configuring a collection (``include``) enables it; built-ins are also enabled through
        ``include_collections``.
        """
        return self.schedule.get_collection(name)

    def add_collection(self, collection: Collection) -> Collection:
        """Add (and enable) a collection built by hand."""
        return self.schedule.add_collection(collection)

    @property
    def collections(self) -> dict[str, Collection]:
        return self.schedule.collections

    def enabled_collections(self) -> list[str]:
        return self.schedule.enabled_collections()

    def pause(self) -> None:
        """Ignore summaries, losses and module captures until :meth:`unpause` (Lightning's
        sanity-check batches, which its loggers do not record either)."""
        self._paused = True

    def unpause(self) -> None:
        self._paused = False

    def add_source(self, source: TensorSource) -> None:
        """Read parameters from ``source`` and let it capture module tensors on saved steps."""
        self._check_open("add a source")
        self._sources.append(source)

    def set_mode(self, mode: ModeKeys | str | None) -> None:
        """Fix the mode (``tl.modes.TRAIN``, ``EVAL``, ``PREDICT``, ``GLOBAL``); ``None`` follows
        ``module.training`` again."""
        self._check_open("set the mode")
        new = None if mode is None else ModeKeys.coerce(mode)
        if new == ModeKeys.EPOCH:
            raise expected("mode", "train, eval, predict or global (epoch records are made by end_epoch())", mode)
        if self._open_eval is not None and new != self._open_eval:
            self._close_eval_step()
        self._explicit_mode = new
        if new is not None:
            self._mode = new

    @property
    def mode(self) -> ModeKeys:
        return self._mode

    @property
    def explicit_mode(self) -> ModeKeys | None:
        """The mode fixed by :meth:`set_mode`, or ``None`` when it follows the model."""
        return self._explicit_mode

    def mode_step(self, mode: ModeKeys | str | None = None) -> int:
        return self._mode_steps[ModeKeys.coerce(mode or self._mode)]

    def set_step(self, global_step: int, mode_steps: dict[ModeKeys | str, int] | None = None) -> None:
        """Set the step counters, e.g. to continue from a resumed trainer's ``global_step``.

        The train mode step follows ``global_step``; ``mode_steps`` sets other modes' counters.
        """
        if isinstance(global_step, bool) or not isinstance(global_step, int) or global_step < 0:
            raise expected("global_step", "an integer >= 0", global_step)
        self.global_step = global_step
        self._mode_steps[ModeKeys.TRAIN] = global_step
        for mode, value in (mode_steps or {}).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise expected(f"mode_steps[{mode!r}]", "an integer >= 0", value)
            self._mode_steps[ModeKeys.coerce(mode)] = value

    def will_save(self, collection: str, mode: ModeKeys | str | None = None) -> bool:
        """Whether ``collection`` is enabled and saves the current step of ``mode``."""
        mode = ModeKeys.coerce(mode) if mode is not None else self._mode
        return collection in self._saving(mode)

    def _saving(self, mode: ModeKeys) -> frozenset[str]:
        if self.world_size > 1 and self.include_workers == "one" and self.rank != 0:
            return frozenset()  # "one": ranks other than 0 capture and compute nothing
        return self.schedule.saving(mode, self._mode_steps[mode])

    # ------------------------------------------------------------------ step boundaries

    @guarded
    def begin_step(self, mode: ModeKeys | str | None = None) -> None:
        """A step of ``mode`` (default: the current mode) begins: on a saved step the sources
        attach their captures. In eval/predict mode it opens a mode step, closed by
        :meth:`end_step` or the next :meth:`begin_step`; in train mode call it before each
        micro-batch, and :meth:`prepare_step` / :meth:`step` close the train step."""
        self._check_open("begin a step")
        mode = ModeKeys.coerce(mode) if mode is not None else (self._explicit_mode or self._mode)
        if self._open_eval is not None:
            self._close_eval_step()  # the next step begins: the previous eval step is complete
        self._mode = mode
        self._mark = self._pending.mark()
        self._dynamics_mark = self.dynamics.mark()
        if mode in (ModeKeys.EVAL, ModeKeys.PREDICT):
            self._open_eval = mode
        self._hooks.begin(self.schedule.with_kinds(self._saving(mode), MODULE_KINDS), self.schedule.version)

    def abandon_step(self) -> None:
        """Forget what was captured since the last :meth:`begin_step`: its forward raised and the
        loop skips the batch (the out-of-memory pattern); earlier micro-batches are kept."""
        if self._mark is not None:
            self._pending.rollback(self._mark)
            self._mark = None
        if self._dynamics_mark is not None:
            self.dynamics.rollback(self._dynamics_mark)
            self._dynamics_mark = None

    @guarded
    def end_step(self) -> None:
        """Close the eval/predict step opened by :meth:`begin_step` (a no-op in train mode)."""
        if self._open_eval is not None:
            self._close_eval_step()

    @guarded
    def prepare_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Read weights, gradients and what was captured, just before the optimizer updates
        (``optimizer``, when given, also gives the ``optimizer`` collection its settings)."""
        self._check_open("prepare a step")
        if self._open_eval is not None:
            self._close_eval_step()
        mode = self._train_mode()
        self._mode = mode
        saving = self._saving(mode)
        jobs = self._parameter_jobs(saving) + self._pending_jobs(saving, mode)
        host_scalars = self._optimizer_scalars(optimizer, saving) + self._source_scalars(saving)
        self._pre_step = (self._compute(jobs, saving), host_scalars)
        self._dynamics_before_update(saving, mode)
        if self.schedule.with_kinds(saving, (Kind.UPDATES,)):
            self._update_snapshot = [
                (name, p, gather.local_piece(p)[0].detach().clone()) for name, p in self._parameters()
                if self.schedule.collections_for(Kind.UPDATES, name, saving)
            ]

    def step(self) -> None:
        """Close the current train step (records it if it is saved) and advance the step counter."""
        self._check_open("close a step")
        if self._pre_step is None:
            self.prepare_step(None)
        self._finish_train_step()
        self.take_rule_actions()

    # ------------------------------------------------------------------ rules

    def take_rule_actions(self) -> bool:
        """Take the actions of the rules that fired since the last step boundary (called at every
        train step boundary): warn, run callables, raise :class:`~tensorlens.rules.RuleEvaluationConditionMet`
        for ``action="raise"``; returns :attr:`should_stop`. Not guarded: a raise is meant to reach
        the training loop. Rules run in the background, so a finding surfaces at the first
        boundary after its step has been checked."""
        return self._rules.take_action() if self._rules is not None else False

    @property
    def should_stop(self) -> bool:
        """True once a rule with ``action="stop"`` fired: end the training loop (``if hook.should_stop: break``)."""
        return self._rules is not None and self._rules.should_stop

    def findings(self) -> list[Finding]:
        """What the rules found so far (``tl.open_run(run_dir).findings()`` reads them back)."""
        return self._rules.findings() if self._rules is not None else []

    def _train_mode(self) -> ModeKeys:
        return self._explicit_mode if self._explicit_mode in (ModeKeys.TRAIN, ModeKeys.GLOBAL) else ModeKeys.TRAIN

    @guarded
    def _finish_train_step(self) -> None:
        if self._pre_step is None:
            self._advance(self._mode)
            return
        host, host_scalars = self._pre_step
        self._pre_step = None
        mode = self._mode
        parts = [host]
        saving = self._saving(mode)
        # dynamics join the updates' part: with them alone a saved step makes one host copy
        jobs, module_scalars = self._dynamics_of_modules(saving, mode)
        derived = DerivedScalars.concat([module_scalars, self.dynamics.after_update(self._live_reducer(saving), self.rank)])
        # "reduce": on a saved step every rank computes, whatever it holds, so collectives match
        if self._update_snapshot or self._pending.has_explicit(mode) or (self._reducer is not None and saving) or derived is not None or jobs:
            for name, param, before in self._update_snapshot:
                after, sharded = gather.local_piece(param)
                delta = after.detach() - before
                for c in self.schedule.collections_for(Kind.UPDATES, name, saving):
                    jobs.append(self.schedule.job(c, Kind.UPDATES, name, [delta], partitioned=sharded))
            self._update_snapshot = []
            # save_tensor between prepare_step and step belongs to the step being closed
            # (Lightning: gradients after clipping, read once the optimizer has stepped)
            jobs += self._pending_jobs(saving, mode)
            parts.append(self._compute(jobs, saving, derived))
            if derived is not None:
                self.dynamics.complete_nonfinite(parts[-1], self._live_reducer(saving), self.rank, self._to_host)
        self._submit(mode, self._mode_steps[mode], parts, host_scalars)
        self._advance(mode)

    def _compute(self, jobs: list[TensorJob], saving: frozenset[str], derived: DerivedScalars | None = None) -> HostStatistics:
        """Statistics of one step's jobs; under ``include_workers="reduce"`` merged across ranks.

        Collectives are made only on steps that save something: ``saving`` is the same on every
        rank (all ranks count the same steps), so an unsaved step costs no communication. The
        ranks first agree on the union of their jobs, so a module called on one rank only, or a
        different number of times, cannot hang them.
        """
        reducer = self._live_reducer(saving)
        if reducer is None:
            return self._engine.compute(jobs, None, warn=self.warn_once, derived=derived)
        return self._engine.compute(reducer.agree_jobs(jobs), reducer, warn=self.warn_once, derived=derived)

    def _live_reducer(self, saving: frozenset[str]) -> Any:
        """The cross-rank reducer on a saved step while the process group lives, else ``None``."""
        reducer = self._reducer
        return reducer if reducer is not None and saving and getattr(reducer, "active", True) else None

    def _advance(self, mode: ModeKeys) -> None:
        self.global_step += 1
        self._mode_steps[mode] += 1
        if mode != ModeKeys.TRAIN:
            self._mode_steps[ModeKeys.TRAIN] = self.global_step
        if self._hooks.attached:  # (an unsaved step has nothing to look ahead for)
            self._hooks.end(self.schedule.with_kinds(self._saving(mode), MODULE_KINDS), self.schedule.version)

    def _close_eval_step(self) -> None:
        mode = self._open_eval
        self._open_eval = None
        if mode is None:
            return
        saving = self._saving(mode)
        module_jobs, module_scalars = self._dynamics_of_modules(saving, mode)
        jobs = self._pending_jobs(saving, mode) + module_jobs
        if jobs or module_scalars is not None or (self._reducer is not None and saving):  # "reduce": every rank, for the collectives
            self._submit(mode, self._mode_steps[mode], [self._compute(jobs, saving, module_scalars)], [])
        self._mode_steps[mode] += 1
        self._hooks.detach()

    def _submit(self, mode: ModeKeys, mode_step: int, parts: list[HostStatistics], host_scalars: list[ScalarEntry]) -> None:
        if not any(p.jobs or p.derived_names for p in parts) and not host_scalars:
            return
        if self.world_size > 1 and self.include_workers != "all" and self.rank != 0:
            return  # "reduce": every rank holds the same merged statistics, rank 0 records them
        self._dispatcher.submit(
            PendingStep(self.global_step, mode, mode_step, self.worker, time.time(), list(host_scalars), parts)
        )

    # ------------------------------------------------------------------ lifecycle

    def warn_once(self, message: str) -> None:
        """One warning per kind of problem (the part before the first ``:``); training goes on."""
        key = message.split(":", 1)[0]
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"tensorlens: {message} (training continues; this warning is shown once)", stacklevel=3)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"tensorlens: cannot {what}: this {type(self).__name__} is closed (its run is {self.run_dir!r}); "
                "create a new one, e.g. tl.watch(model, resume='allow', out_dir=...) to continue that run"
            )

    @property
    def host_copies(self) -> int:
        """Device-to-host copies made so far (one per saved step unless a tensor held NaN/Inf)."""
        return self._engine.host_copies

    @property
    def backends(self) -> list[Backend]:
        return self._dispatcher.backends

    def backend_stats(self) -> dict[str, BackendStats]:
        """Per backend: records written, failed and dropped."""
        return self._dispatcher.stats()

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Wait until every saved step has reached every backend."""
        return self._dispatcher.flush(timeout)

    def close(self) -> None:
        """Record what is pending, detach every capture, flush and close the backends. Idempotent."""
        if self._closed:
            return
        try:
            if self._open_eval is not None:
                self._close_eval_step()
            # values saved after the last boundary of their mode (scalars, summaries, save_tensor)
            for mode in self._pending.modes_with_values():
                jobs = self._pending_jobs(self._saving(mode), mode)
                if jobs:
                    # no collectives here: close() may run on one rank only, or after the process
                    # group is gone; values saved after the last step are this rank's own
                    self._submit(mode, self._mode_steps[mode], [self._engine.compute(jobs, None, warn=self.warn_once)], [])
        except Exception as err:
            self.warn_once(f"close: {type(err).__name__}: {err}")
        self._closed = True
        self._hooks.detach()
        self._pending.clear()
        self.dynamics.release()
        summary_targets.unregister(self)
        self._dispatcher.close()
        self._engine.release()
        if self._rules is not None:  # what the rules found last: warned about, never raised from close()
            self._rules.take_action(raise_errors=False)
        if not self.resumed:  # a new run that recorded nothing leaves no folder behind
            runs.release_empty(self.run_dir, self._store_file())

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(run_dir={self.run_dir!r}, step={self.global_step}, collections={self.enabled_collections()})"
