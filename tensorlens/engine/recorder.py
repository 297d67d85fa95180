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

The recorder decides when; the objects it holds do the rest: what it is given and the jobs that
makes (engine/inputs.py), the save schedule (engine/schedule.py), when training dynamics are read
(engine/dynamics_steps.py), a saved step's statistics and hand-over to the dispatcher
(engine/step_output.py); its argument checks and run folder are in engine/run_setup.py.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from tensorlens._checks import expected, names_list
from tensorlens._runtime import distributed_rank
from tensorlens.backends.base import Backend, RunInfo, resolve_backends
from tensorlens.collection import DEFAULT_KINDS, MODULE_KINDS, Collection, Kind
from tensorlens.compute.host_statistics import HostStatistics
from tensorlens.compute.jobs import DerivedScalars
from tensorlens.config import DynamicsConfig, HistogramConfig, ReductionConfig, SaveConfig
from tensorlens.dispatch import BackendStats
from tensorlens.dispatch.epochs import check_epoch_statistics
from tensorlens.engine import gather, summary_targets
from tensorlens.engine.counters import StepCounters
from tensorlens.engine.dynamics import Dynamics
from tensorlens.engine.dynamics_steps import DynamicsSteps
from tensorlens.engine.inputs import REDUCE_WHEN_CAPTURED, StepInputs
from tensorlens.engine.metadata import metadata_of
from tensorlens.engine.pending import PendingCaptures
from tensorlens.engine.run_setup import collective_reducer, locate_run, rule_runner
from tensorlens.engine.schedule import Schedule
from tensorlens.engine.sources import ScalarSource, SourceHooks, TensorSource
from tensorlens.engine.step_output import StepOutput
from tensorlens.modes import ModeKeys
from tensorlens.options import WORKER_MODES, Options, from_keywords
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


