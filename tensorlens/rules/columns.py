"""A record's statistics as columns, for rules that check every tensor of every step.

A record holds its scalars as one array named by ``(tensor, stat)`` pairs. :class:`Columns` works
out once per layout (the name tuple a stored run's records share, see
:mod:`tensorlens.record_diff`) which tensors it holds, in which order, and where each
statistic of each tensor sits; a rule then reads a statistic of every tensor as one array
(``columns.column(record, "nan_count")``) and checks them all with numpy, instead of building a
dictionary per tensor per step. With thousands of tensors that Python work, repeated by every
rule at every step, is what made ``tensorlens rules`` slow on a large store.

>>> cols = columns(record)                                          # doctest: +SKIP
>>> nan = cols.column(record, "nan_count", fill=0.0)                # doctest: +SKIP
>>> [cols.tensors[i] for i in np.flatnonzero(nan > 0)]              # doctest: +SKIP
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Hashable

import numpy as np

from tensorlens.records import StepRecord


class Columns:
    """Where each statistic of each tensor of one layout sits (see the module docstring)."""

    def __init__(self, names: tuple[tuple[str, str], ...]) -> None:
        self.names = names
        self.tensors: list[str] = list(dict.fromkeys(t for t, _ in names))
        position = {t: i for i, t in enumerate(self.tensors)}
        by_stat: dict[str, tuple[list[int], list[int]]] = {}
        for i, (tensor, stat) in enumerate(names):
            rows, at = by_stat.setdefault(stat, ([], []))
            rows.append(position[tensor])
            at.append(i)
        self._stats = {stat: (np.asarray(rows, dtype=np.intp), np.asarray(at, dtype=np.intp))
                       for stat, (rows, at) in by_stat.items()}
        self._masks: dict[Hashable, np.ndarray] = {}
        self._lock = threading.Lock()

    def column(self, record: StepRecord, stat: str, fill: float = np.nan) -> np.ndarray:
        """``stat`` of every tensor (in :attr:`tensors` order), ``fill`` where it has none."""
        out = np.full(len(self.tensors), fill, dtype=np.float64)
        found = self._stats.get(stat)
        if found is not None:
            out[found[0]] = record.scalar_values[found[1]]
        return out

    def has(self, stat: str) -> np.ndarray:
        """Which tensors have ``stat``."""
        out = np.zeros(len(self.tensors), dtype=bool)
        found = self._stats.get(stat)
        if found is not None:
            out[found[0]] = True
        return out

    def positions(self, stat: str) -> tuple[np.ndarray, np.ndarray]:
        """``(tensor rows, value positions)`` of the tensors that have ``stat``."""
        found = self._stats.get(stat)
        return found if found is not None else (np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.intp))

    @functools.cached_property
    def groups(self) -> list[list[tuple[str, int]]]:
        """Per tensor (in :attr:`tensors` order), its ``(stat, position)`` pairs in record order."""
        out: list[list[tuple[str, int]]] = [[] for _ in self.tensors]
        position = {t: i for i, t in enumerate(self.tensors)}
        for i, (tensor, stat) in enumerate(self.names):
            out[position[tensor]].append((stat, i))
        return out

    @functools.cached_property
    def _index(self) -> dict[tuple[str, str], int]:
        return {name: i for i, name in enumerate(self.names)}

    def scalar(self, record: StepRecord, tensor: str, stat: str = "") -> float | None:
        """One value of a record of this layout (``StepRecord.scalar`` indexes each record anew)."""
        position = self._index.get((tensor, stat))
        return None if position is None else float(record.scalar_values[position])

    def mask(self, key: Hashable, predicate: Callable[[str], bool]) -> np.ndarray:
        """``predicate`` over the tensors, worked out once per layout and ``key`` (hold the key:
        a rule's :class:`~tensorlens.rules.params.Selection` is one)."""
        found = self._masks.get(key)
        if found is None:
            found = np.fromiter((bool(predicate(t)) for t in self.tensors), dtype=bool, count=len(self.tensors))
            with self._lock:
                self._masks[key] = found
        return found


def count(value: float) -> str:
    """A count read from a record, as text (a damaged store may hold NaN where a count goes)."""
    return str(int(value)) if math.isfinite(value) else str(value)


_CACHE: dict[int, tuple[tuple[tuple[str, str], ...], Columns]] = {}  # id -> (the tuple, held), its columns
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 8  # layouts in use at once: a few per run, a few runs
_RECENT = 4  # layouts a live run alternates between (train, eval, ...), found by equality
_last: list[Columns] = []


def columns(record: StepRecord) -> Columns:
    """The :class:`Columns` of a record's layout, made once and kept for its next records.

    A stored run's records share their layout's tuple (found by identity); a live run's engine
    builds a new tuple each step from the same names, and each worker's store file has its own
    (found by equality with the last few layouts: a comparison of identical objects, in C)."""
    names = record.scalar_names
    found = _CACHE.get(id(names))
    if found is not None and found[0] is names:
        return found[1]
    # tuples of other lengths differ at once; equal ones are compared item by item, by identity first
    made = next((c for c in list(_last) if c.names == names), None) or Columns(names)
    with _CACHE_LOCK:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.clear()
        _CACHE[id(names)] = (names, made)
        _last[:] = [made, *(c for c in _last if c is not made)][:_RECENT]
    return made
