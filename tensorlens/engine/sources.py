"""Where the recorder reads tensors from, and when their module hooks are attached.

A source (:class:`tensorlens.capture.modules.ModuleTaps` for ``nn.Module`` roots, the per-op
scales) lists parameters and captures module tensors through hooks. The hooks are attached when a
saved step begins and detached when it ends, so a step that saves nothing runs no hook. Where the
next step saves the same module tensors (saving every step), they stay attached, idle between the
two steps: attaching a model's hooks costs about as much as capturing its outputs.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tensorlens.collection import Collection
from tensorlens.records import ScalarEntry


class TensorSource(Protocol):
    """What the recorder reads parameters from and asks to capture module tensors on saved steps.
    A source may also have ``end_step()``, called instead of :meth:`detach` when the next step
    saves the same module tensors (its hooks stay attached, capturing nothing), and ``resume()``,
    called when that step begins."""

    def parameters(self) -> list[tuple[str, torch.Tensor]]: ...

    def attach(self, collections: list[Collection]) -> None: ...

    def detach(self) -> None: ...


class ScalarSource(TensorSource, Protocol):
    """A source that also gives numbers of its own when a train step ends (after backward), such
    as the per-op scales (:class:`tensorlens.scales.source.ScaleSource`)."""

    def step_scalars(self, saving: frozenset[str], step: int) -> list[ScalarEntry]: ...


class SourceHooks:
    """The sources' module hooks, attached for the collections that save module tensors in the
    current step. ``version`` (the schedule's) changes with any collection or config, which
    attaches them again.

    >>> hooks = SourceHooks(sources)                        # doctest: +SKIP
    >>> hooks.begin(collections, schedule.version)           # doctest: +SKIP
    >>> hooks.end(next_step_collections, schedule.version)   # doctest: +SKIP
    """

    def __init__(self, sources: list[TensorSource]) -> None:
        self.sources = sources
        self._key: tuple[Any, ...] | None = None  # what the hooks are attached for; None: detached

    @property
    def attached(self) -> bool:
        return self._key is not None

    def begin(self, collections: list[Collection], version: int) -> None:
        """A step begins that saves the module tensors of ``collections`` (none: no hooks)."""
        key = _key(collections, version)
        if self._key is not None and key != self._key:
            self.detach()  # attached for other collections (another mode, a changed config)
        elif self._key is not None:  # kept from the last saved step
            for source in self.sources:
                resume = getattr(source, "resume", None)
                if resume is not None:
                    resume()
        if key is not None and self._key is None:
            for source in self.sources:
                source.attach(collections)
            self._key = key

    def end(self, next_collections: list[Collection], version: int) -> None:
        """The step ended; ``next_collections`` save module tensors in the next step of its mode."""
        if self._key is None:
            return
        if _key(next_collections, version) != self._key or not all(hasattr(s, "end_step") for s in self.sources):
            self.detach()  # (a source that cannot idle its hooks is detached, and attached again)
            return
        for source in self.sources:
            source.end_step()  # type: ignore[attr-defined]

    def detach(self) -> None:
        if self._key is not None:
            for source in self.sources:
                source.detach()
            self._key = None


def _key(collections: list[Collection], version: int) -> tuple[Any, ...] | None:
    return (version, *map(id, collections)) if collections else None
