"""What was captured since a mode's last step boundary, waiting for that boundary.

Captures are keyed by mode: a validation step run in the middle of a gradient accumulation window
must not take the train micro-batches' captures, nor they its own. Numbers are kept as 0-d tensors
or floats until the step's single host copy.

A module tensor is held as it is, not copied, once a saved step has shown that nothing changes it
in place after its module (:meth:`PendingCaptures.add_captured`): a copy costs an allocation and a
pass over its values for every capture. Its version counter is checked when the step reads it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import torch

from tensorlens._runtime import compiling
from tensorlens.compute.jobs import ReducedPiece
from tensorlens.modes import ModeKeys


class _Check(NamedTuple):
    """The captured tensor and its version counter at capture; ``probe``: the piece held is a
    copy, and the check only tells whether the tensor could have been held as it is."""

    tensor: torch.Tensor
    version: int
    probe: bool


class PendingCaptures:
    """Tensors and numbers captured per (mode, kind, name), and the tensors given to ``save_tensor``.

    >>> pending = PendingCaptures()
    >>> pending.add_tensor(ModeKeys.TRAIN, "activations", "fc1", "fc1", torch.ones(2))
    >>> [(kind, name) for (kind, name), _ in pending.take_tensors(ModeKeys.TRAIN).items()]
    [('activations', 'fc1')]
    """

    def __init__(self) -> None:
        self._tensors: dict[tuple[ModeKeys, str, str], list[torch.Tensor | ReducedPiece]] = defaultdict(list)
        # per key, aligned with its pieces: the version check of a captured tensor (None: a copy or
        # a value given by the caller, nothing to check)
        self._checks: dict[tuple[ModeKeys, str, str], list[_Check | None]] = defaultdict(list)
        # (kind, name) -> whether its captures are held as they are (True) or copied (False);
        # absent: copied and probed at the next saved step
        self.by_reference: dict[tuple[str, str], bool] = {}
        self.changed: list[str] = []  # captures left out: changed in place after they were taken
        self._scalars: dict[tuple[ModeKeys, str, str], list[float | torch.Tensor]] = defaultdict(list)
        self._explicit: dict[ModeKeys, list[tuple[str, str, torch.Tensor]]] = defaultdict(list)
        self.module_of: dict[str, str] = {}  # captured tensor name -> the module it came from

    def add_tensor(
        self, mode: ModeKeys, kind: str, module_name: str | None, name: str, piece: torch.Tensor | ReducedPiece
    ) -> None:
        """``module_name``: the module a module capture came from (``None`` for a summary: written
        from inside a compiled forward, a dict update here would recompile the graph every step)."""
        self._add(mode, kind, module_name, name, piece, None)

    def add_captured(self, mode: ModeKeys, kind: str, module_name: str, name: str, tensor: torch.Tensor) -> None:
        """A module tensor as a hook captured it (detached): held as it is where every saved step
        so far found it unchanged when the step read it, else copied (an in-place op after the
        module, such as ``ReLU(inplace=True)``, must not change what was captured). The first
        capture of a tensor is copied and probed. A tensor without a version counter to check (an
        inference tensor, a subclass, a traced graph) is always copied."""
        check = None
        if compiling() or type(tensor) is not torch.Tensor or tensor.is_inference():
            piece = tensor.clone()
        else:
            held = self.by_reference.get((kind, name))
            if held:
                piece, check = tensor, _Check(tensor, tensor._version, False)
            else:
                piece = tensor.clone()
                if held is None:
                    check = _Check(tensor, tensor._version, True)
        self._add(mode, kind, module_name, name, piece, check)

    def _add(
        self, mode: ModeKeys, kind: str, module_name: str | None, name: str, piece: torch.Tensor | ReducedPiece,
        check: _Check | None,
    ) -> None:
        key = (mode, kind, name)
        self._tensors[key].append(piece)
        self._checks[key].append(check)
        if module_name is not None and self.module_of.get(name) != module_name:
            self.module_of[name] = module_name

    def add_scalar(self, mode: ModeKeys, kind: str, name: str, value: float | torch.Tensor) -> None:
        self._scalars[(mode, kind, name)].append(value)

    def add_explicit(self, mode: ModeKeys, collection: str, name: str, tensor: torch.Tensor) -> None:
        self._explicit[mode].append((collection, name, tensor))

    def take_tensors(self, mode: ModeKeys) -> dict[tuple[str, str], list[torch.Tensor | ReducedPiece]]:
        """``{(kind, name): pieces}`` captured in ``mode``; forgets them. A tensor held as it was
        captured and changed in place since is left out (named in :attr:`changed`) and copied
        from then on; a probed one is held as it is from then on if it did not change."""
        out = {}
        for key in [k for k in self._tensors if k[0] == mode]:
            pieces, checks = self._tensors.pop(key), self._checks.pop(key, [])
            valid = True
            for check in checks:
                if check is None:
                    continue
                unchanged = check.tensor._version == check.version
                if check.probe:  # every probe of the step must find it unchanged
                    self.by_reference[key[1:]] = self.by_reference.get(key[1:], True) and unchanged
                elif not unchanged:
                    valid = False
                    self.by_reference[key[1:]] = False
            if valid:
                out[key[1:]] = pieces
            else:
                self.changed.append(f"{key[1]}/{key[2]}")
        return out

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
        stores = (self._tensors, self._scalars, self._explicit, self._checks)
        # the checks are aligned with the tensors: cut at the same lengths
        for store, lengths in zip(stores, (*mark, mark[0]), strict=True):
            for key in list(store):
                keep = lengths.get(key, 0)
                if keep:
                    del store[key][keep:]
                else:
                    del store[key]

    def clear(self) -> None:
        self._tensors.clear()
        self._checks.clear()
        self._scalars.clear()
        self._explicit.clear()
