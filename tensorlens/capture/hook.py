"""The hook: watches modules, decides which steps are saved, and hands each saved step to the
statistics engine and then to the dispatcher.

Step boundaries (no user call needed):

- **train**: an optimizer step. A global optimizer step pre-hook reads weights and gradients
  (so gradients are the accumulated ones, and unscaled when ``GradScaler.step`` unscales
  before stepping), the post-hook closes the step. ``hook.step()`` does the same by hand for loops
  without a ``torch.optim`` optimizer. With several optimizers, the first one that steps marks
  the boundary.
- **eval / predict**: each forward call of a registered root module is one mode step; it is
  closed when the next one starts, when the mode changes, or at ``close()``.

The mode follows ``module.training`` of the root unless :meth:`Hook.set_mode` fixed it.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import time
import uuid
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from tensorlens.backends.base import Backend, RunInfo, create_backend
from tensorlens.capture import summaries
from tensorlens.capture.modules import ModuleCapture
from tensorlens.collection import (
    ALIASES,
    DEFAULT_KINDS,
    KINDS,
    MODULE_KINDS,
    SCALAR_KINDS,
    Collection,
    parameter_kind,
)
from tensorlens.config import HistogramConfig, ReductionConfig, SaveConfig, expected
from tensorlens.dispatch import BackendStats, Dispatcher
from tensorlens.engine.assemble import PendingStep, build_record
from tensorlens.engine.jobs import ReducedPiece, ReducePlan, TensorJob, WorkerReducer, reduce_now, reduce_plan
from tensorlens.engine.step import HostStatistics, StepStatistics
from tensorlens.modes import ModeKeys
from tensorlens.records import ScalarEntry
from tensorlens.stats import native
from tensorlens.store.schema import safe_run_name

DEFAULT_RUNS_DIR = "tensorlens_runs"
WORKER_MODES = ("reduce", "one", "all")

#: Reductions recorded when neither the hook nor the collection says otherwise.
DEFAULT_REDUCTIONS = ReductionConfig()
DEFAULT_ACTIVATION_REDUCTIONS = ReductionConfig(counts=("zero_fraction",))


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a hook callback so that no error of ours can take the training step down."""

    @functools.wraps(fn)
    def wrapper(self: Hook, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except Exception as err:
            self._warn_once(f"{fn.__name__}: {type(err).__name__}: {err}")
            return None

    return wrapper


class Hook:
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
        step_on_forward: ``False`` when the caller marks steps with :meth:`begin_step` /
            :meth:`end_step` instead of forward calls of the registered roots (Lightning).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str] | None = None,
        save_config: SaveConfig | None = None,
        reduction_config: ReductionConfig | None = None,
        histogram_config: HistogramConfig | None = None,
        include_collections: Iterable[str] | None = None,
        include_regex: Iterable[str] | str | None = None,
        backends: str | Sequence[str | Backend | type[Backend]] = "auto",
        run_name: str | None = None,
        include_workers: str = "reduce",
        max_pending_steps: int = 64,
        auto_step: bool = True,
        step_on_forward: bool = True,
    ) -> None:
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
        if run_name is not None and not isinstance(run_name, str):
            raise expected("run_name", "None or a string", run_name)
        if not isinstance(auto_step, bool):
            raise expected("auto_step", "a bool", auto_step)
        if not isinstance(step_on_forward, bool):
            raise expected("step_on_forward", "a bool", step_on_forward)

        self.save_config = save_config or SaveConfig()
        self.reduction_config = reduction_config
        self.histogram_config = histogram_config or HistogramConfig()
        self.include_workers = include_workers
        self._collections: dict[str, Collection] = {kind: Collection(kind) for kind in KINDS}
        self._enabled: set[str] = set()
        for name in DEFAULT_KINDS if include_collections is None else _names_list("include_collections", include_collections):
            self._enable(name)
        if include_regex is not None:
            patterns = [include_regex] if isinstance(include_regex, str) else list(include_regex)
            self.get_collection("custom").include(*patterns)

        self.rank, self.world_size = _distributed_rank()
        self.worker = "reduced" if self.world_size > 1 and include_workers == "reduce" else f"worker_{self.rank}"
        self._reducer: WorkerReducer | None = None
        if self.world_size > 1 and include_workers == "reduce":
            from tensorlens.engine.distributed import CollectiveReducer

            self._reducer = CollectiveReducer()

        self.run_name = safe_run_name(run_name or _tracker_run_name() or _default_run_name())
        self.run_dir = os.path.abspath(os.fspath(out_dir)) if out_dir is not None else os.path.abspath(
            os.path.join(DEFAULT_RUNS_DIR, self.run_name)
        )
        if self.world_size > 1 and include_workers == "all":
            from tensorlens.engine.distributed import broadcast_run

            # every rank's file in one folder: a default run name holds a time and a random id
            self.run_name, self.run_dir = broadcast_run(self.run_name, self.run_dir)
        self._backends = self._resolve_backends(backends)
        run = RunInfo(self.run_name, self.run_dir, self.rank, self.world_size, {"include_workers": include_workers})
        self._dispatcher = Dispatcher(self._backends, run, max_pending=max_pending_steps, build=build_record)

        self.global_step = 0  # optimizer steps taken (Lightning's global_step)
        self._mode_steps = dict.fromkeys(ModeKeys, 0)
        self._explicit_mode: ModeKeys | None = None
        self._mode = ModeKeys.TRAIN
        self._open_eval: ModeKeys | None = None  # an eval/predict step that has begun
        self._roots: list[tuple[str, nn.Module]] = []
        self._root_handles: list[RemovableHandle] = []
        self._hooked_roots: set[int] = set()  # ids of the modules whose forward marks a step
        self._forward_depth = 0
        # False: the caller marks every step with begin_step()/end_step() (Lightning calls
        # training_step/validation_step, not necessarily the root's forward, once per step)
        self._step_on_forward = step_on_forward
        self._capture = ModuleCapture(self._captured)
        # keyed by (mode, kind, name): a validation step in the middle of a gradient accumulation
        # window must not take the train micro-batches' captures, nor they its own
        self._pending: dict[tuple[ModeKeys, str, str], list[torch.Tensor]] = defaultdict(list)
        # per (mode, kind, module): what to reduce a large capture with, or None; valid while the
        # configs that decide it are unchanged (_check_plans, at a step's first capture)
        self._capture_plans: dict[tuple[object, ...], ReducePlan | None] = {}
        self._plans_step: tuple[ModeKeys, int] | None = None
        self._plans_configs: tuple[object, ...] | None = None
        self._module_of: dict[str, str] = {}  # captured tensor name -> the module it came from
        self._pending_scalars: dict[tuple[ModeKeys, str, str], list[float | torch.Tensor]] = defaultdict(list)
        self._explicit: list[tuple[str, str, torch.Tensor]] = []  # save_tensor: (collection, name, tensor)
        self._host_scalars: list[ScalarEntry] = []
        self._primary_optimizer: weakref.ref[torch.optim.Optimizer] | None = None
        self._pre_step: tuple[HostStatistics, list[ScalarEntry]] | None = None
        self._update_snapshot: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self._saving_cache: tuple[ModeKeys, int, frozenset[str]] | None = None
        self._engine = StepStatistics()
        native.prepare()  # compile the CPU kernel off the training thread, before the first saved step
        self._warned: set[str] = set()
        self._closed = False
        self._optimizer_handles = (
            [
                register_optimizer_step_pre_hook(self._weak(Hook._optimizer_pre_step)),
                register_optimizer_step_post_hook(self._weak(Hook._optimizer_post_step)),
            ]
            if auto_step
            else []
        )
        summaries.activate(self)
        self._atexit = self._weak(Hook.close)
        atexit.register(self._atexit)

    # ------------------------------------------------------------------ configuration

    def _weak(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """A callable that does not keep the hook alive (global hooks, atexit)."""
        ref = weakref.ref(self)

        def call(*args: Any, **kwargs: Any) -> Any:
            hook = ref()
            return None if hook is None else method(hook, *args, **kwargs)

        return call

    def _resolve_backends(self, spec: str | Sequence[str | Backend | type[Backend]]) -> list[Backend]:
        if isinstance(spec, str):
            if spec != "auto":
                spec = [spec]
            else:
                spec = _active_trackers()
        elif not isinstance(spec, Sequence):
            raise expected("backends", '"auto" or a list of names, Backend classes or instances', spec)
        backends = [create_backend(s) for s in spec]
        if not any(b.name == "local" for b in backends):
            backends.insert(0, create_backend("local"))
        if self.rank != 0:  # trackers are rank 0's in every mode; "all" gives each rank its local store
            backends = [b for b in backends if not b.main_process_only]
        return backends

    def _enable(self, name: str) -> None:
        for kind in ALIASES.get(name, (name,)):
            self.get_collection(kind)
            self._enabled.add(kind)
        self._saving_cache = None

    def get_collection(self, name: str) -> Collection:
        """The collection called ``name``, created (as a custom collection) if new.

        Configuring a collection (``include``) enables it; built-ins are also enabled through
        ``include_collections``.
        """
        if name not in self._collections:
            self._collections[name] = Collection(name)
        collection = self._collections[name]
        if collection.patterns or not collection.builtin:
            self._enabled.add(name)
        self._saving_cache = None
        return collection

    @property
    def collections(self) -> dict[str, Collection]:
        return dict(self._collections)

    def enabled_collections(self) -> list[str]:
        return sorted(n for n in self._enabled if n in self._collections and self._collections[n].kinds)

    def add_collection(self, collection: Collection) -> Collection:
        """Add (and enable) a collection built by hand."""
        if not isinstance(collection, Collection):
            raise expected("collection", "a tl.Collection", collection)
        self._collections[collection.name] = collection
        self._enabled.add(collection.name)
        self._saving_cache = None
        return collection

    def register_module(self, module: nn.Module, name: str | None = None) -> Hook:
        """Watch ``module``; ``name`` prefixes its tensor names (for several models in one run)."""
        if not isinstance(module, nn.Module):
            raise expected("module", "a torch.nn.Module", module)
        if name is not None and (not isinstance(name, str) or not re.fullmatch(r"[\w.\-]+", name)):
            raise expected("name", "None or a name of letters, digits, '_', '.' and '-'", name)
        module, hooked = _watch_targets(module)
        if any(m is module for _, m in self._roots):
            return self
        prefix = name or ""
        if any(p == prefix for p, _ in self._roots):
            raise ValueError(
                f"A module is already registered under the name {prefix!r}: pass name=... to register_module "
                "so the tensors of the two models get distinct names"
            )
        self._roots.append((prefix, module))
        self._hooked_roots.add(id(hooked))
        self._root_handles.append(hooked.register_forward_pre_hook(self._weak(Hook._root_forward_pre)))
        self._root_handles.append(hooked.register_forward_hook(self._weak(Hook._root_forward_post)))
        return self

    def register_loss(self, loss_module: nn.Module, name: str | None = None) -> Hook:
        """Record the output of ``loss_module`` under ``losses/<name>`` on saved steps
        (the mean when it is called several times in one step)."""
        if not isinstance(loss_module, nn.Module):
            raise expected(
                "loss_module",
                "a torch.nn.Module (for a plain function call hook.save_scalar('loss', loss) instead)",
                loss_module,
            )
        loss_name = name or type(loss_module).__name__.lower()

        def record(module: nn.Module, args: Any, output: Any) -> None:
            self._loss_output(loss_name, output)

        self._root_handles.append(loss_module.register_forward_hook(record))
        return self

    def set_mode(self, mode: ModeKeys | str | None) -> None:
        """Fix the mode (``tl.modes.TRAIN``, ``EVAL``, ``PREDICT``, ``GLOBAL``); ``None`` follows
        ``module.training`` again."""
        new = None if mode is None else ModeKeys.coerce(mode)
        if self._open_eval is not None and new != self._open_eval:
            self._close_eval_step()
        self._explicit_mode = new
        if new is not None:
            self._mode = new

    @property
    def mode(self) -> ModeKeys:
        return self._mode

    def mode_step(self, mode: ModeKeys | str | None = None) -> int:
        return self._mode_steps[ModeKeys.coerce(mode or self._mode)]

    # ------------------------------------------------------------------ explicit values

    def save_scalar(self, name: str, value: float | int | torch.Tensor) -> None:
        """Record a number under ``scalars/<name>`` in the current step's record."""
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise expected("value", "a number or a one-element tensor", f"a tensor of shape {tuple(value.shape)}")
            self._pending_scalars[(self._mode, "scalars", name)].append(value.detach().clone())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            self._pending_scalars[(self._mode, "scalars", name)].append(float(value))
        else:
            raise expected("value", "a number or a one-element tensor", value)

    def save_tensor(self, name: str, tensor: torch.Tensor, collections_to_write: str | Iterable[str] = "default") -> None:
        """Record statistics of ``tensor`` in the current step under each of ``collections_to_write``."""
        if not isinstance(tensor, torch.Tensor):
            raise expected("tensor", "a torch.Tensor", tensor)
        names = [collections_to_write] if isinstance(collections_to_write, str) else list(collections_to_write)
        for collection in names:
            if collection == "default":
                collection = "summaries"
            self._collections.setdefault(collection, Collection(collection))
            self._explicit.append((collection, name, tensor.detach().clone()))

    # ------------------------------------------------------------------ what is saved when

    def _saving(self, mode: ModeKeys, mode_step: int) -> frozenset[str]:
        """Names of the enabled collections that save this (mode, mode step)."""
        if self.world_size > 1 and self.include_workers == "one" and self.rank != 0:
            return frozenset()  # "one": ranks other than 0 capture and compute nothing
        cache = self._saving_cache
        if cache is not None and cache[0] == mode and cache[1] == mode_step:
            return cache[2]
        saving = frozenset(
            name
            for name in self._enabled
            if (c := self._collections.get(name)) is not None
            and (c.save_config or self.save_config).should_save(mode, mode_step)
        )
        self._saving_cache = (mode, mode_step, saving)
        return saving

    def _collections_for(self, kind: str, name: str, saving: frozenset[str]) -> list[Collection]:
        return [c for n in saving if (c := self._collections[n]).matches(kind, name)]

    def _job(
        self, collection: Collection, kind: str, name: str, pieces: list[torch.Tensor], partitioned: bool = True
    ) -> TensorJob:
        reduction = collection.reduction_config or self.reduction_config or (
            DEFAULT_ACTIVATION_REDUCTIONS if kind == "activations" else DEFAULT_REDUCTIONS
        )
        return TensorJob(
            name=collection.record_name(kind, name),
            pieces=pieces,
            stats=reduction.stat_names(),
            histogram=collection.histogram_config or self.histogram_config,
            save_raw=reduction.save_raw_tensor,
            save_shape=reduction.save_shape,
            plain_scalar=kind in SCALAR_KINDS,
            partitioned=partitioned,
        )

    def _current_mode(self, module: nn.Module) -> ModeKeys:
        if self._explicit_mode is not None:
            return self._explicit_mode
        return ModeKeys.TRAIN if module.training else ModeKeys.EVAL

    # ------------------------------------------------------------------ hook callbacks

    @_guarded
    def _root_forward_pre(self, module: nn.Module, args: Any) -> None:
        if _compiling():
            # traced by torch.compile (the root was compiled after it was watched): reading the
            # step counters here would guard the graph on them and recompile it every step
            return
        if id(module) not in self._hooked_roots:
            return  # a copy.deepcopy of the watched model (an EMA or teacher) carries our hooks along
        self._forward_depth += 1
        if self._forward_depth > 1 or not self._step_on_forward:
            return
        self._begin(self._current_mode(module))

    def _begin(self, mode: ModeKeys) -> None:
        if self._open_eval is not None:
            self._close_eval_step()  # the next forward begins: the previous eval step is complete
        self._mode = mode
        if mode in (ModeKeys.EVAL, ModeKeys.PREDICT):
            self._open_eval = mode
        saving = self._saving(mode, self._mode_steps[mode])
        module_collections = [self._collections[n] for n in saving if set(self._collections[n].kinds) & set(MODULE_KINDS)]
        if module_collections and not self._capture.attached:
            self._attach_capture(module_collections)

    @_guarded
    def _root_forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if _compiling() or id(module) not in self._hooked_roots:
            return
        self._forward_depth = max(0, self._forward_depth - 1)

    def _attach_capture(self, collections: list[Collection]) -> None:
        chosen: dict[str, list[tuple[str, nn.Module]]] = {kind: [] for kind in MODULE_KINDS}
        for prefix, root in self._roots:
            for name, module in root.named_modules():
                full = ".".join(p for p in (prefix, name) if p) or "model"
                leaf = next(module.children(), None) is None
                for kind in MODULE_KINDS:
                    for c in collections:
                        if kind in c.kinds and (c.matches(kind, full) if c.patterns else (c.builtin and leaf)):
                            chosen[kind].append((full, module))
                            break
        self._capture.attach(chosen["activations"], chosen["inputs"], chosen["activation_gradients"])

    def _captured(self, kind: str, module_name: str, name: str, tensor: torch.Tensor) -> None:
        try:
            # reduced at once where possible; else copied, so in-place ops later cannot change it
            piece = self._reduce_captured(kind, module_name, tensor)
            self._pending[(self._mode, kind, name)].append(piece if piece is not None else tensor.detach().clone())
            self._module_of[name] = module_name
        except Exception as err:
            self._warn_once(f"capturing {kind}/{name}: {type(err).__name__}: {err}")

    def _reduce_captured(self, kind: str, module_name: str, tensor: torch.Tensor) -> ReducedPiece | None:
        """A large captured CPU tensor reduced by the compiled kernel right in the hook, when every
        job that will record it can use the result (same histogram, no raw save): nothing of its
        values is kept but its sample (a Transformer's activations: 64 MB of copies per step), and
        it is read once while still in cache. Small ones are copied and reduced in one batch at the
        step's end: a kernel call per tensor costs ~50 us, a copy of 32K values 5 us."""
        if _compiling() or tensor.device.type != "cpu" or tensor.numel() < REDUCE_WHEN_CAPTURED:
            return None
        saving = self._saving(self._mode, self._mode_steps[self._mode])
        if self._plans_step != (self._mode, self._mode_steps[self._mode]):
            self._check_plans(saving)
        key = (self._mode, kind, module_name)
        if key not in self._capture_plans:  # once per module while the configs stay the same
            jobs = [self._job(c, kind, module_name, []) for c in self._collections_for(kind, module_name, saving)]
            usable = jobs and not any(job.save_raw or job.histogram != jobs[0].histogram for job in jobs)
            stats = tuple(dict.fromkeys(stat for job in jobs for stat in job.stats))
            self._capture_plans[key] = reduce_plan(stats, jobs[0].histogram) if usable else None
        plan = self._capture_plans[key]
        return reduce_now(tensor, plan) if plan is not None else None

    def _check_plans(self, saving: frozenset[str]) -> None:
        """Forget the capture plans when anything that decides them changed (collections saved,
        their configs and patterns, the hook's configs); called at the first capture of a step."""
        self._plans_step = (self._mode, self._mode_steps[self._mode])
        configs = (
            saving, self.reduction_config, self.histogram_config,
            *((c.name, c.kinds, c.reduction_config, c.histogram_config, tuple(p.pattern for p in c.patterns))
              for c in (self._collections[n] for n in sorted(saving))),
        )
        if configs != self._plans_configs:
            self._capture_plans.clear()
            self._plans_configs = configs

    @_guarded
    def _loss_output(self, name: str, output: Any) -> None:
        if not isinstance(output, torch.Tensor):
            return
        # traced by torch.compile: keep the value whatever the step (the step boundary drops it on
        # unsaved steps); reading the step counters here would recompile the graph every step
        if not _compiling() and "losses" not in self._saving(self._mode, self._mode_steps[self._mode]):
            return
        value = output.detach()
        self._pending_scalars[(self._mode, "losses", name)].append(value.float().mean() if value.numel() != 1 else value.reshape(()).clone())

    def _summary(self, name: str, value: Any, is_tensor: bool) -> None:
        try:
            # traced by torch.compile: keep the value (dropped at the boundary of an unsaved step)
            # rather than read the step counters, which would recompile the graph every step
            if not _compiling() and "summaries" not in self._saving(self._mode, self._mode_steps[self._mode]):
                return
            if is_tensor:
                if not isinstance(value, torch.Tensor):
                    raise expected("tensor", "a torch.Tensor", value)
                self._pending[(self._mode, "summaries", name)].append(value.detach().clone())
            else:
                if isinstance(value, torch.Tensor):
                    value = value.detach().float().mean() if value.numel() != 1 else value.detach().reshape(()).clone()
                self._pending_scalars[(self._mode, "summaries", name)].append(value)
        except Exception as err:
            self._warn_once(f"summarize {name!r}: {type(err).__name__}: {err}")

    def _optimizer_pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._closed:
            return
        if (self._primary_optimizer is None or self._primary_optimizer() is None) and self._owns(optimizer):
            self._primary_optimizer = weakref.ref(optimizer)
        if self._primary_optimizer is not None and self._primary_optimizer() is optimizer:
            self._begin_train_step_end(optimizer)

    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` updates a watched parameter: another model's optimizer stepping
        first (a GAN's discriminator, a second model) must not become this hook's step boundary."""
        if not self._roots:
            return True
        watched = {id(p) for _, p in self._parameters()}
        return any(id(p) in watched for group in optimizer.param_groups for p in group["params"])

    def _optimizer_post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._closed and self._primary_optimizer is not None and self._primary_optimizer() is optimizer:
            self._finish_train_step()

    def prepare_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Read weights, gradients and what was captured, just before the optimizer updates.

        Called automatically by the optimizer pre-hook unless ``auto_step=False``.
        """
        self._begin_train_step_end(optimizer)

    def step(self) -> None:
        """Close the current train step by hand (loops without a ``torch.optim`` optimizer, or
        ``auto_step=False``): records it if it is saved and advances the step counter."""
        if self._pre_step is None:
            self._begin_train_step_end(None)
        self._finish_train_step()

    @_guarded
    def begin_step(self) -> None:
        """Begin a step of the current mode by hand (for ``step_on_forward=False``, as the Lightning
        callback does): attaches the activation hooks if the step is saved; in eval/predict mode it
        opens a mode step, closed by :meth:`end_step`. In train mode call it before each
        micro-batch; :meth:`prepare_step` and :meth:`step` close the train step."""
        self._begin(self._explicit_mode or self._mode)

    @_guarded
    def end_step(self) -> None:
        """Close the eval/predict step opened by :meth:`begin_step` (a no-op in train mode)."""
        if self._open_eval is not None:
            self._close_eval_step()

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
        return collection in self._saving(mode, self._mode_steps[mode])

    # ------------------------------------------------------------------ step boundaries

    def _train_mode(self) -> ModeKeys:
        return self._explicit_mode if self._explicit_mode in (ModeKeys.TRAIN, ModeKeys.GLOBAL) else ModeKeys.TRAIN

    def _parameters(self) -> list[tuple[str, torch.Tensor]]:
        seen: set[int] = set()
        out = []
        for prefix, root in self._roots:
            for name, param in root.named_parameters():
                if id(param) in seen:  # tied weights are recorded once
                    continue
                seen.add(id(param))
                out.append((f"{prefix}.{name}" if prefix else name, param))
        return out

    @_guarded
    def _begin_train_step_end(self, optimizer: torch.optim.Optimizer | None) -> None:
        if self._open_eval is not None:
            self._close_eval_step()
        mode = self._train_mode()
        self._mode = mode
        saving = self._saving(mode, self._mode_steps[mode])
        jobs = self._parameter_jobs(saving) + self._pending_jobs(saving, mode)
        host_scalars = self._optimizer_scalars(optimizer, saving)
        self._pre_step = (self._compute(jobs, saving), host_scalars)
        if any(set(self._collections[n].kinds) & {"updates"} for n in saving):
            self._update_snapshot = [
                (name, p, _piece(p)[0].detach().clone()) for name, p in self._parameters()
                if self._collections_for("updates", name, saving)
            ]

    def _parameter_jobs(self, saving: frozenset[str]) -> list[TensorJob]:
        jobs = []
        param_collections = saving - {"losses", "summaries", "scalars", "optimizer", "updates"}
        if not param_collections:
            return jobs
        for name, param in self._parameters():
            # DDP: replicated, taken as they are; FSDP2: this rank's shard, merged across ranks
            local, sharded = _piece(param)
            for c in self._collections_for(parameter_kind(name), name, saving):
                jobs.append(self._job(c, parameter_kind(name), name, [local], partitioned=sharded))
            grad = param.grad
            if grad is not None:
                local_grad, grad_sharded = _piece(grad)
                for c in self._collections_for("gradients", name, saving):
                    jobs.append(self._job(c, "gradients", name, [local_grad], partitioned=grad_sharded))
        return jobs

    def _pending_jobs(self, saving: frozenset[str], mode: ModeKeys) -> list[TensorJob]:
        """Jobs for everything captured in ``mode`` since its last boundary; clears those."""
        jobs = []
        pending = {key[1:]: self._pending.pop(key) for key in [k for k in self._pending if k[0] == mode]}
        pending_scalars = {key[1:]: self._pending_scalars.pop(key) for key in [k for k in self._pending_scalars if k[0] == mode]}
        for (kind, name), pieces in pending.items():
            # module captures were chosen by module name: match the collections the same way
            match_name = self._module_of.get(name, name) if kind in MODULE_KINDS else name
            for c in self._collections_for(kind, match_name, saving):
                jobs.append(self._job(c, kind, name, pieces))
        for (kind, name), values in pending_scalars.items():
            collection = self._collections[kind]
            if kind != "scalars" and collection.name not in saving:
                continue  # explicit save_scalar values are always recorded
            tensors = [v if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=torch.float64) for v in values]
            device = tensors[0].device
            job = self._job(collection, kind, name, [t.to(device) for t in tensors])
            job.plain_scalar = True  # summarize_scalar / save_scalar / losses: the number itself
            # across ranks losses and summaries are averaged; a save_scalar value is rank 0's, as it
            # is on steps that save nothing else (those make no collective)
            job.partitioned = kind != "scalars"
            jobs.append(job)
        jobs += self._explicit_jobs()
        return jobs

    def _explicit_jobs(self) -> list[TensorJob]:
        """Jobs for the tensors given to ``save_tensor``; clears them."""
        jobs = []
        for collection_name, name, tensor in self._explicit:
            collection = self._collections[collection_name]
            kind = collection.kinds[0] if collection.builtin else "summaries"
            piece, sharded = _piece(tensor)  # a plain tensor is rank 0's, a sharded DTensor merged
            job = self._job(collection, kind, name, [piece], partitioned=sharded)
            job.name = f"{collection_name}/{name}"
            jobs.append(job)
        self._explicit.clear()
        return jobs

    def _optimizer_scalars(self, optimizer: torch.optim.Optimizer | None, saving: frozenset[str]) -> list[ScalarEntry]:
        if optimizer is None or "optimizer" not in saving:
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

    @_guarded
    def _finish_train_step(self) -> None:
        if self._pre_step is None:
            self._advance(self._mode)
            return
        host, host_scalars = self._pre_step
        self._pre_step = None
        mode = self._mode
        parts = [host]
        saving = self._saving(mode, self._mode_steps[mode])
        # "reduce": on a saved step every rank computes, whatever it holds, so collectives match
        if self._update_snapshot or self._explicit or (self._reducer is not None and saving):
            jobs = []
            for name, param, before in self._update_snapshot:
                after, sharded = _piece(param)
                delta = after.detach() - before
                for c in self._collections_for("updates", name, saving):
                    jobs.append(self._job(c, "updates", name, [delta], partitioned=sharded))
            self._update_snapshot = []
            # save_tensor between prepare_step and step belongs to the step being closed
            # (Lightning: gradients after clipping, read once the optimizer has stepped)
            jobs += self._explicit_jobs()
            parts.append(self._compute(jobs, saving))
        self._submit(mode, self._mode_steps[mode], parts, host_scalars)
        self._advance(mode)

    def _compute(self, jobs: list[TensorJob], saving: frozenset[str]) -> HostStatistics:
        """Statistics of one step's jobs; under ``include_workers="reduce"`` merged across ranks.

        Collectives are made only on steps that save something: ``saving`` is the same on every
        rank (all ranks count the same steps), so an unsaved step costs no communication and
        every rank makes the same calls. The ranks first agree on the union of their jobs, so a
        module called on one rank only, or a different number of times, cannot hang them.
        """
        reducer = self._reducer
        if reducer is None or not saving or not getattr(reducer, "active", True):
            return self._engine.compute(jobs, None)
        agree = getattr(reducer, "agree_jobs", None)
        return self._engine.compute(agree(jobs) if agree is not None else jobs, reducer)

    def _advance(self, mode: ModeKeys) -> None:
        self.global_step += 1
        self._mode_steps[mode] += 1
        if mode != ModeKeys.TRAIN:
            self._mode_steps[ModeKeys.TRAIN] = self.global_step
        self._capture.detach()

    def _close_eval_step(self) -> None:
        mode = self._open_eval
        self._open_eval = None
        if mode is None:
            return
        saving = self._saving(mode, self._mode_steps[mode])
        jobs = self._pending_jobs(saving, mode)
        if jobs or (self._reducer is not None and saving):  # "reduce": every rank, for the collectives
            self._submit(mode, self._mode_steps[mode], [self._compute(jobs, saving)], [])
        self._mode_steps[mode] += 1
        self._capture.detach()

    def _submit(self, mode: ModeKeys, mode_step: int, parts: list[HostStatistics], host_scalars: list[ScalarEntry]) -> None:
        if not any(p.jobs for p in parts) and not host_scalars:
            return
        if self.world_size > 1 and self.include_workers != "all" and self.rank != 0:
            return  # "reduce": every rank holds the same merged statistics, rank 0 records them
        self._dispatcher.submit(
            PendingStep(self.global_step, mode, mode_step, self.worker, time.time(), list(host_scalars), parts)
        )

    # ------------------------------------------------------------------ lifecycle

    def _warn_once(self, message: str) -> None:
        key = message.split(":", 1)[0]
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"tensorlens: {message} (training continues; this warning is shown once)", stacklevel=3)

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
        """Record what is pending, remove every hook, flush and close the backends. Idempotent."""
        if self._closed:
            return
        try:
            if self._open_eval is not None:
                self._close_eval_step()
            # values saved after the last boundary of their mode (scalars, summaries, save_tensor)
            modes = {key[0] for key in self._pending_scalars} | ({self._mode} if self._explicit else set())
            for mode in sorted(modes, key=list(ModeKeys).index):
                jobs = self._pending_jobs(self._saving(mode, self._mode_steps[mode]), mode)
                if jobs:
                    # no collectives here: close() may run on one rank only, or after the process
                    # group is gone; values saved after the last step are this rank's own
                    self._submit(mode, self._mode_steps[mode], [self._engine.compute(jobs, None)], [])
        except Exception as err:
            self._warn_once(f"close: {type(err).__name__}: {err}")
        self._closed = True
        self._capture.detach()
        for handle in self._root_handles + self._optimizer_handles:
            handle.remove()
        self._root_handles.clear()
        self._optimizer_handles.clear()
        self._pending.clear()
        summaries.deactivate(self)
        self._dispatcher.close()
        self._engine.release()
        atexit.unregister(self._atexit)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Hook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Hook(run_dir={self.run_dir!r}, step={self.global_step}, collections={self.enabled_collections()})"


#: Captured tensors of at least this many values are reduced in the hook (see Hook._reduce_captured).
REDUCE_WHEN_CAPTURED = 1 << 17


def _names_list(name: str, value: Iterable[str]) -> list[str]:
    if isinstance(value, str):
        value = [value]
    out = list(value)
    for item in out:
        if not isinstance(item, str):
            raise expected(name, "a list of collection names", value)
    return out


def _piece(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(what this rank contributes, partitioned)``; see :func:`tensorlens.engine.distributed.local_piece`."""
    if not hasattr(tensor, "placements"):  # not a DTensor: skip importing torch.distributed.tensor
        return tensor, False
    from tensorlens.engine.distributed import local_piece

    return local_piece(tensor)


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


def _compiling() -> bool:
    """Whether ``torch.compile`` is tracing the caller (``torch.compiler.is_compiling``, torch >= 2.3)."""
    check = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(check()) if check is not None else False


def _distributed_rank() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _default_run_name() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def _tracker_run_name() -> str | None:
    """The active W&B or MLflow run's name, read without importing either library."""
    import sys

    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is not None:
        return f"{getattr(run, 'name', None) or 'wandb'}-{run.id}"
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None:
        try:
            active = mlflow.active_run()
        except Exception:
            active = None
        if active is not None:
            return f"{active.info.run_name or 'mlflow'}-{active.info.run_id[:8]}"
    return None


def _active_trackers() -> list[str]:
    """``backends="auto"``: the trackers with an active run in this process (never imported here)."""
    import sys

    found = ["local"]
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        found.append("wandb")
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None:
        try:
            if mlflow.active_run() is not None:
                found.append("mlflow")
        except Exception:
            pass
    return found
