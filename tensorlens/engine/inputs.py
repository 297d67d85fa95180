"""What a recorder is given: values from the caller (scalars, tensors, losses, summaries), module
tensors its sources capture, and, at a step's end, its sources' parameters and scalars.

:class:`StepInputs` is held by the :class:`~tensorlens.engine.recorder.Recorder`, whose public
methods (``save_scalar``, ``capture``, ...) check that it is open and pass the current mode. The
filing methods here put a value in the pending captures for the step that is open; the others turn
what is pending into jobs. None computes statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from tensorlens._checks import expected
from tensorlens._runtime import compiling
from tensorlens.collection import Kind
from tensorlens.compute.jobs import ReducedPiece, TensorJob, reduce_now
from tensorlens.engine import gather
from tensorlens.engine.parameter_jobs import ParameterJobs
from tensorlens.engine.pending import PendingCaptures
from tensorlens.engine.schedule import Schedule
from tensorlens.modes import ModeKeys
from tensorlens.records import ScalarEntry

#: Captured tensors of at least this many values are reduced in the hook (see StepInputs.capture).
REDUCE_WHEN_CAPTURED = 1 << 17


class StepInputs:
    """What the recorder was given since each mode's last step boundary, and the jobs it makes.

    ``saving(mode)`` says which collections save the current step of ``mode`` (the recorder's
    counters); it is asked only where needed, never while ``torch.compile`` traces a value in.
    """

    def __init__(
        self, schedule: Schedule, pending: PendingCaptures, sources: list[Any],
        saving: Callable[[ModeKeys], frozenset[str]], warn: Callable[[str], None],
    ) -> None:
        self.schedule = schedule
        self.pending = pending
        self.sources = sources
        self._saving = saving
        self._warn = warn
        self._parameter_jobs = ParameterJobs()  # the jobs of the parameters, reused across steps

    def save_scalar(self, mode: ModeKeys, mode_step: int, name: str, value: float | int | torch.Tensor) -> None:
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
        if self.schedule.saves(Kind.SCALARS, mode, mode_step):
            self.pending.add_scalar(mode, Kind.SCALARS, name, value)

    def save_tensor(
        self, mode: ModeKeys, mode_step: int, name: str, tensor: torch.Tensor, collections_to_write: str | Iterable[str]
    ) -> None:
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
            if self.schedule.saves(collection, mode, mode_step):
                copy = tensor.detach().clone() if copy is None else copy
                self.pending.add_explicit(mode, collection, name, copy)

    def add_loss(self, mode: ModeKeys, name: str, value: torch.Tensor) -> None:
        # traced by torch.compile: keep the value whatever the step (the step boundary drops it on
        # unsaved steps); reading the step counters here would recompile the graph every step
        if not compiling() and Kind.LOSSES not in self._saving(mode):
            return
        value = value.detach()
        self.pending.add_scalar(mode, Kind.LOSSES, name, value.float().mean() if value.numel() != 1 else value.reshape(()).clone())

    def add_summary(self, mode: ModeKeys, name: str, value: Any, is_tensor: bool) -> None:
        if not compiling() and Kind.SUMMARIES not in self._saving(mode):
            return
        if is_tensor:
            if not isinstance(value, torch.Tensor):
                raise expected("tensor", "a torch.Tensor", value)
            self.pending.add_tensor(mode, Kind.SUMMARIES, None, name, value.detach().clone())
        else:
            if isinstance(value, torch.Tensor):
                value = value.detach().float().mean() if value.numel() != 1 else value.detach().reshape(()).clone()
            elif not isinstance(value, (int, float)) or isinstance(value, bool):
                raise expected("value", "a number or a tensor", value)
            self.pending.add_scalar(mode, Kind.SUMMARIES, name, value)

    def capture(self, mode: ModeKeys, kind: str, module_name: str, name: str, tensor: torch.Tensor) -> None:
        """See :meth:`Recorder.capture <tensorlens.engine.recorder.Recorder.capture>`."""
        piece = self._reduce_captured(mode, kind, module_name, tensor)
        if piece is not None:
            self.pending.add_tensor(mode, kind, module_name, name, piece)
        else:
            self.pending.add_captured(mode, kind, module_name, name, tensor.detach())

    def _reduce_captured(self, mode: ModeKeys, kind: str, module_name: str, tensor: torch.Tensor) -> ReducedPiece | None:
        # any device: the compiled kernel on a CPU, PyTorch ops elsewhere (rows stay on the device)
        if compiling() or tensor.layout != torch.strided or tensor.numel() < REDUCE_WHEN_CAPTURED:
            return None
        plan = self.schedule.capture_plan(mode, kind, module_name, self._saving(mode))
        return reduce_now(tensor, plan) if plan is not None else None

    def parameters(self) -> list[tuple[str, torch.Tensor]]:
        if len(self.sources) == 1 and getattr(self.sources[0], "unique_parameters", False):
            return self.sources[0].parameters()  # it lists each parameter once already
        seen: set[int] = set()
        out = []
        for source in self.sources:
            for name, param in source.parameters():
                # tied weights are recorded once; an uninitialised (lazy) parameter from its first step with values
                if id(param) not in seen and not torch.nn.parameter.is_lazy(param):
                    seen.add(id(param))
                    out.append((name, param))
        return out

    def parameter_jobs(self, saving: frozenset[str]) -> list[TensorJob]:
        return self._parameter_jobs.jobs(self.schedule, self.parameters, saving)

    def pending_jobs(self, saving: frozenset[str], mode: ModeKeys) -> list[TensorJob]:
        """Jobs for everything captured in ``mode`` since its last boundary; forgets those."""
        jobs = gather.pending_jobs(self.schedule, self.pending, saving, mode)
        if self.pending.changed:
            names, self.pending.changed = self.pending.changed, []
            self._warn(
                f"{', '.join(names)} changed in place after being captured (an in-place op after the module): "
                "left out of this step, copied when captured from now on"
            )
        return jobs

    def host_scalars(self, optimizer: torch.optim.Optimizer | None, saving: frozenset[str], step: int) -> list[ScalarEntry]:
        """The optimizer's settings and the sources' own numbers at a train step's end."""
        out = gather.optimizer_scalars(optimizer, saving)
        for source in self.sources:
            step_scalars = getattr(source, "step_scalars", None)
            if step_scalars is not None:
                out += step_scalars(saving, step)
        return out
