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

#: +1 for an opening bracket, -1 for a closing one, 0 for every other byte.
_STEP = np.zeros(256, np.int8)
_STEP[[ord("["), ord("{")]], _STEP[[ord("]"), ord("}")]] = 1, -1
_QUOTE = ord('"')


def too_deep(text: str) -> bool:
    """Whether ``text`` nests arrays and objects deeper than :data:`MAX_DEPTH`."""
    # the usual case: too few brackets to nest that deep, no scan
    return text.count("[") + text.count("{") > MAX_DEPTH and depth(text) > MAX_DEPTH


def depth(text: str) -> int:
    """How deep ``text`` nests arrays and objects (brackets inside strings do not count). Strings
    are told apart as ``json`` tells them, so for a text that is not JSON the count is exact up to
    its first error, where ``json`` stops too. A few passes in C and numpy, none in Python per character."""
    # escapes first, left to right as JSON reads them: "\\" pairs, then escaped quotes; every
    # quote left opens or closes a string
    bare = text.replace("\\\\", "").replace('\\"', "").encode("utf-8", "surrogatepass")
    data = np.frombuffer(bare, np.uint8)
    steps = _STEP[data]
    brackets = np.flatnonzero(steps)
    # a bracket with an odd number of quotes before it is inside a string
    outside = (np.searchsorted(np.flatnonzero(data == _QUOTE), brackets) & 1) == 0
    return int(np.cumsum(steps[brackets[outside]], dtype=np.int64).max(initial=0))


def load(path: str, text: str, table: str, where: str, nonfinite_as_text: bool = False) -> Any:
    """The value of the JSON ``text`` read from ``table`` (``where`` names the row), or a
    :class:`CorruptRunError` saying what is wrong with it. With ``nonfinite_as_text``, ``NaN``,
    ``Infinity`` and numbers beyond a float read as the texts ``"NaN"``, ``"Infinity"``, ``"-Infinity"``."""
    if too_deep(text):
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
    if too_deep(text):
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
