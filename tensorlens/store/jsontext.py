"""JSON texts of a run store (layouts, shapes and the ``meta`` entries that hold JSON), read as
untrusted input and written as strict JSON.

Reading: Python's ``json`` recurses once per nesting level, so a text nested 200,000 deep raises
``RecursionError`` (not a ``ValueError``) from deep inside; and it accepts ``NaN``, ``Infinity``
and numbers too large for a float (``1e999`` becomes ``inf``), which are not JSON and break every
strict consumer later (a browser's ``JSON.parse`` in the report). :func:`load` therefore bounds
the nesting with a scan in C and numpy before parsing, and turns each of those into a
:class:`CorruptRunError` naming the file, table and entry; or, for entries whose values come from
a user's configuration (:data:`NONFINITE_AS_TEXT`), reads them as the texts ``"NaN"``,
``"Infinity"`` and ``"-Infinity"``, the form the writer stores them in (:func:`strict`).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from tensorlens.store.errors import CorruptRunError

__all__ = ["JSON_META_KEYS", "MAX_DEPTH", "NONFINITE_AS_TEXT", "load", "load_meta", "strict"]

#: Deeper than anything tensorlens writes (layouts nest 2 levels, the module tree 4, a
#: configuration a handful), and far enough below Python's recursion limit to parse safely.
MAX_DEPTH = 200
#: ``meta`` entries that hold JSON: checked when read, written strict.
JSON_META_KEYS = frozenset({"metadata", "config", "modules"})
#: Entries whose non-finite numbers are data (a configuration's ``max_grad_norm=inf``), read as text.
NONFINITE_AS_TEXT = frozenset({"metadata", "config"})

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)  # disjoint alternatives: linear time
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def depth(text: str) -> int:
    """How deep ``text`` nests arrays and objects (brackets inside strings do not count); at least
    the true depth of a text that is not JSON."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:  # the usual case: no scan
        return MAX_DEPTH
    data = np.frombuffer(_STRING.sub("", text).encode("utf-8", "surrogatepass"), np.uint8)
    steps = np.isin(data, _OPEN).astype(np.int64) - np.isin(data, _CLOSE)
    return int(np.cumsum(steps).max(initial=0))


def load(path: str, text: str, table: str, where: str, nonfinite_as_text: bool = False) -> Any:
    """The value of the JSON ``text`` read from ``table`` (``where`` names the row), or a
    :class:`CorruptRunError` saying what is wrong with it. With ``nonfinite_as_text``, ``NaN``,
    ``Infinity`` and numbers beyond a float read as the texts ``"NaN"``, ``"Infinity"``, ``"-Infinity"``."""
    if depth(text) > MAX_DEPTH:
        raise CorruptRunError(path, f"its JSON nests deeper than {MAX_DEPTH} levels", table, where)

    def constant(name: str) -> str:
        if nonfinite_as_text:
            return name
        raise _NotJSON(f"{name}, which is not a JSON number")

    def number(found: str) -> float | str:
        value = float(found)
        if math.isfinite(value):
            return value
        if nonfinite_as_text:
            return "Infinity" if value > 0 else "-Infinity"
        raise _NotJSON(f"the number {found[:40]}, which does not fit a float")

    try:
        return json.loads(text, parse_constant=constant, parse_float=number)
    except _NotJSON as err:
        raise CorruptRunError(path, f"its JSON holds {err}", table, where) from None
    except (ValueError, RecursionError) as err:  # RecursionError: a bound missed is still not a traceback
        raise CorruptRunError(path, f"it is not JSON ({str(err)[:200]})", table, where) from None


def load_meta(path: str, key: str, text: str) -> Any:
    """The value of the ``meta`` entry ``key`` (one of :data:`JSON_META_KEYS`)."""
    return load(path, text, "meta", f"key {key!r}", key in NONFINITE_AS_TEXT)


def strict(text: str) -> str:
    """``text`` (JSON, as ``json.dumps`` writes it by default) as strict JSON: ``NaN``,
    ``Infinity`` and ``-Infinity`` become those texts, which every JSON reader accepts.
    Raises ``ValueError`` for a text nested deeper than :data:`MAX_DEPTH`: the reader would refuse it."""
    if depth(text) > MAX_DEPTH:
        raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels cannot be stored (the reader refuses it)")
    found = False

    def constant(name: str) -> str:
        nonlocal found
        found = True
        return name

    def number(text: str) -> float | str:
        nonlocal found
        value = float(text)
        if math.isfinite(value):
            return value
        found = True
        return "Infinity" if value > 0 else "-Infinity"

    value = json.loads(text, parse_constant=constant, parse_float=number)
    return json.dumps(value, allow_nan=False) if found else text


class _NotJSON(ValueError):
    pass
