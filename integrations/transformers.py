"""The Hugging Face ``transformers.Trainer`` callback (``pip install 'tensorlens[transformers]'``).

>>> from tensorlens.integrations.transformers import TensorLensCallback                       # doctest: +SKIP
>>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[TensorLensCallback(save_interval=50)])  # doctest: +SKIP

The callback is a thin driver of a :class:`tensorlens.Recorder` and of the module taps that read
the model's parameters and capture its activations; it sends to the trackers of the Trainer's
``report_to`` (the active W&B run, the active MLflow run, TensorBoard's logging folder) and to
the local run store (``<output_dir>/tensorlens_runs/<run>``). No statistic is computed here.

Steps: the record of an optimizer step carries the ``global_step`` the Trainer reaches with it
(1 for the first step), the step at which the Trainer logs that step's loss; records of an
evaluation carry the ``global_step`` at which it runs. So tensorlens' charts and the Trainer's
share their x axis (``train/global_step`` in W&B).

Where the Trainer (transformers 5.x) lets it in, for one optimizer step of ``n`` micro-batches:

- ``on_step_begin`` (before the first micro-batch): ``recorder.begin_step()``; on saved steps
  the activation hooks are attached for every micro-batch;
- the end of the last micro-batch's backward pass: weights and gradients are read, accumulated
  over the micro-batches, averaged across DDP ranks, and *not yet clipped*. The Trainer clips
  before it calls ``on_pre_optimizer_step``, so no callback event sees them unclipped: a gradient
  hook (attached on saved steps only) queues an autograd callback that runs when the backward
  pass is complete, after DDP's own (see :meth:`TensorLensCallback._gradients_ready`);
- ``on_pre_optimizer_step``: with ``record_clipped_gradients=True``, the gradients as the
  optimizer will use them, clipped, as the collection ``gradients_clipped``. Without clipping
  (``max_grad_norm=0``), and under fp16 mixed precision (whose gradients are unscaled only
  inside the clipping), gradients are read here;
- ``on_optimizer_step``: the step is complete (updates are taken after the optimizer); it is
  recorded (``recorder.step()``) at ``on_step_end``, or, on a step the Trainer logs, at ``on_log``
  with the loss it logs;
- evaluation and prediction during ``train()`` (mode ``eval``): each batch is one eval step,
  begun by the model's forward in eval mode and closed by the next one's or when the
  evaluation ends (``on_evaluate``), with the evaluation's loss.

Losses: the loss the Trainer logs (``logs["loss"]`` of ``on_log``: the mean over the steps since
its last log, as its trackers get it) is ``losses/loss`` of the train record of the step it is
logged at, every ``logging_steps`` steps that tensorlens saves; every evaluation's ``eval_loss``
(``on_evaluate``'s metrics) is ``losses/loss`` of its last eval record (the ``losses`` collection
saves every eval step). Both carry the ``global_step`` the Trainer logs them at.
"""

from __future__ import annotations

import atexit
import glob
import math
import os
import sys
import weakref
from typing import Any

import torch
from torch import nn

from tensorlens._runtime import compiling, in_backward
from tensorlens.backends.base import Backend
from tensorlens.backends.optional import import_optional
from tensorlens.engine.recorder import Recorder
from tensorlens.engine.run_names import Naming, TrackerRun, active_tracker_runs
from tensorlens.integrations._callback_base import CLIPPED_GRADIENTS, CallbackBase
from tensorlens.integrations._step_losses import LOSS_NAME, eval_loss_name
from tensorlens.modes import ModeKeys
from tensorlens.store.runs import DEFAULT_RUNS_DIR

transformers = import_optional("transformers", "transformers", "tensorlens.integrations.transformers")
if not hasattr(transformers.TrainerCallback, "on_pre_optimizer_step"):  # the step boundary it needs
    raise ImportError(
        f"tensorlens.integrations.transformers needs a transformers Trainer with the on_pre_optimizer_step "
        f"callback event, which transformers {transformers.__version__} lacks: pip install -U 'tensorlens[transformers]'"
    )

__all__ = ["CLIPPED_GRADIENTS", "REPORT_TO", "TensorLensCallback"]

