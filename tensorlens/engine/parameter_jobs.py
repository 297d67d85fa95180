"""The jobs of a model's parameters, planned once and reused while nothing they depend on changes.

At every saved step the recorder turns each parameter and its gradient into one
:class:`~tensorlens.compute.jobs.TensorJob` per collection that records it. Which collections match
a name, the record name, the statistics and histogram config only change when the parameters,
the collections saving the step or a config change, so :class:`ParameterJobs` matches them once
and, at the next steps, only puts this step's tensors (the same parameter objects, their current
gradients) into jobs built from the kept templates: about half a microsecond per tensor instead of
a few. The key is the parameters (by identity and name), the set of saving collections and the
schedule's :attr:`~tensorlens.engine.schedule.Schedule.version`, bumped by every change of a collection
or config (``tests/test_step_plan.py`` changes each between steps). A lazy parameter
(``nn.LazyLinear``) is left out of the list until it materialises, and materialising keeps its
``id`` but adds its name, so the key changes then (``tests/test_robustness.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tensorlens.collection import PARAMETER_KINDS, Kind, parameter_kind
from tensorlens.compute.jobs import TensorJob
from tensorlens.engine.schedule import Schedule

# (record name, stats, histogram, save_raw, save_shape, plain_scalar)
_Template = tuple[str, tuple[str, ...], Any, bool, bool, bool]


def _template(job: TensorJob) -> _Template:
    return (job.name, job.stats, job.histogram, job.save_raw, job.save_shape, job.plain_scalar)


class ParameterJobs:
    """Jobs for the weights, biases and gradients of parameters, from templates kept across steps.

    >>> cache = ParameterJobs()
    >>> jobs = cache.jobs(schedule, lambda: [("fc.weight", weight)], saving)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._entries: list[tuple[torch.Tensor, list[_Template], list[_Template], bool]] = []
        self.built = 0  # times the templates were (re)built, for tests

    def jobs(
        self, schedule: Schedule, parameters: Callable[[], list[tuple[str, torch.Tensor]]], saving: frozenset[str]
    ) -> list[TensorJob]:
        """The same jobs as :func:`tensorlens.engine.gather.parameter_jobs`, in the same order.
        ``parameters()`` is called only when ``saving`` holds a parameter collection: a step
        that records none (an unsaved one) does not walk the model."""
        if not schedule.with_kinds(saving, PARAMETER_KINDS):
            return []
        found = parameters()
        key = (saving, schedule.version, [name for name, _ in found], [id(p) for _, p in found])
        if key != self._key:
            self._build(schedule, found, saving)
            self._key = key
        out: list[TensorJob] = []
        append = out.append
        for param, weight_jobs, grad_jobs, distributed in self._entries:
            if weight_jobs:
                piece, sharded = _local_piece(param) if distributed else (param, False)
                for name, stats, histogram, save_raw, save_shape, plain in weight_jobs:
                    append(TensorJob(name, [piece], stats, histogram, save_raw, save_shape, plain, sharded))
            if grad_jobs:
                grad = param.grad
                if grad is not None:
                    piece, sharded = _local_piece(grad) if distributed or hasattr(grad, "placements") else (grad, False)
                    for name, stats, histogram, save_raw, save_shape, plain in grad_jobs:
                        append(TensorJob(name, [piece], stats, histogram, save_raw, save_shape, plain, sharded))
        return out

    def _build(self, schedule: Schedule, parameters: list[tuple[str, torch.Tensor]], saving: frozenset[str]) -> None:
        self.built += 1
        entries = []
        for name, param in parameters:
            kind = parameter_kind(name)
            weights = [_template(schedule.job(c, kind, name, [])) for c in schedule.collections_for(kind, name, saving)]
            grads = [_template(schedule.job(c, Kind.GRADIENTS, name, [])) for c in schedule.collections_for(Kind.GRADIENTS, name, saving)]
            entries.append((param, weights, grads, hasattr(param, "placements")))
        self._entries = entries


def _local_piece(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    from tensorlens.engine.gather import local_piece

    return local_piece(tensor)
