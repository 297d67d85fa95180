"""What a recorder is given: values from the caller (scalars, tensors, losses, summaries), module
tensors its sources capture, and, at a step's end, its sources' parameters and scalars.

A mixin of :class:`tensorlens.engine.recorder.Recorder`, kept apart so the recorder's module holds
the step boundaries and the lifecycle only. The public methods here file a value in the recorder's
pending captures (``self._pending``) for the step that is open; the private ones turn what is
pending into jobs. None computes statistics.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from tensorlens._checks import expected
from tensorlens._runtime import compiling
from tensorlens.collection import Kind
from tensorlens.compute.jobs import ReducedPiece, TensorJob, reduce_now
from tensorlens.engine import gather
from tensorlens.records import ScalarEntry

if TYPE_CHECKING:
    from tensorlens.engine.parameter_jobs import ParameterJobs
    from tensorlens.engine.pending import PendingCaptures
    from tensorlens.engine.schedule import Schedule
    from tensorlens.modes import ModeKeys

#: Captured tensors of at least this many values are reduced in the hook (see CallerValues.capture).
REDUCE_WHEN_CAPTURED = 1 << 17


class CallerValues:
    """``save_scalar``, ``save_tensor``, ``add_loss``, ``add_summary`` and ``capture`` of a
    recorder, and the jobs and scalars of what it was given."""

    schedule: Schedule
    _pending: PendingCaptures
    _parameter_job_cache: ParameterJobs
    _sources: list[Any]
    global_step: int
    _mode: ModeKeys
    _mode_steps: dict[ModeKeys, int]
    _closed: bool
    _paused: bool

    if TYPE_CHECKING:  # the recorder's own
        def _check_open(self, what: str) -> None: ...
        def _saving(self, mode: ModeKeys) -> frozenset[str]: ...
        def warn_once(self, message: str) -> None: ...

    def save_scalar(self, name: str, value: float | int | torch.Tensor) -> None:
        """Record a number under ``scalars/<name>`` in the current step's record, when the
        ``scalars`` collection saves the step (its own save config, else the recorder's)."""
        self._check_open("save a scalar")
        if not isinstance(name, str) or not name:
            raise expected("name", "a non-empty string", name)
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise expected("value", "a number or a one-element tensor", f"a tensor of shape {tuple(value.shape)}")
            value = value.detach().reshape(()).clone()
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
        else:
            raise expected("value", "a number or a one-element tensor", value)
        if self.schedule.saves(Kind.SCALARS, self._mode, self._mode_steps[self._mode]):
            self._pending.add_scalar(self._mode, Kind.SCALARS, name, value)

    def save_tensor(self, name: str, tensor: torch.Tensor, collections_to_write: str | Iterable[str] = "default") -> None:
        """Record statistics of ``tensor`` in the current step under each of
        ``collections_to_write``, on the steps each of those collections saves (SageMaker
        Debugger's semantics; ``"default"`` is the ``summaries`` collection)."""
        self._check_open("save a tensor")
        if not isinstance(tensor, torch.Tensor):
            raise expected("tensor", "a torch.Tensor", tensor)
        if not isinstance(name, str) or not name:
            raise expected("name", "a non-empty string", name)
        names = [collections_to_write] if isinstance(collections_to_write, str) else list(collections_to_write)
        copy = None
        for collection in names:
            if collection == "default":
                collection = Kind.SUMMARIES.value
            self.schedule.ensure_collection(collection)
            if self.schedule.saves(collection, self._mode, self._mode_steps[self._mode]):
                copy = tensor.detach().clone() if copy is None else copy
                self._pending.add_explicit(self._mode, collection, name, copy)

    def add_loss(self, name: str, value: Any) -> None:
        """A loss value of the current step (a registered loss module's output): recorded under
        ``losses/<name>`` on saved steps, the mean when given several times in a step."""
        if self._closed or self._paused or not isinstance(value, torch.Tensor):
            return
        # traced by torch.compile: keep the value whatever the step (the step boundary drops it on
        # unsaved steps); reading the step counters here would recompile the graph every step
        if not compiling() and Kind.LOSSES not in self._saving(self._mode):
            return
        value = value.detach()
        self._pending.add_scalar(
            self._mode, Kind.LOSSES, name, value.float().mean() if value.numel() != 1 else value.reshape(()).clone()
        )

    def add_summary(self, name: str, value: Any, is_tensor: bool) -> None:
        """``tl.summarize_scalar`` / ``tl.summarize_tensor`` land here (from inside ``forward``)."""
        try:
            if self._closed or self._paused or (not compiling() and Kind.SUMMARIES not in self._saving(self._mode)):
                return
            if is_tensor:
                if not isinstance(value, torch.Tensor):
                    raise expected("tensor", "a torch.Tensor", value)
                self._pending.add_tensor(self._mode, Kind.SUMMARIES, None, name, value.detach().clone())
            else:
                if isinstance(value, torch.Tensor):
                    value = value.detach().float().mean() if value.numel() != 1 else value.detach().reshape(()).clone()
                elif not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise expected("value", "a number or a tensor", value)
                self._pending.add_scalar(self._mode, Kind.SUMMARIES, name, value)
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
            piece = self._reduce_captured(kind, module_name, tensor)
            if piece is not None:
                self._pending.add_tensor(self._mode, kind, module_name, name, piece)
            else:
                self._pending.add_captured(self._mode, kind, module_name, name, tensor.detach())
        except Exception as err:
            self.warn_once(f"capturing {kind}/{name}: {type(err).__name__}: {err}")

    def _reduce_captured(self, kind: str, module_name: str, tensor: torch.Tensor) -> ReducedPiece | None:
        # any device: the compiled kernel on a CPU, PyTorch ops elsewhere (rows stay on the device)
        if compiling() or tensor.layout != torch.strided or tensor.numel() < REDUCE_WHEN_CAPTURED:
            return None
        plan = self.schedule.capture_plan(self._mode, kind, module_name, self._saving(self._mode))
        return reduce_now(tensor, plan) if plan is not None else None

    def _parameters(self) -> list[tuple[str, torch.Tensor]]:
        if len(self._sources) == 1 and getattr(self._sources[0], "unique_parameters", False):
            return self._sources[0].parameters()  # it lists each parameter once already
        seen: set[int] = set()
        out = []
        for source in self._sources:
            for name, param in source.parameters():
                # tied weights are recorded once; an uninitialised (lazy) parameter from its first step with values
                if id(param) not in seen and not torch.nn.parameter.is_lazy(param):
                    seen.add(id(param))
                    out.append((name, param))
        return out

    def _parameter_jobs(self, saving: frozenset[str]) -> list[TensorJob]:
        return self._parameter_job_cache.jobs(self.schedule, self._parameters, saving)

    def _pending_jobs(self, saving: frozenset[str], mode: ModeKeys) -> list[TensorJob]:
        """Jobs for everything captured in ``mode`` since its last boundary; forgets those."""
        jobs = gather.pending_jobs(self.schedule, self._pending, saving, mode)
        if self._pending.changed:
            names, self._pending.changed = self._pending.changed, []
            self.warn_once(
                f"{', '.join(names)} changed in place after being captured (an in-place op after the module): "
                "left out of this step, copied when captured from now on"
            )
        return jobs

    def _optimizer_scalars(self, optimizer: torch.optim.Optimizer | None, saving: frozenset[str]) -> list[ScalarEntry]:
        return gather.optimizer_scalars(optimizer, saving)

    def _source_scalars(self, saving: frozenset[str]) -> list[ScalarEntry]:
        out: list[ScalarEntry] = []
        for source in self._sources:
            step_scalars = getattr(source, "step_scalars", None)
            if step_scalars is not None:
                out += step_scalars(saving, self.global_step)
        return out
