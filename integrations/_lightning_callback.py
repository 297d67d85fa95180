"""The Lightning callback, written once for both namespaces.

``lightning.pytorch`` and the standalone ``pytorch_lightning`` ship the same Trainer under two
package names, and a Trainer rejects callbacks of the other namespace. So the logic lives here in
:class:`TensorLensCallbackBase`, which imports no Lightning package: it reads every Lightning
class it needs from ``_namespace``, the namespace module. :mod:`tensorlens.integrations.lightning`
and :mod:`tensorlens.integrations.pytorch_lightning` each combine it with their namespace's
``Callback``::

    class TensorLensCallback(TensorLensCallbackBase, lightning.pytorch.Callback):
        _namespace = lightning.pytorch

The callback is a thin driver of a :class:`tensorlens.Recorder` (the framework-free engine of
:class:`tensorlens.Hook`, without its automatic step detection) and of the module taps that read
the LightningModule's parameters and capture its activations: it marks step boundaries and
modes through the recorder's public API, and picks backends from the trainer's loggers
(:meth:`tensorlens.Backend.from_logger`). No statistic is computed here.

Step boundaries (Lightning runs ``training_step`` and ``backward`` inside the closure passed to
``optimizer.step``, i.e. after torch's optimizer step pre-hooks fire, so optimizer hooks would
read gradients too early):

- ``on_train_batch_start``: ``recorder.begin_step()`` attaches activation hooks on saved steps
  (every micro-batch, so accumulated activations are all captured);
- ``on_before_optimizer_step``: ``recorder.prepare_step(optimizer)`` reads weights and gradients,
  which are accumulated over micro-batches and unscaled by AMP there, and not yet clipped;
- ``on_train_batch_end``, when ``trainer.global_step`` advanced: optionally the clipped gradients
  (still in ``.grad``: ``zero_grad`` runs at the start of the next step), then ``recorder.step()``.
- ``on_train_epoch_end``: ``recorder.end_epoch(trainer.current_epoch)`` records the epoch aggregates.
- validation / test (mode ``eval``) and predict (mode ``predict``): one mode step per batch,
  ``begin_step()`` in ``on_*_batch_start``, closed by the next batch's or at the end of the
  evaluation. Sanity-check batches are not recorded (Lightning's loggers skip them too).

Losses (``losses/loss``, the name in both modes, so train and validation losses pair up as
``tl.watch(model, loss_fn)``'s do):

- train: the loss ``training_step`` returns (a tensor, or a dict's ``"loss"``), taken in
  ``on_before_backward`` (the mean over the micro-batches of an accumulated step, undoing
  Lightning's division by ``accumulate_grad_batches``), in the record of the optimizer step it
  belongs to: what ``self.log("train_loss", loss)`` shows at the same ``trainer/global_step``;
- validation / test: the loss each ``validation_step`` / ``test_step`` returns, in its batch's
  record; if it returns none, the loss the module logs (``self.log("val_loss", ...)``: every
  metric logged during the evaluation whose name holds ``loss``, as Lightning aggregates it,
  named without its ``val``/``test`` prefix), in the evaluation's last record (the ``losses``
  collection saves every eval step, so every evaluation's loss is there). Eval records carry
  the step Lightning's loggers log the evaluation at.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from tensorlens.backends.base import Backend, backend_class, registered_backends
from tensorlens.engine.recorder import Recorder
from tensorlens.engine.run_names import Naming, lightning_logger_runs
from tensorlens.integrations._callback_base import CLIPPED_GRADIENTS, CallbackBase
from tensorlens.integrations._step_losses import LOSS_NAME, eval_loss_name, returned_loss
from tensorlens.modes import ModeKeys
from tensorlens.store.runs import DEFAULT_RUNS_DIR

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

__all__ = ["CLIPPED_GRADIENTS", "LOGGERS", "STORE_FOLDER", "TensorLensCallbackBase", "missing_namespace"]

#: ``backends="loggers"``: one backend per logger of the trainer that tensorlens can write to.
LOGGERS = "loggers"
#: The folder, inside a logger's ``log_dir``, that holds the local run store.
STORE_FOLDER = "tensorlens"

_STAGE_MODES = {"validate": ModeKeys.EVAL, "test": ModeKeys.EVAL, "predict": ModeKeys.PREDICT}


class TensorLensCallbackBase(CallbackBase):
    """Records exact statistics of a LightningModule's tensors while a Lightning Trainer runs.

    Use :class:`tensorlens.integrations.lightning.TensorLensCallback` (``lightning.pytorch``) or
    :class:`tensorlens.integrations.pytorch_lightning.TensorLensCallback` (``pytorch_lightning``),
    matching the namespace your ``Trainer`` comes from.

    >>> trainer = Trainer(callbacks=[TensorLensCallback(save_interval=50)], logger=WandbLogger())  # doctest: +SKIP

    Args:
        save_interval: record every ``save_interval``-th optimizer step (``trainer.global_step``),
            and every ``save_interval``-th validation/test/predict batch.
        collections: collection names to record (as in :func:`tensorlens.watch`); default
            ``weights biases gradients losses summaries scalars`` (+ ``activations``).
        activations: also record module outputs (hooks attached on saved steps only).
        histograms: ``True`` (64 bins), ``False``, or a :class:`tensorlens.HistogramConfig`.
        reductions: a :class:`tensorlens.ReductionConfig`; default ``min max mean std l2``.
        include_workers: under DDP: ``"reduce"`` (statistics merged across ranks), ``"one"``
            (rank 0's only) or ``"all"`` (every rank on its own, each to its local store file).
        record_clipped_gradients: also record the gradients after Lightning's gradient clipping,
            as the collection ``gradients_clipped`` (``gradients`` are read before clipping), and,
            with ``dynamics``, their global norm as ``dynamics/global`` ``grad_norm_clipped``
            (``grad_norm`` is the norm before clipping, what ``clip_grad_norm_`` returns).
        dynamics: ``True`` or a :class:`tensorlens.DynamicsConfig`: also record training dynamics
            (update ratios, gradient and update cosines, global norms, dead and saturated units,
            per-sample norms; ``docs/dynamics.md``).
        epoch_statistics: what is aggregated per epoch at ``on_train_epoch_end`` (mean, min, max
            and std across the epoch's saved steps, under ``epochs/...``): ``None`` (plain values,
            ``l2`` and the dynamics), ``"all"``, ``()`` for none, or names such as ``["l2"]``.
        backends: ``"loggers"``: write to the trainer's loggers (W&B, MLflow, TensorBoard; the
            CSV logger and unknown loggers get nothing) plus the local store. Or a list of
            backend names, ``Backend`` classes or instances, which may contain ``"loggers"``.
            The local run store is always written.
        out_dir: the run store folder. Default: ``<logger.log_dir>/tensorlens`` for loggers with a
            ``log_dir`` (TensorBoard, CSV), else
            ``<trainer.default_root_dir>/tensorlens_runs/<logger name>-<logger version>``, else
            ``<trainer.default_root_dir>/tensorlens_runs/<time>-<id>``.
        save_config: a :class:`tensorlens.SaveConfig`, instead of ``save_interval``.
        include_regex: extra parameter/module name patterns, recorded as the ``custom`` collection.
        run_name: the run's name in the store (default: derived from the logger).
        resume: ``"never"`` (default), ``"allow"`` or ``"must"``, as in :class:`tensorlens.Hook`.
            A later stage of the same callback (test after fit) and a trainer that restores a
            checkpoint continue their run folder by themselves.
        rules: :mod:`tensorlens.rules` checked on every saved step in the background; a rule with
            ``action="stop"`` sets ``trainer.should_stop`` at the end of the next training batch.
            ``callback.hook.findings()`` lists what they found.
        max_pending_steps, collective_timeout: as in :class:`tensorlens.Hook`.
        options: a :class:`tensorlens.Options` holding all of the above instead (then leave them
            at their defaults; see :mod:`tensorlens.options`).

    Unsupported (fails in ``setup``/``on_fit_start`` with a message): more than one optimizer,
    and the DeepSpeed and FSDP (v1) strategies, whose gradients are not in ``param.grad``.
    """

    #: The Lightning namespace module (``lightning.pytorch`` or ``pytorch_lightning``).
    _namespace: ClassVar[ModuleType]
    #: The ``pip install`` extra for this namespace, named in messages.
    _extra: ClassVar[str]

    _entry = "lightning"

    def _init_driver(self) -> None:  # after CallbackBase.__init__ has checked the options
        #: The :class:`tensorlens.Recorder` of the current run, or of the last one once it has ended.
        self.hook: Recorder | None = None
        self._stage: str = "fit"
        self._pl_module: Any = None
        self._prepared = False  # prepare_step ran for the current train step
        self._batch_losses = False  # an evaluation batch returned its loss
        self._eval_step = False  # an eval step is open (closed by the next batch's or the evaluation's end)
        self._metrics_before: dict[str, Any] = {}  # the trainer's callback_metrics when an evaluation began

    # ------------------------------------------------------------------ Lightning hooks: lifecycle

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Check the configuration; the recorder is created when the stage starts, once Lightning
        has restored a checkpoint (if any), so a resumed run continues its folder."""
        self._check_strategy(trainer)
        if self.hook is not None and not self.hook.closed:
            self._close()  # a previous stage that ended without teardown
        self._stage = getattr(stage, "value", stage)  # a str enum whose str() is "TrainerFn.FITTING"
        self._pl_module = pl_module

    def _start(self, trainer: Any) -> None:
        """Create the recorder of this stage: choose the run folder and the backends."""
        if self._live_hook() is not None or self._pl_module is None:
            return
        pl_module, stage = self._pl_module, self._stage
        out_dir, naming = self._run_location(trainer)
        # loggers on ranks > 0 are dummies: only rank 0 writes to trackers
        backends = self._backend_specs(lambda: self._logger_backends(trainer) if trainer.is_global_zero else [])
        # a later stage of this callback (test after fit) or a trainer restoring a checkpoint
        # continues the run it wrote before
        restoring = getattr(trainer, "ckpt_path", None) is not None
        self.hook = self._start_recorder(
            out_dir, backends, self.options.run_name, self._resume(bool(self._runs_started or restoring)), pl_module,
            trainer.global_step, _STAGE_MODES.get(stage, ModeKeys.TRAIN), naming,
        )
        self._prepared = False

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Check what only exists once the strategy is set up (the optimizers), then start."""
        optimizers = trainer.optimizers
        if len(optimizers) > 1:
            raise RuntimeError(
                f"{type(self).__name__} supports one optimizer, but the LightningModule configured "
                f"{len(optimizers)}: with several, no single optimizer step marks the end of a training step. "
                "Watch each sub-model with its own tl.watch(...) instead, which steps on its optimizer."
            )
        self._start(trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # global_step is restored from a checkpoint after on_fit_start, before this hook
        self._sync(trainer, ModeKeys.TRAIN)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Flush and close the hook before Lightning finalizes its loggers."""
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning skips teardown after an exception: keep what was recorded up to now
        self._close()

    def state_dict(self) -> dict[str, Any]:
        """The eval/predict step counters, so a resumed run continues them."""
        if self.hook is not None and not self.hook.closed:
            self._remember_mode_steps(self.hook)
        return {"mode_steps": dict(self._mode_steps)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._mode_steps = {str(k): int(v) for k, v in state_dict.get("mode_steps", {}).items()}
        if self.hook is not None and not self.hook.closed:
            self.hook.set_step(self.hook.global_step, self._mode_steps)

    # ------------------------------------------------------------------ Lightning hooks: training

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        hook = self._live_hook()
        if hook is None:
            return
        if hook.global_step != trainer.global_step:
            self._sync(trainer, ModeKeys.TRAIN)
        hook.begin_step()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        """The loss ``training_step`` returned (or ``manual_backward`` was given), on saved steps."""
        hook = self._live_hook()
        if hook is None or trainer.sanity_checking or not hook.will_save("losses"):
            return
        # automatic optimization divides the returned loss by accumulate_grad_batches before backward
        scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        hook.add_loss(LOSS_NAME, loss.detach().float() * scale if scale != 1 else loss)  # (a bf16 loss times n: in float32)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: torch.optim.Optimizer) -> None:
        hook = self._live_hook()
        if hook is None:
            return
        if self._prepared:
            # manual optimization stepping twice in one batch: the first call marks the step
            self._warn_once(
                "several-steps",
                "optimizer.step() ran more than once in one training batch; statistics are recorded "
                "for the first step of each batch only",
            )
            return
        self._prepared = True
        hook.prepare_step(optimizer)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        hook = self._live_hook()
        if hook is None or trainer.global_step == hook.global_step:
            return  # accumulating: no optimizer step in this batch
        if self.options.record_clipped_gradients and self._prepared:
            self._record_clipped(hook, pl_module)
        hook.step()
        self._prepared = False
        if self.options.rules is not None:
            stop = hook.should_stop  # a rule with action="stop" fired (rules run on rank 0 only)
            if trainer.world_size > 1:  # every rank must leave at the same batch, or the others hang
                stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
            if stop:
                trainer.should_stop = True
        if hook.global_step != trainer.global_step:
            self._sync(trainer, ModeKeys.TRAIN)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        hook = self._live_hook()
        if hook is not None:
            hook.end_epoch(trainer.current_epoch)

    # ------------------------------------------------------------------ Lightning hooks: evaluation

    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        # sanity batches are not recorded: keep tl.summarize_* calls in forward from landing in step 0
        hook = self._live_hook()
        if hook is not None:
            hook.pause()

    def on_sanity_check_end(self, trainer: Any, pl_module: Any) -> None:
        hook = self._live_hook()
        if hook is not None:
            hook.unpause()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._start_mode(trainer, ModeKeys.EVAL)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._end_mode(trainer)

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._begin_batch(trainer)

    def on_validation_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._end_batch(trainer, outputs)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._start_mode(trainer, ModeKeys.EVAL)

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self._end_mode(trainer)

    def on_test_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._begin_batch(trainer)

    def on_test_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._end_batch(trainer, outputs)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._start_mode(trainer, ModeKeys.PREDICT)

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        self._end_mode(trainer)

    def on_predict_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._begin_batch(trainer)

    def on_predict_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        hook = self._live_hook()
        if hook is not None and not trainer.sanity_checking:
            hook.end_step()

    def _start_mode(self, trainer: Any, mode: ModeKeys) -> None:
        self._start(trainer)  # validate / test / predict on their own: no on_fit_start
        hook = self._live_hook()
        if hook is None or trainer.sanity_checking:
            return
        self._sync(trainer, mode, _logged_step(trainer))
        self._batch_losses = False
        self._metrics_before = dict(trainer.callback_metrics)

    def _end_mode(self, trainer: Any) -> None:
        hook = self._live_hook()
        if hook is None or trainer.sanity_checking:
            return
        if self._eval_step and hook.mode == ModeKeys.EVAL and not self._batch_losses and hook.will_save("losses"):
            self._record_logged_losses(hook, trainer)
        hook.end_step()
        self._eval_step = False
        # back to train (and to trainer.global_step) when validation ran inside fit; a
        # test/predict stage ends with teardown
        if getattr(trainer.state, "fn", None) == "fit":
            self._sync(trainer, ModeKeys.TRAIN)

    def _begin_batch(self, trainer: Any) -> None:
        hook = self._live_hook()
        if hook is not None and not trainer.sanity_checking:
            hook.begin_step()
            self._eval_step = True

    def _end_batch(self, trainer: Any, outputs: Any) -> None:
        """An evaluation batch's loss, if it returned one; its step stays open (closed by the
        next batch's begin_step or the evaluation's end) for the loss the module logs."""
        hook = self._live_hook()
        if hook is None or trainer.sanity_checking:
            return
        loss = returned_loss(outputs)
        if loss is not None:
            self._batch_losses = True
            hook.add_loss(LOSS_NAME, loss)

    def _record_logged_losses(self, hook: Recorder, trainer: Any) -> None:
        """The losses the module logged during this evaluation (Lightning's aggregates over it)."""
        before = self._metrics_before
        for key, value in trainer.callback_metrics.items():
            name = eval_loss_name(key)
            if name is not None and before.get(key) is not value and isinstance(value, torch.Tensor):
                hook.add_loss(name, value)

    # ------------------------------------------------------------------ helpers

    def _live_hook(self) -> Recorder | None:
        hook = self.hook
        return hook if hook is not None and not hook.closed else None

    def _sync(self, trainer: Any, mode: ModeKeys, step: int | None = None) -> None:
        """Set the mode and make ``hook.global_step`` equal ``step`` (default ``trainer.global_step``)."""
        hook = self._live_hook()
        if hook is None:
            return
        hook.set_mode(mode)
        step = trainer.global_step if step is None else step
        if hook.global_step != step:
            hook.set_step(step)

    def _remember_mode_steps(self, hook: Recorder) -> None:
        for mode in (ModeKeys.EVAL, ModeKeys.PREDICT):
            self._mode_steps[str(mode)] = hook.mode_step(mode)

    def _close(self) -> None:
        if self._live_hook() is not None:
            self._close_recorder(self.hook)
            self._prepared = False

    def _module(self, name: str) -> ModuleType:
        """A submodule of the namespace (``loggers``, ``strategies``), imported on first use."""
        return importlib.import_module(f"{self._namespace.__name__}.{name}")

    def _check_strategy(self, trainer: Any) -> None:
        strategies = self._module("strategies")
        strategy = trainer.strategy
        for class_name, why in (
            ("DeepSpeedStrategy", "DeepSpeed keeps gradients inside its engine, not in param.grad"),
            ("FSDPStrategy", "FSDP (v1) flattens parameters and their gradients"),
        ):
            cls = getattr(strategies, class_name, None)
            if cls is not None and isinstance(strategy, cls):
                raise RuntimeError(
                    f"{type(self).__name__} does not support {class_name}: {why}. "
                    "Use strategy='ddp' (or ModelParallelStrategy, whose FSDP2 shards tensorlens reads)."
                )

    def _run_location(self, trainer: Any) -> tuple[str | None, Naming]:
        """The run folder (``None``: one named after the run, under ``default_root_dir``) and the
        loggers' runs it is named after: decided on rank 0 and broadcast, so every rank of a DDP
        run writes into the same folder even where a logger's version differs or is unknown."""
        location = None
        if trainer.is_global_zero:
            location = self._local_run_location(trainer)
        location = trainer.strategy.broadcast(location, src=0)
        return location

    def _local_run_location(self, trainer: Any) -> tuple[str | None, Naming]:
        loggers = list(trainer.loggers)
        # WandbLogger(name=...), MLFlowLogger(run_name=...), else the first logger's name-version
        naming = Naming(lightning_logger_runs(loggers), os.path.abspath(os.path.join(trainer.default_root_dir, DEFAULT_RUNS_DIR)))
        if self.options.out_dir is not None:
            return os.path.abspath(os.fspath(self.options.out_dir)), naming
        for candidate in loggers:
            log_dir = getattr(candidate, "log_dir", None)
            if isinstance(log_dir, str) and log_dir:
                return os.path.abspath(os.path.join(log_dir, STORE_FOLDER)), naming
        return None, naming

    def _logger_backends(self, trainer: Any) -> list[Backend]:
        """One backend per logger, sharing the logger's own run (``Backend.from_logger`` of every
        registered backend class decides)."""
        out: list[Backend] = []
        for logger in trainer.loggers:
            found = None
            for name in registered_backends():
                try:
                    found = backend_class(name).from_logger(logger)
                except ImportError:
                    continue  # an integration whose vendor library is missing
                if found is not None:
                    break
            if found is not None:
                out.append(found)
            elif type(logger).__name__ == "CSVLogger":
                log.info("tensorlens: CSVLogger gets no statistics; they are in the local run store")
            else:
                self._warn_once(
                    f"logger-{type(logger).__name__}",
                    f"no tensorlens backend for {type(logger).__name__}; statistics go to the local run store "
                    "only (pass backends=[..., MyBackend()] or register a Backend with from_logger)",
                )
        return out


def _logged_step(trainer: Any) -> int:
    """The step Lightning's loggers log an evaluation at: inside ``fit`` the optimizer steps
    counted before the one just taken is (``_batches_that_stepped``, one less than
    ``global_step`` right after a step), so the evaluation lines up with the train step it follows."""
    if getattr(getattr(trainer, "state", None), "fn", None) != "fit":
        return trainer.global_step
    counted = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "_batches_that_stepped", None)
    return counted if isinstance(counted, int) else trainer.global_step


def missing_namespace(package: str, extra: str, err: ImportError) -> ImportError:
    """The ImportError raised when the Lightning package for a namespace is not installed."""
    message = (
        f"tensorlens' Lightning callback for `{package}` needs the {package!r} package, which could not be "
        f"imported ({err}). Install it with: pip install 'tensorlens[{extra}]'"
    )
    return ImportError(message)
