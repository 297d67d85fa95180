"""What was captured since a mode's last step boundary, waiting for that boundary.

Captures are keyed by mode: a validation step run in the middle of a gradient accumulation window
must not take the train micro-batches' captures, nor they its own. Tensors are kept as they are
(already copied or reduced by the caller); numbers are kept as 0-d tensors or floats until the
step's single host copy.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from tensorlens.engine.jobs import ReducedPiece
from tensorlens.modes import ModeKeys


class PendingCaptures:
    """Tensors and numbers captured per (mode, kind, name), and the tensors given to ``save_tensor``.

    >>> pending = PendingCaptures()
    >>> pending.add_tensor(ModeKeys.TRAIN, "activations", "fc1", "fc1", torch.ones(2))
    >>> [(kind, name) for (kind, name), _ in pending.take_tensors(ModeKeys.TRAIN).items()]
    [('activations', 'fc1')]
    """

    def __init__(self) -> None:
        self._tensors: dict[tuple[ModeKeys, str, str], list[torch.Tensor | ReducedPiece]] = defaultdict(list)
        self._scalars: dict[tuple[ModeKeys, str, str], list[float | torch.Tensor]] = defaultdict(list)
        self._explicit: dict[ModeKeys, list[tuple[str, str, torch.Tensor]]] = defaultdict(list)
        self.module_of: dict[str, str] = {}  # captured tensor name -> the module it came from

    def add_tensor(
        self, mode: ModeKeys, kind: str, module_name: str | None, name: str, piece: torch.Tensor | ReducedPiece
    ) -> None:
        """``module_name``: the module a module capture came from (``None`` for a summary: written
        from inside a compiled forward, a dict update here would recompile the graph every step)."""
        self._tensors[(mode, kind, name)].append(piece)
        if module_name is not None and self.module_of.get(name) != module_name:
            self.module_of[name] = module_name

    def add_scalar(self, mode: ModeKeys, kind: str, name: str, value: float | torch.Tensor) -> None:
        self._scalars[(mode, kind, name)].append(value)

    def add_explicit(self, mode: ModeKeys, collection: str, name: str, tensor: torch.Tensor) -> None:
        self._explicit[mode].append((collection, name, tensor))

    def take_tensors(self, mode: ModeKeys) -> dict[tuple[str, str], list[torch.Tensor | ReducedPiece]]:
        """``{(kind, name): pieces}`` captured in ``mode``; forgets them."""
        keys = [k for k in self._tensors if k[0] == mode]
        return {key[1:]: self._tensors.pop(key) for key in keys}

    def take_scalars(self, mode: ModeKeys) -> dict[tuple[str, str], list[float | torch.Tensor]]:
        keys = [k for k in self._scalars if k[0] == mode]
        return {key[1:]: self._scalars.pop(key) for key in keys}

    def take_explicit(self, mode: ModeKeys) -> list[tuple[str, str, torch.Tensor]]:
        return self._explicit.pop(mode, [])

    def has_explicit(self, mode: ModeKeys) -> bool:
        return bool(self._explicit.get(mode))

    def modes_with_values(self) -> list[ModeKeys]:
        """The modes holding numbers or ``save_tensor`` tensors (values given after the last step
        boundary, recorded at close), in ``ModeKeys`` order."""
        found = {k[0] for k in self._scalars} | {m for m, v in self._explicit.items() if v}
        return sorted(found, key=list(ModeKeys).index)

    def mark(self) -> tuple[dict[object, int], ...]:
        """A snapshot of how much is pending, for :meth:`rollback`."""
        return (
            {k: len(v) for k, v in self._tensors.items()},
            {k: len(v) for k, v in self._scalars.items()},
            {k: len(v) for k, v in self._explicit.items()},
        )

    def rollback(self, mark: tuple[dict[object, int], ...]) -> None:
        """Forget what was added since ``mark`` (a forward that raised: its batch is skipped)."""
        for store, lengths in zip((self._tensors, self._scalars, self._explicit), mark, strict=True):
            for key in list(store):
                keep = lengths.get(key, 0)
                if keep:
                    del store[key][keep:]
                else:
                    del store[key]

    def clear(self) -> None:
        self._tensors.clear()
        self._scalars.clear()
        self._explicit.clear()