class Recorder:
    """Records statistics of the tensors its sources and callers give it, one record per saved step.

    Most users want :func:`tensorlens.watch` or :class:`tensorlens.Hook` (a recorder driven by
    module and optimizer hooks); a framework callback drives a recorder directly.

    >>> rec = Recorder(out_dir="runs/exp1", save_config=SaveConfig(save_interval=1))  # doctest: +SKIP
    >>> rec.save_scalar("lr", 0.1); rec.step(); rec.close()                            # doctest: +SKIP

    Args: see :class:`tensorlens.Hook`.
    """

    #: Which entry point's options this class takes (tensorlens.options: a Hook also takes ``scales``).
    _entry = "Recorder"

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
        tracker_stats: str | Sequence[str] | None = None,
        tracker_histogram_interval: int | None = None,
        options: Options | None = None,
    ) -> None:
        opts = from_keywords(self._entry, options, {
            "out_dir": out_dir, "save_config": save_config, "reduction_config": reduction_config,
            "histogram_config": histogram_config, "include_collections": include_collections,
            "include_regex": include_regex, "backends": backends, "run_name": run_name,
            "include_workers": include_workers, "max_pending_steps": max_pending_steps, "resume": resume,
            "dynamics_config": dynamics_config, "epoch_statistics": epoch_statistics, "rules": rules,
            "collective_timeout": collective_timeout, "tracker_stats": tracker_stats,
            "tracker_histogram_interval": tracker_histogram_interval,
        })
        #: The options this recorder was made with (checked: :class:`tensorlens.Options`).
        self.options = opts
        include_workers, collective_timeout = opts.include_workers, opts.collective_timeout
        self.collective_timeout = collective_timeout

        self.schedule = Schedule(
            opts.save_config or SaveConfig(),
            opts.reduction_config,
            opts.histogram_config or HistogramConfig(),
            DEFAULT_KINDS if opts.include_collections is None else names_list("include_collections", opts.include_collections),
            opts.include_regex,
        )
        self.include_workers = include_workers
        self.rank, self.world_size = distributed_rank()
        self.worker = "reduced" if self.world_size > 1 and include_workers == "reduce" else f"worker_{self.rank}"
        reducer = collective_reducer(self.world_size, include_workers, collective_timeout)  # checks its timeout first
        self._backends = resolve_backends("auto" if opts.backends is None else opts.backends, self.rank)
        self._rules = rule_runner(opts.rules, self._backends, self.rank)
        self.run_name, self.run_dir, self.resumed = locate_run(
            opts.out_dir, opts.run_name, opts.resume, self._backends, self.rank, self.world_size, include_workers, collective_timeout,
        )
        run = RunInfo(
            self.run_name, self.run_dir, self.rank, self.world_size, {"include_workers": include_workers},
            metadata=metadata_of(self), modules=self._describe_modules, tracker_stats=opts.tracker_stats,
            tracker_histogram_interval=opts.tracker_histogram_interval,
        )
        self._output = StepOutput(
            self._backends, run, opts.max_pending_steps, check_epoch_statistics(opts.epoch_statistics), reducer, self.rank, self.world_size,
            include_workers, self.worker, self.warn_once,
        )
        self._dispatcher, self._engine = self._output.dispatcher, self._output.statistics
        self._steps = StepCounters()
        self._mode_steps = self._steps.mode_steps  # (the same dict: read at every boundary)
        if self.resumed:  # go on after the last stored steps, so nothing stored is overwritten
            self._steps.continue_stored(self.run_dir, self._store_file())
        self._explicit_mode: ModeKeys | None = None
        self._mode = ModeKeys.TRAIN
        self._open_eval: ModeKeys | None = None  # an eval/predict step that has begun
        self._sources: list[TensorSource] = []
        self._hooks = SourceHooks(self._sources)
        self._pending = PendingCaptures()
        self._inputs = StepInputs(self.schedule, self._pending, self._sources, self._saving, self.warn_once)
        self._mark: tuple[dict[object, int], ...] | None = None  # pending at the last begin_step
        self._dynamics_mark: Any = None  # the dynamics' module captures at the last begin_step
        self._pre_step: tuple[HostStatistics, list[ScalarEntry]] | None = None
        self._update_snapshot: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        #: The bookkeeping of the ``dynamics`` collection (module taps feed it; see engine/dynamics.py).
        self.dynamics = Dynamics(
            opts.dynamics_config or DynamicsConfig(), self.schedule, self.warn_once, lambda: self._mode,
            lambda: not (self._paused or self._closed),
        )
        saves_here = not (self.world_size > 1 and include_workers == "one" and self.rank != 0)
        self._dynamics_steps = DynamicsSteps(self.dynamics, self.schedule, self._inputs.parameters, self._output, self.rank, saves_here)
        native.prepare()  # compile the CPU kernel off the training thread, before the first saved step
        self._warned: set[str] = set()
        self._closed = False
        self._paused = False
        summary_targets.register(self)

    # ------------------------------------------------------------------ run

    def _describe_modules(self) -> list[dict[str, Any]]:
        return [entry for source in self._sources if hasattr(source, "describe") for entry in source.describe()]

    def _store_file(self) -> str:
        return store_filename(f"worker_{self.rank}", primary=self.rank == 0)

    # ------------------------------------------------------------------ configuration

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
        self._steps.set(global_step, mode_steps)

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (Lightning's ``global_step``)."""
        return self._steps.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self._steps.global_step = value

    def will_save(self, collection: str, mode: ModeKeys | str | None = None) -> bool:
        """Whether ``collection`` is enabled and saves the current step of ``mode``."""
        mode = ModeKeys.coerce(mode) if mode is not None else self._mode
        return collection in self._saving(mode)

    def _saving(self, mode: ModeKeys) -> frozenset[str]:
        if self.world_size > 1 and self.include_workers == "one" and self.rank != 0:
            return frozenset()  # "one": ranks other than 0 capture and compute nothing
        return self.schedule.saving(mode, self._mode_steps[mode])

    # ------------------------------------------------------------------ what the recorder is given

    def save_scalar(self, name: str, value: float | int | torch.Tensor) -> None:
        """Record a number under ``scalars/<name>`` in the current step's record, when the
        ``scalars`` collection saves the step (its own save config, else the recorder's)."""
        self._check_open("save a scalar")
        self._inputs.save_scalar(self._mode, self._mode_steps[self._mode], name, value)

    def save_tensor(self, name: str, tensor: torch.Tensor, collections_to_write: str | Iterable[str] = "default") -> None:
        """Record statistics of ``tensor`` in the current step under each of
        ``collections_to_write``, on the steps each of those collections saves (SageMaker
        Debugger's semantics; ``"default"`` is the ``summaries`` collection)."""
        self._check_open("save a tensor")
        self._inputs.save_tensor(self._mode, self._mode_steps[self._mode], name, tensor, collections_to_write)

    def add_loss(self, name: str, value: Any) -> None:
        """A loss value of the current step (a registered loss module's output): recorded under
        ``losses/<name>`` on saved steps, the mean when given several times in a step."""
        if not (self._closed or self._paused or not isinstance(value, torch.Tensor)):
            self._inputs.add_loss(self._mode, name, value)

    def add_summary(self, name: str, value: Any, is_tensor: bool) -> None:
        """``tl.summarize_scalar`` / ``tl.summarize_tensor`` land here (from inside ``forward``)."""
        try:
            if not (self._closed or self._paused):
                self._inputs.add_summary(self._mode, name, value, is_tensor)
        except Exception as err:
            self.warn_once(f"summarize {name!r}: {type(err).__name__}: {err}")

    def capture(self, kind: str, module_name: str, name: str, tensor: torch.Tensor) -> None:
        """A module tensor captured on a saved step (by a source's hooks). Large tensors are
        reduced at once where every job that will record them can use the result, so no copy is
        held until the step ends and the values are read while in cache; the others are held as
        they are, or copied where an in-place op after the module could change them (see
        :meth:`PendingCaptures.add_captured`)."""
        if self._paused:
            return
        try:
            self._inputs.capture(self._mode, kind, module_name, name, tensor)
        except Exception as err:
            self.warn_once(f"capturing {kind}/{name}: {type(err).__name__}: {err}")

    def _parameters(self) -> list[tuple[str, torch.Tensor]]:
        return self._inputs.parameters()

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
        jobs = self._inputs.parameter_jobs(saving) + self._inputs.pending_jobs(saving, mode)
        host_scalars = self._inputs.host_scalars(optimizer, saving, self.global_step)
        self._pre_step = (self._output.compute(jobs, saving), host_scalars)
        self._dynamics_steps.before_update(saving, mode, self._mode_steps[mode], self.global_step)
        if self.schedule.with_kinds(saving, (Kind.UPDATES,)):
            self._update_snapshot = gather.update_snapshot(self.schedule, self._parameters(), saving)

    def step(self) -> None:
        """Close the current train step (records it if it is saved) and advance the step counter."""
        self._check_open("close a step")
        if self._pre_step is None:
            self.prepare_step(None)
        self._finish_train_step()
        self.take_rule_actions()

    def read_clipped_gradients(self) -> None:
        """Read the gradients again after clipping, between :meth:`prepare_step` and :meth:`step`
        (the Lightning callback does it with ``record_clipped_gradients``):
        ``dynamics/global`` then also holds ``grad_norm_clipped``."""
        self._check_open("read clipped gradients")
        self._dynamics_steps.read_clipped()

    def end_epoch(self, epoch: int | None = None) -> None:
        """Close an epoch: record the mean, min, max and std of the chosen statistics
        (``epoch_statistics``) across the train steps saved since the last ``end_epoch``, under
        ``epochs/<collection>/<tensor>`` with statistics ``<stat>_mean``, ``<stat>_min``, ...,
        in a record of mode ``epoch`` whose mode step is ``epoch`` (default: one more than the
        last). Lightning's callback calls it at ``on_train_epoch_end``.

        >>> hook.end_epoch()                                                            # doctest: +SKIP
        >>> run.tensor("epochs/gradients/fc1.weight").reduction_value(step=0, name="l2_mean")  # doctest: +SKIP
        """
        self._check_open("end an epoch")
        self._output.end_epoch(self.global_step, self._steps.end_epoch(epoch))

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
        jobs, module_scalars = self._dynamics_steps.of_modules(saving, mode)
        derived = DerivedScalars.concat([module_scalars, self._dynamics_steps.after_update(saving)])
        # a value given between prepare_step and step (a callback's loss, clipped gradients) is the closing step's
        given = mode in self._pending.modes_with_values()
        # "reduce": on a saved step every rank computes, whatever it holds, so collectives match
        if self._update_snapshot or given or (self._output.reducer is not None and saving) or derived is not None or jobs:
            jobs += gather.update_jobs(self.schedule, self._update_snapshot, saving)
            self._update_snapshot = []
            # save_tensor between prepare_step and step belongs to the step being closed
            # (Lightning: gradients after clipping, read once the optimizer has stepped)
            jobs += self._inputs.pending_jobs(saving, mode)
            parts.append(self._output.compute(jobs, saving, derived))
            if derived is not None:
                self._dynamics_steps.complete_nonfinite(parts[-1], saving)
        self._output.submit(self.global_step, mode, self._mode_steps[mode], parts, host_scalars)
        self._advance(mode)

    def _advance(self, mode: ModeKeys) -> None:
        self._steps.advance(mode)
        if self._hooks.attached:  # (an unsaved step has nothing to look ahead for)
            self._hooks.end(self.schedule.with_kinds(self._saving(mode), MODULE_KINDS), self.schedule.version)

    def _close_eval_step(self) -> None:
        mode = self._open_eval
        self._open_eval = None
        if mode is None:
            return
        saving = self._saving(mode)
        module_jobs, module_scalars = self._dynamics_steps.of_modules(saving, mode)
        jobs = self._inputs.pending_jobs(saving, mode) + module_jobs
        if jobs or module_scalars is not None or (self._output.reducer is not None and saving):  # "reduce": every rank, for the collectives
            self._output.submit(self.global_step, mode, self._mode_steps[mode], [self._output.compute(jobs, saving, module_scalars)], [])
        self._mode_steps[mode] += 1
        self._hooks.detach()

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
                jobs = self._inputs.pending_jobs(self._saving(mode), mode)
                if jobs:  # no collectives (see compute_here): values saved after the last step are this rank's own
                    self._output.submit(self.global_step, mode, self._mode_steps[mode], [self._output.compute_here(jobs)], [])
        except Exception as err:
            self.warn_once(f"close: {type(err).__name__}: {err}")
        self._closed = True
        self._hooks.detach()
        self._pending.clear()
        self.dynamics.release()
        summary_targets.unregister(self)
        self._output.close()
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
