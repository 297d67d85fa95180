"""The Hook: a :class:`~tensorlens.engine.recorder.Recorder` driven by torch hooks, so that no call
is needed in the training loop.

Step boundaries:

- **train**: an optimizer step. A global optimizer step pre-hook reads weights and gradients
  (so gradients are the accumulated ones, and unscaled when ``GradScaler.step`` unscales
  before stepping), the post-hook closes the step. ``hook.step()`` does the same by hand for loops
  without a ``torch.optim`` optimizer. With several optimizers, the first one that steps a
  watched parameter marks the boundary.
- **eval / predict**: each forward call of a registered root module is one mode step; it is
  closed when the next one starts, when the mode changes, or at ``close()``.

The mode follows ``module.training`` of the root unless :meth:`Hook.set_mode` fixed it. This module
holds only the torch plumbing (module and optimizer hooks, ``atexit``); everything else is the
recorder's.
"""

from __future__ import annotations

import atexit
import inspect
import re
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from tensorlens._checks import expected
from tensorlens._runtime import compiling, in_backward
from tensorlens.capture.modules import ModuleTaps
from tensorlens.engine.recorder import Recorder, guarded
from tensorlens.modes import ModeKeys
from tensorlens.options import Options, from_keywords

_RECORDER_SIGNATURE = inspect.signature(Recorder.__init__)


