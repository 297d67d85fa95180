"""What the Lightning and Hugging Face callbacks share: their options, the recorder and module taps
they start and close, the clipped gradients they record, and their warn-once.

It imports no framework (each callback combines it with its framework's ``Callback`` class), so
``tensorlens.integrations`` stays importable without Lightning or transformers.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from tensorlens._checks import expected
from tensorlens.backends.base import Backend, registered_backends
from tensorlens.capture.modules import ModuleTaps
from tensorlens.config import DynamicsConfig, HistogramConfig, ReductionConfig, SaveConfig, SaveConfigMode
from tensorlens.engine.recorder import Recorder
from tensorlens.engine.run_names import Naming, named_after
from tensorlens.modes import ModeKeys
from tensorlens.options import ENTRY_DEFAULTS, Options, from_keywords

if TYPE_CHECKING:
    import os

    from torch import nn

BackendSpec = str | Backend | type[Backend]
#: The collection that ``record_clipped_gradients=True`` writes: ``gradients_clipped/<param>/<stat>``.
CLIPPED_GRADIENTS = "gradients_clipped"


class CallbackBase:
    """A framework callback's options and the recorder it drives (see the callbacks' docstrings)."""

    #: The entry point's name in :data:`tensorlens.options.ENTRY_DEFAULTS` (``"lightning"``, ``"transformers"``).
    _entry: ClassVar[str]

    def __init__(
        self,
        save_interval: int = 100,
        collections: Sequence[str] | None = None,
        activations: bool = False,
        histograms: bool | HistogramConfig = True,
        reductions: ReductionConfig | None = None,
        include_workers: str = "reduce",
        record_clipped_gradients: bool = False,
        backends: str | Sequence[BackendSpec] | None = None,
        out_dir: str | os.PathLike[str] | None = None,
        save_config: SaveConfig | None = None,
        include_regex: Sequence[str] | str | None = None,
        run_name: str | None = None,
        resume: str = "never",
        dynamics: bool | DynamicsConfig = False,
        epoch_statistics: Sequence[str] | str | None = None,
        rules: Sequence[Any] | None = None,
        max_pending_steps: int = 64,
        collective_timeout: float | None = None,
        tracker_stats: str | Sequence[str] | None = None,
        tracker_histogram_interval: int | None = None,
        options: Options | None = None,
    ) -> None:
        super().__init__()
        trackers = ENTRY_DEFAULTS[self._entry]["backends"]
        if options is None:  # named with the framework's tracker word, before the other checks
            check_backends(trackers if backends is None else backends, trackers)
        # checked now: a typo fails when the callback is built, not minutes into training
        opts = from_keywords(self._entry, options, {
            "save_interval": save_interval, "collections": collections, "activations": activations,
            "histograms": histograms, "reductions": reductions, "include_workers": include_workers,
            "record_clipped_gradients": record_clipped_gradients, "backends": trackers if backends is None else backends,
            "out_dir": out_dir, "save_config": save_config, "include_regex": include_regex, "run_name": run_name,
            "resume": resume, "dynamics": dynamics, "epoch_statistics": epoch_statistics, "rules": rules,
            "max_pending_steps": max_pending_steps, "collective_timeout": collective_timeout,
            "tracker_stats": tracker_stats, "tracker_histogram_interval": tracker_histogram_interval,
        })
        if opts.save_config is None:  # an Options left to the entry point: every 100th step
            opts = opts.replace(save_config=SaveConfig(save_interval=ENTRY_DEFAULTS[self._entry]["save_interval"]))
        #: The callback's :class:`tensorlens.Options` (``backends`` may hold the framework's tracker word).
        self.options = opts.replace(backends=check_backends(trackers if opts.backends is None else opts.backends, trackers))
        self._mode_steps: dict[str, int] = {}  # eval/predict counters a later run continues
        self._runs_started = 0
        self._run_dir: str | None = None  # the folder and name of the first run, continued by later ones
        self._run_name: str | None = None
        self._warned: set[str] = set()
        self._init_driver()

    def _init_driver(self) -> None:
        """The framework driver's own state (a subclass's; the options are checked by then)."""

    def _backend_specs(self, tracker_backends: Callable[[], list[Backend]]) -> list[BackendSpec]:
        """The backends to write to: the tracker word replaced by ``tracker_backends()``."""
        trackers = ENTRY_DEFAULTS[self._entry]["backends"]
        out: list[BackendSpec] = []
        for spec in self.options.backends or ():
            if spec == trackers:
                out += tracker_backends()
            else:
                out.append(spec)
        return out or ["local"]

    @property
    def run_dir(self) -> str | None:
        """The run folder (``tl.open_run(callback.run_dir)``): the current run's, or the last one's
        once it has ended; ``None`` before the first run starts."""
        return self._run_dir

    def _start_recorder(
        self, out_dir: str | None, backends: list[BackendSpec], run_name: str | None, resume: str, root: nn.Module,
        global_step: int, mode: ModeKeys | None = None, naming: Naming | None = None,
    ) -> Recorder:
        """A recorder with the module taps of ``root``, at ``global_step``; closed again if its set-up fails.
        Without ``run_name`` it is named after the first named run of ``naming`` (the user's W&B /
        MLflow run, logger or arguments), in ``out_dir`` or else a folder of ``naming.runs_dir``. A
        later run of this callback continues the first one's folder and name."""
        if self._run_dir is not None:
            out_dir, run_name = self._run_dir, self._run_name
        # the clipped gradients are the callback's to record (_record_clipped), not the recorder's
        opts = self.options.replace(
            out_dir=out_dir, backends=backends, run_name=run_name, resume=resume, record_clipped_gradients=False,
        )
        with named_after(naming) if naming is not None else contextlib.nullcontext():
            recorder = Recorder(options=opts)
        self._runs_started += 1
        self._run_dir, self._run_name = recorder.run_dir, recorder.run_name
        try:
            _every_evaluation_loss(recorder)
            taps = ModuleTaps(recorder.capture, recorder.warn_once, recorder.dynamics)
            taps.add_root(root)
            recorder.add_source(taps)
            if mode is not None:
                recorder.set_mode(mode)
            recorder.set_step(global_step, self._mode_steps)
        except Exception:
            recorder.close()
            raise
        return recorder

    def _resume(self, continuing: bool) -> str:
        """A later run of this callback (or one restored from a checkpoint) continues its folder."""
        return "allow" if continuing and self.options.resume == "never" else self.options.resume

    def _record_clipped(self, recorder: Recorder, model: nn.Module) -> None:
        """The gradients as the optimizer uses them, after the framework's clipping (``.grad``
        lives until the next ``zero_grad``): the ``gradients_clipped`` collection and, with
        dynamics, ``grad_norm_clipped``."""
        if recorder.will_save("gradients"):
            gradients = recorder.collections["gradients"]
            seen: set[int] = set()
            for name, param in model.named_parameters():
                if id(param) in seen or param.grad is None or not gradients.matches("gradients", name):
                    continue
                seen.add(id(param))
                # an FSDP2 gradient stays a DTensor: its shards are merged across ranks, while a
                # plain (DDP, all-reduced) gradient is the same everywhere and taken from rank 0
                recorder.save_tensor(name, param.grad, CLIPPED_GRADIENTS)
        if recorder.will_save("dynamics"):
            recorder.read_clipped_gradients()

    def _close_recorder(self, recorder: Recorder | None) -> None:
        """Keep the eval/predict counters for a later run, then flush and close."""
        if recorder is None or recorder.closed:
            return
        for mode in (ModeKeys.EVAL, ModeKeys.PREDICT):
            self._mode_steps[str(mode)] = recorder.mode_step(mode)
        recorder.close()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"tensorlens: {message}", stacklevel=3)