#: ``backends="report_to"``: a backend for each tracker of ``TrainingArguments.report_to``.
REPORT_TO = "report_to"
#: The step key of every row the Trainer's ``WandbCallback`` logs (its x axis for ``*``).
WANDB_STEP_KEY = "train/global_step"
#: An event file written this long before training began is not the TensorBoardCallback's.
_TENSORBOARD_FRESH_S = 120.0


class TensorLensCallback(CallbackBase, transformers.TrainerCallback):
    """Records exact statistics of the model's tensors while a Hugging Face ``Trainer`` trains.

    >>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[TensorLensCallback(save_interval=50)])  # doctest: +SKIP

    Args:
        save_interval: record every ``save_interval``-th optimizer step (``global_step``), and
            every ``save_interval``-th evaluation batch.
        collections: collection names to record (as in :func:`tensorlens.watch`); default
            ``weights biases gradients losses summaries scalars`` (+ ``activations``).
        activations: also record module outputs (hooks attached on saved steps only).
        histograms: ``True`` (64 bins), ``False``, or a :class:`tensorlens.HistogramConfig`.
        reductions: a :class:`tensorlens.ReductionConfig`; default ``min max mean std l2``.
        include_workers: under DDP: ``"reduce"`` (statistics merged across ranks), ``"one"``
            (rank 0's only) or ``"all"`` (every rank on its own, each to its local store file).
        record_clipped_gradients: also record the gradients after the Trainer's clipping
            (``max_grad_norm``), as the collection ``gradients_clipped``.
        backends: ``"report_to"``: the trackers of ``args.report_to`` that tensorlens can write
            to (``wandb``, ``mlflow``, ``tensorboard``) plus the local store. Or a list of backend
            names, ``Backend`` classes or instances, which may contain ``"report_to"``.
        out_dir: the run store folder; default ``<output_dir>/tensorlens_runs/<run name>``.
        save_config: a :class:`tensorlens.SaveConfig`, instead of ``save_interval``.
        include_regex: extra parameter/module name patterns, recorded as the ``custom`` collection.
        run_name: the run's name; default: ``TrainingArguments.run_name``, else the name of the W&B
            / MLflow run ``report_to`` started, else the time (see :attr:`run_dir`).
        resume: ``"never"`` (default), ``"allow"`` or ``"must"``, as in :class:`tensorlens.Hook`.
            A second ``trainer.train()`` with the same callback continues its run folder.
        dynamics: ``True`` or a :class:`tensorlens.DynamicsConfig`: also record training dynamics
            (``grad_norm_clipped`` too with ``record_clipped_gradients``; docs/dynamics.md).
        epoch_statistics: what is aggregated per epoch at ``on_epoch_end`` (see
            :meth:`tensorlens.Recorder.end_epoch`).
        rules: :mod:`tensorlens.rules` checked on every saved step in the background; a rule with
            ``action="stop"`` sets ``control.should_training_stop``.
        max_pending_steps, collective_timeout: as in :class:`tensorlens.Hook`.
        options: a :class:`tensorlens.Options` holding all of the above instead (then leave them
            at their defaults; see :mod:`tensorlens.options`).

    Evaluation outside ``trainer.train()`` (``trainer.evaluate()`` on its own) is not recorded.
    Unsupported (fails in ``on_train_begin``): DeepSpeed and FSDP version 1, whose gradients are
    not in ``param.grad``.
    """

    _entry = "transformers"

    def _init_driver(self) -> None:  # after CallbackBase.__init__ has checked the options
        #: The :class:`tensorlens.Recorder` of the current ``train()``, or of the last one once it ended.
        self.recorder: Recorder | None = None
        self._state: Any = None  # the Trainer's TrainerState (one object for the Trainer's life)
        self._optimizer: Any = None
        self._gradient_state: Any = None  # accelerate's: which micro-batch synchronizes gradients
        self._root_handles: list[Any] = []
        self._trigger: Any = None  # the gradient hook that finds the end of the last backward pass
        self._queued = False
        self._prepared = False  # weights and gradients of the current step were read
        self._before_clipping = False  # read them at the end of the backward pass
        self._clipping = False
        self._eval_open = False  # an evaluation batch has begun and not reached on_prediction_step
        self._awaiting_log = False  # the optimizer stepped; the step is recorded once its loss is logged
        self._eval_step = False  # an eval step is open in the recorder (until the next begins or on_evaluate)
        self._atexit: Any = None

    # ------------------------------------------------------------------ training: begin and end

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        _check_supported(args)
        self._close()  # a train() that ended without on_train_end
        if model is None:
            raise RuntimeError("TensorLensCallback: the Trainer passed no model to on_train_begin")
        self._state, self._optimizer = state, optimizer
        from accelerate.state import GradientState  # the Trainer needs accelerate: it is there

        self._gradient_state = GradientState()
        self._clipping = bool(args.max_grad_norm) and args.max_grad_norm > 0
        scaler = getattr(optimizer, "scaler", None)
        fp16_scaling = scaler is not None and bool(getattr(scaler, "is_enabled", lambda: True)())
        self._before_clipping = self._clipping and not fp16_scaling
        if self._clipping and fp16_scaling:
            self._warn_once(
                "fp16", "fp16 mixed precision: the GradScaler unscales gradients inside the Trainer's clipping, so "
                "`gradients` are read after clipping (max_grad_norm); bf16 or max_grad_norm=0 give them unclipped",
            )
        self.recorder = self._start(args, state, model)

    def _start(self, args: Any, state: Any, model: nn.Module) -> Recorder:
        options = self.options
        # run_name=, else TrainingArguments.run_name (which report_to's trackers name their runs
        # after), else the W&B / MLflow run they started; the folder under output_dir
        own = [TrackerRun("transformers", args.run_name)] if args.run_name and args.run_name != args.output_dir else []
        naming = Naming((*own, *active_tracker_runs()), os.path.abspath(os.path.join(args.output_dir, DEFAULT_RUNS_DIR)))
        # trackers are rank 0's: the Trainer's own callbacks start their runs there only
        backends = self._backend_specs(lambda: self._report_to_backends(args) if state.is_world_process_zero else [])
        recorder = self._start_recorder(options.out_dir, backends, options.run_name, self._resume(self._runs_started > 0),
                                        _unwrapped(model), state.global_step, naming=naming)
        try:
            ref = weakref.ref(self)  # hooks and atexit must not keep the callback alive
            root = _unwrapped(model)
            self._root_handles = [root.register_forward_pre_hook(lambda m, a: _call(ref, "_root_forward_pre", m))]
            self._atexit = lambda: _call(ref, "_close")
            atexit.register(self._atexit)
        except Exception:
            recorder.close()
            raise
        return recorder

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Flush and close the recorder, so the trackers have every record before the run ends."""
        self._close()

    # ------------------------------------------------------------------ training: one optimizer step

    def on_step_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        self._record_step(control)  # a step whose loss was not logged after all
        recorder = self._live()
        if recorder is None:
            return
        self._eval_open = self._eval_step = False  # an evaluation's last step is closed by begin_step
        if recorder.global_step != state.global_step + 1:  # this step's number: what the Trainer reaches with it
            recorder.set_step(state.global_step + 1)
        recorder.begin_step(ModeKeys.TRAIN)
        self._prepared = False
        if self._before_clipping and model is not None and any(
            recorder.will_save(c, ModeKeys.TRAIN) for c in recorder.enabled_collections()
        ):
            self._arm(model)

    def _arm(self, model: nn.Module) -> None:
        """A hook that fires once in every backward pass of this step; the last micro-batch's
        queues :meth:`_gradients_ready` for when that backward pass is complete."""
        parameters = [p for p in model.parameters() if p.requires_grad]
        if not parameters:
            return
        self._queued = False
        ref = weakref.ref(self)
        self._trigger = torch.autograd.graph.register_multi_grad_hook(
            parameters, lambda grad: _call(ref, "_backward_running"), mode="any"
        )

    def _backward_running(self) -> None:
        if self._queued or not getattr(self._gradient_state, "sync_gradients", True):
            return  # a micro-batch that only accumulates (under DDP: no all-reduce either)
        self._queued = True
        engine = torch.autograd.Variable._execution_engine
        ref = weakref.ref(self)
        # Autograd runs the callbacks queued during a backward pass when it is complete, in order;
        # DDP queues its own (which waits for the all-reduce and writes the averaged .grad) when
        # the last gradient is ready, after this one. Queued again from within a callback, ours
        # runs after every callback queued during the pass: DDP's included.
        engine.queue_callback(lambda: engine.queue_callback(lambda: _call(ref, "_gradients_ready")))

    def _gradients_ready(self) -> None:
        """Read weights and gradients: accumulated, averaged across ranks, not clipped yet."""
        recorder = self._live()
        if recorder is not None and not self._prepared:
            self._prepared = True
            recorder.prepare_step(self._optimizer)  # guarded: never raises into the backward pass

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                              optimizer: Any = None, **kwargs: Any) -> None:
        recorder = self._live()
        self._disarm()
        if recorder is None:
            return
        if not self._prepared:  # not a saved step, no clipping, or fp16
            self._prepared = True
            recorder.prepare_step(optimizer)
        if self.options.record_clipped_gradients and self._clipping and model is not None:
            self._record_clipped(recorder, _unwrapped(model))

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # recorded at on_step_end, or with the loss the Trainer logs for this step (on_log)
        self._awaiting_log = self._live() is not None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not control.should_log:  # (set by the Trainer's flow callback, which runs first)
            self._record_step(control)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        recorder = self._live()
        if recorder is not None and self._awaiting_log:
            loss = (logs or {}).get(LOSS_NAME)
            if isinstance(loss, (int, float)) and not isinstance(loss, bool) and recorder.will_save("losses", ModeKeys.TRAIN):
                recorder.add_loss(LOSS_NAME, torch.tensor(float(loss), dtype=torch.float64))
        self._record_step(control)

    def _record_step(self, control: Any) -> None:
        """Record the train step whose optimizer has stepped, if it waits."""
        recorder = self._live()
        if not self._awaiting_log or recorder is None:
            return
        self._awaiting_log = False
        recorder.step()  # also takes the rules' actions: a "raise" leaves through the Trainer
        self._prepared = False
        if recorder.should_stop and control is not None:  # a rule with action="stop" fired
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._record_step(control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._record_step(control)
        recorder = self._live()
        if recorder is not None and state.epoch is not None:
            # the Trainer's epoch is a float that reaches n at the end of epoch n - 1
            recorder.end_epoch(max(0, math.ceil(state.epoch) - 1))

    # ------------------------------------------------------------------ evaluation during train()

    def _root_forward_pre(self, module: nn.Module) -> None:
        recorder = self._live()
        if recorder is None or module.training or self._eval_open or compiling() or in_backward():
            return
        self._record_step(None)  # an evaluation right after a step that waited for its logged loss
        # the first forward of an evaluation batch (generate() calls it many times: one step still)
        if self._state is not None:
            recorder.set_step(self._state.global_step)
        recorder.begin_step(ModeKeys.EVAL)
        self._eval_open = self._eval_step = True

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # the batch is done; its step stays open until the next batch begins or the evaluation
        # ends, which brings the loss of the whole evaluation
        self._eval_open = False

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, Any] | None = None,
                    **kwargs: Any) -> None:
        recorder = self._live()
        if recorder is None:
            self._warn_once("evaluate", "trainer.evaluate() outside trainer.train() is not recorded")
            return
        if self._eval_step and recorder.will_save("losses", ModeKeys.EVAL):
            for key, value in (metrics or {}).items():
                name = eval_loss_name(key) if key.startswith("eval_") else None
                if name is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
                    recorder.add_loss(name, torch.tensor(float(value), dtype=torch.float64))
        self._end_eval_step()

    def on_predict(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end_eval_step()

    def _end_eval_step(self) -> None:
        recorder = self._live()
        if recorder is not None and self._eval_step:
            recorder.end_step()
        self._eval_open = self._eval_step = False

    # ------------------------------------------------------------------ helpers

    def _live(self) -> Recorder | None:
        recorder = self.recorder
        return recorder if recorder is not None and not recorder.closed else None

    def _disarm(self) -> None:
        if self._trigger is not None:
            self._trigger.remove()
            self._trigger = None

    def _close(self) -> None:
        self._disarm()
        for handle in self._root_handles:
            handle.remove()
        self._root_handles = []
        if self._atexit is not None:
            atexit.unregister(self._atexit)
            self._atexit = None
        recorder = self._live()
        if recorder is None:
            return
        self._record_step(None)
        self._end_eval_step()
        self._close_recorder(recorder)  # a later train() continues its eval/predict counters

    def _report_to_backends(self, args: Any) -> list[Backend]:
        """A backend for each tracker the Trainer reports to, writing into the run its callback started."""
        out: list[Backend] = []
        for name in args.report_to or []:
            if name == "wandb":
                wandb = sys.modules.get("wandb")
                run = getattr(wandb, "run", None) if wandb is not None else None
                if run is not None:
                    from tensorlens.integrations.wandb import WandbBackend

                    # WandbCallback plots "*" against train/global_step: give every row that key
                    out.append(WandbBackend(run=run, extra_step_keys=(WANDB_STEP_KEY,)))
                    continue
            elif name == "mlflow":
                from tensorlens.integrations.mlflow import MLflowBackend

                if MLflowBackend.detect():
                    out.append(MLflowBackend())  # the run MLflowCallback started, on this thread
                    continue
            elif name == "tensorboard":
                from tensorlens.integrations.tensorboard import TensorBoardBackend

                out.append(TensorBoardBackend(log_dir=tensorboard_dir(args)))
                continue
            self._warn_once(
                f"report_to-{name}",
                f"report_to={name!r}: no tensorlens backend writes there"
                + (" (no active run found)" if name in ("wandb", "mlflow") else "")
                + "; statistics go to the local run store (pass backends=[...] to choose)",
            )
        return out


def tensorboard_dir(args: Any) -> str:
    """The folder the Trainer's ``TensorBoardCallback`` writes to: ``TENSORBOARD_LOGGING_DIR``,
    else the newest ``<output_dir>/runs/<time>_<host>`` it has just created (its name holds the
    time it was created: the callback does not expose it), else a new such folder. tensorlens
    writes its own event file there, so TensorBoard shows one run."""
    found = os.environ.get("TENSORBOARD_LOGGING_DIR")
    if found:
        return os.path.expanduser(found)
    import socket
    import time
    from datetime import datetime

    runs = os.path.join(args.output_dir, "runs")
    fresh = [
        folder for folder in glob.glob(os.path.join(runs, f"*_{socket.gethostname()}"))
        if glob.glob(os.path.join(folder, "events.out.tfevents.*"))
        and os.path.getmtime(folder) > time.time() - _TENSORBOARD_FRESH_S
    ]
    if fresh:
        return max(fresh, key=os.path.getmtime)
    return os.path.join(runs, datetime.now().strftime("%b%d_%H-%M-%S") + "_" + socket.gethostname())


def _check_supported(args: Any) -> None:
    if getattr(args, "deepspeed", None):
        raise RuntimeError(
            "TensorLensCallback does not support DeepSpeed: it keeps gradients inside its engine, not in "
            "param.grad. Use DDP, or FSDP version 2 (whose sharded gradients tensorlens reads)."
        )
    fsdp_config = getattr(args, "fsdp_config", None) or {}
    if getattr(args, "fsdp", None) and int(fsdp_config.get("version", 2)) == 1:
        raise RuntimeError(
            "TensorLensCallback does not support FSDP version 1: it flattens parameters and their gradients. "
            "Use fsdp_config={'version': 2}, whose sharded gradients tensorlens reads."
        )


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model itself, under DDP's or torch.compile's wrapper (names without ``module.``)."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def _call(ref: weakref.ref[TensorLensCallback], method: str, *args: Any) -> None:
    """Call a method of the callback from a hook, if it still exists; an error of ours is one
    warning, never an exception in the user's forward or backward pass."""
    callback = ref()
    if callback is None:
        return
    try:
        getattr(callback, method)(*args)
    except Exception as err:
        callback._warn_once(f"hook-{method}", f"{method}: {type(err).__name__}: {err} (training continues)")