class Hook(Recorder):
    """Watches one or more modules and records statistics of their tensors.

    >>> hook = Hook(out_dir="runs/exp1", save_config=SaveConfig(save_interval=10))  # doctest: +SKIP
    >>> hook.register_module(model)                                               # doctest: +SKIP
    >>> with hook: train(model)                                                   # doctest: +SKIP

    Args:
        out_dir: the run folder; default ``./tensorlens_runs/<run_name>``.
        save_config: which steps to save (per collection overridable).
        reduction_config: statistics for every tensor collection (per collection overridable);
            default ``min max mean std l2`` (+ ``zero_fraction`` for activations).
        histogram_config: histogram settings; ``HistogramConfig(bins=0)`` turns them off.
        include_collections: collection names to record (``"all"`` and ``"default"`` expand);
            default ``weights biases gradients losses summaries scalars``.
        include_regex: extra name patterns recorded in the ``custom`` collection.
        backends: ``"auto"`` (the local store plus the active W&B / MLflow run, if any), or a
            list of names, ``Backend`` classes or instances. The local store is always added.
        run_name: name of the run (default: the active tracker run's name, else time + id).
        include_workers: under ``torch.distributed``: ``"reduce"`` (statistics of the whole,
            merged across ranks), ``"one"`` (rank 0 only) or ``"all"`` (each rank on its own).
        max_pending_steps: saved steps that may wait for the background thread before
            training waits for it.
        resume: ``"never"`` (default: an existing run folder is an error; a derived run name
            moves on to ``-2``), ``"allow"`` or ``"must"`` continue a stored run, as in
            ``wandb.init``; see :mod:`tensorlens.store.runs`.
        dynamics_config: what the ``dynamics`` collection records (a :class:`tl.DynamicsConfig`;
            enable the collection with ``include_collections=[..., "dynamics"]``).
        epoch_statistics: the statistics :meth:`end_epoch` aggregates: ``None`` (plain values,
            ``l2`` and the dynamics), ``"all"``, or names such as ``["l2", "gradients/std"]``.
        collective_timeout: seconds tensorlens's own collectives may wait for the other ranks
            (default ``$TENSORLENS_COLLECTIVE_TIMEOUT`` or 60); a rank that stops taking part
            costs the others this once, then each records its own values, with one warning.
        scales: record the per-op forward and backward scales at the steps the ``scales``
            collection saves (:mod:`tensorlens.scales`); ``scales_plot_interval``: every this
            many of those steps the log2 plot is drawn into ``<run_dir>/scales/`` (``None``: never).
        tracker_stats: what each tracker receives of a record: ``"default"`` (histograms of the
            parameters, one panel per collection and statistic, the global values), ``"all"``, or
            statistic names (``["l2", "histogram"]``); see :mod:`tensorlens.backends.payload`.
        tracker_histogram_interval: train steps between the records whose histograms go to the
            trackers (``None``: 100 with the ``"default"`` payload, every saved step otherwise).
        rules: :mod:`tensorlens.rules` checked on every saved step in the background; their
            actions are taken at the next optimizer step (``hook.should_stop``, ``hook.findings()``).
        options: a :class:`tensorlens.Options` holding all of the above instead (then leave them
            at their defaults).
    """

    _entry = "Hook"

    def __init__(
        self, *args: Any, scales: bool = False, scales_plot_interval: int | None = 10, options: Options | None = None,
        **kwargs: Any,
    ) -> None:
        # the recorder's keywords by name (a wrong one is a TypeError, as always), checked with
        # the Hook's own in one place: tensorlens.options
        given = _RECORDER_SIGNATURE.bind(self, *args, **kwargs).arguments
        given.pop("self")
        opts = from_keywords("Hook", options, {**given, "scales": scales, "scales_plot_interval": scales_plot_interval})
        super().__init__(options=opts)
        self._taps = ModuleTaps(self._untraced(self.capture), self.warn_once, _UntracedDynamics(self.dynamics, self._untraced))
        self.add_source(self._taps)
        self._scales: Any = None
        if opts.scales:
            from tensorlens.scales.source import ScaleSource

            self.schedule.enable("scales")
            self._scales = ScaleSource(self.run_dir, opts.scales_plot_interval)
            self.add_source(self._scales)
            self._arm_scales()
        self._root_handles: list[RemovableHandle] = []
        self._hooked_roots: set[int] = set()  # ids of the modules whose forward marks a step
        self._forward_depth = 0
        self._primary_optimizer: weakref.ref[torch.optim.Optimizer] | None = None
        self._optimizer_handles = [
            register_optimizer_step_pre_hook(self._weak(Hook._optimizer_pre_step)),
            register_optimizer_step_post_hook(self._weak(Hook._optimizer_post_step)),
        ]
        self._atexit = self._weak(Hook.close)
        atexit.register(self._atexit)

    @classmethod
    def create_from_json_file(cls, json_file_path: str | None = None, **overrides: Any) -> Hook:
        """A hook from SageMaker Debugger's JSON hook configuration (``json_file_path``, else
        ``$TENSORLENS_CONFIG_FILE_PATH``, else SageMaker's default location); see
        :mod:`tensorlens.json_config`.

        >>> hook = tl.Hook.create_from_json_file("debughookconfig.json")   # doctest: +SKIP
        """
        from tensorlens.json_config import create_hook_from_json_file

        return create_hook_from_json_file(cls, json_file_path, **overrides)

    def _weak(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """A callable that does not keep the hook alive (global hooks, atexit)."""
        ref = weakref.ref(self)

        def call(*args: Any, **kwargs: Any) -> Any:
            hook = ref()
            return None if hook is None else method(hook, *args, **kwargs)

        return call

    # ------------------------------------------------------------------ what is watched

    def register_module(self, module: nn.Module, name: str | None = None) -> Hook:
        """Watch ``module``; ``name`` prefixes its tensor names (for several models in one run).

        A TorchScript module takes no Python hooks: its parameters and gradients are still
        recorded (they are read at the optimizer step), with one warning saying what is not.
        """
        self._check_open("register a module")
        if not isinstance(module, nn.Module):
            raise expected("module", "a torch.nn.Module", module)
        if name is not None and (not isinstance(name, str) or not re.fullmatch(r"[\w.\-]+", name)):
            raise expected("name", "None or a name of letters, digits, '_', '.' and '-'", name)
        module, hooked = _watch_targets(module)
        if not self._taps.add_root(module, name or ""):
            return self
        if isinstance(hooked, torch.jit.ScriptModule):
            self.warn_once(
                f"TorchScript module {type(hooked).__name__}: it takes no Python hooks, so eval/predict steps, "
                "activations, inputs and losses are not recorded; weights and gradients are"
            )
            return self
        self._hooked_roots.add(id(hooked))
        # always_call: a forward that raises (a skipped out-of-memory batch) still ends the call
        self._root_handles.append(hooked.register_forward_pre_hook(self._weak(Hook._root_forward_pre), with_kwargs=True))
        self._root_handles.append(hooked.register_forward_hook(self._weak(Hook._root_forward_post), always_call=True))
        return self

    def register_loss(self, loss_module: nn.Module, name: str | None = None) -> Hook:
        """Record the output of ``loss_module`` under ``losses/<name>`` on saved steps
        (the mean when it is called several times in one step)."""
        self._check_open("register a loss")
        if not isinstance(loss_module, nn.Module):
            raise expected(
                "loss_module",
                "a torch.nn.Module (for a plain function call hook.save_scalar('loss', loss) instead)",
                loss_module,
            )
        if name is not None and (not isinstance(name, str) or not name):
            raise expected("name", "None or a non-empty string", name)
        loss_name = name or type(loss_module).__name__.lower()
        recorder = weakref.ref(self)

        def record(module: nn.Module, args: Any, output: Any) -> None:
            hook = recorder()
            if hook is not None and (compiling() or not in_backward()):
                hook._untraced(hook.add_loss)(loss_name, output)

        self._root_handles.append(loss_module.register_forward_hook(record))
        return self

    # ------------------------------------------------------------------ hook callbacks

    def _current_mode(self, module: nn.Module) -> ModeKeys:
        if self.explicit_mode is not None:
            return self.explicit_mode
        return ModeKeys.TRAIN if module.training else ModeKeys.EVAL

    def _untraced(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with the per-op scale recording paused (tensorlens's own ops are not the model's)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._scales is None or not self._scales.capture.capturing:
                return fn(*args, **kwargs)
            with self._scales.paused():
                return fn(*args, **kwargs)

        return call

    def add_summary(self, name: str, value: Any, is_tensor: bool) -> None:
        self._untraced(super().add_summary)(name, value, is_tensor)

    @guarded
    def _root_forward_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if compiling():
            # traced by torch.compile (the root was compiled after it was watched): reading the
            # step counters here would guard the graph on them and recompile it every step
            return
        if id(module) not in self._hooked_roots or self.closed:
            return  # a copy.deepcopy of the watched model (an EMA or teacher) carries our hooks along
        if in_backward():
            return  # gradient checkpointing re-runs the forward during backward: not a new step
        self._forward_depth += 1
        if self._forward_depth > 1:
            return
        self._untraced(self.begin_step)(self._current_mode(module))
        if self._scales is not None and self.will_save("scales"):
            self._scales.start(self._taps.roots, module, args, kwargs)

    @guarded
    def _root_forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if compiling() or id(module) not in self._hooked_roots or in_backward():
            return
        self._forward_depth = max(0, self._forward_depth - 1)
        if self._forward_depth == 0 and self._scales is not None:
            self._scales.stop(output)
        if self._forward_depth == 0 and sys.exc_info()[1] is not None:
            # always_call: the forward raised (we run inside its exception handler); the loop
            # will skip this batch, so what it captured must not join the next one's
            self.abandon_step()

    def _optimizer_pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.closed:
            return
        if (self._primary_optimizer is None or self._primary_optimizer() is None) and self._owns(optimizer):
            self._primary_optimizer = weakref.ref(optimizer)
        if self._primary_optimizer is not None and self._primary_optimizer() is optimizer:
            self.prepare_step(optimizer)

    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` updates a watched parameter: another model's optimizer stepping
        first (a GAN's discriminator, a second model) must not become this hook's step boundary."""
        if not self._taps.roots:
            return True
        watched = {id(p) for _, p in self._parameters()}
        return any(id(p) in watched for group in optimizer.param_groups for p in group["params"])

    def _optimizer_post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.closed and self._primary_optimizer is not None and self._primary_optimizer() is optimizer:
            self._finish_train_step()
            self._arm_scales()
            self.take_rule_actions()  # a rule's "raise" leaves through optimizer.step()

    def step(self) -> None:
        super().step()
        self._arm_scales()

    def _arm_scales(self) -> None:
        """Before a step that saves scales, a model compiled after it was watched must run eagerly
        (its root hooks are traced by dynamo otherwise, and no op would be recorded)."""
        if self._scales is not None and "torch._dynamo" in sys.modules and self.will_save("scales", ModeKeys.TRAIN):
            self._scales.arm()

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Record what is pending, remove every hook, flush and close the backends. Idempotent."""
        if self.closed:
            return
        super().close()
        if self._scales is not None:
            self._scales.close()
        for handle in self._root_handles + self._optimizer_handles:
            handle.remove()
        self._root_handles.clear()
        self._optimizer_handles.clear()
        atexit.unregister(self._atexit)

    def __enter__(self) -> Hook:
        return self


class _UntracedDynamics:
    """The recorder's :class:`~tensorlens.engine.dynamics.Dynamics` as module hooks see it: its
    reductions are tensorlens's own ops, so per-op scale recording is paused around them."""

    def __init__(self, dynamics: Any, untraced: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        self._dynamics = dynamics
        self.add_output = untraced(dynamics.add_output)
        self.add_grad_norms = untraced(dynamics.add_grad_norms)

    @property
    def config(self) -> Any:
        return self._dynamics.config


def _watch_targets(module: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``(module whose names are recorded, module that carries the root hooks)``.

    Wrappers are looked through so names stay those of the model (no ``module.`` or
    ``_orig_mod.`` prefix). DDP calls its inner module, so the hooks go there; a module compiled
    with ``torch.compile(model)`` keeps them on the wrapper, whose hooks run outside the compiled
    graph (no guard on tensorlens' counters, no recompilation).
    """
    inner = module
    while True:
        if type(inner).__name__ == "OptimizedModule" and isinstance(getattr(inner, "_orig_mod", None), nn.Module):
            inner = inner._orig_mod
        elif isinstance(inner, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            inner = inner.module
        else:
            break
    return inner, module if type(module).__name__ == "OptimizedModule" else inner