def _every_evaluation_loss(recorder: Recorder) -> None:
    """The ``losses`` collection saves every eval step (unless given a save config of its own):
    an evaluation's loss is known once, at its end, and goes into its last batch's record, which
    the schedule of the other collections would mostly skip (``save_interval`` counts eval batches).
    A step with nothing but a loss costs one scalar; a batch without one records nothing."""
    losses = recorder.collections.get("losses")
    if losses is not None and losses.save_config is None:
        modes = dict(recorder.save_config.modes)
        modes[ModeKeys.EVAL] = SaveConfigMode(save_interval=1)
        losses.save_config = SaveConfig(mode_save_configs=modes)


def _option_attribute(name: str) -> property:
    field = {"collections": "include_collections", "reductions": "reduction_config"}.get(name, name)

    def set_option(self: CallbackBase, value: Any) -> None:
        if name == "backends":
            value = check_backends(value, ENTRY_DEFAULTS[self._entry]["backends"])
        self.options = self.options.replace(**{field: value})  # checked again; used from the next run on

    return property(lambda self: getattr(self.options, name), set_option, doc=f"``options.{name}``.")


# the attributes the Lightning callback has always had (set one before a run to change it), kept in its one Options
for _name in ("save_config", "collections", "histogram_config", "reductions", "include_workers", "record_clipped_gradients",
              "backends", "out_dir", "include_regex", "run_name", "resume", "dynamics_config", "epoch_statistics", "rules"):
    setattr(CallbackBase, _name, _option_attribute(_name))
del _name


def check_backends(backends: Any, trackers: str) -> list[BackendSpec]:
    """A callback's ``backends``: the tracker word, names, classes or instances."""
    what = f'"{trackers}" or a list of "{trackers}", backend names, Backend classes or instances'
    specs = [backends] if isinstance(backends, str) else backends
    if not isinstance(specs, Sequence):
        raise expected("backends", what, backends)
    out: list[BackendSpec] = []
    for spec in specs:
        if isinstance(spec, str):
            if spec != trackers and spec not in registered_backends():
                raise expected("backends", f"{what} (names: {registered_backends()})", backends)
        elif not (isinstance(spec, Backend) or (isinstance(spec, type) and issubclass(spec, Backend))):
            raise expected("backends", what, backends)
        out.append(spec)
    return out
