"""Name patterns that users give (``include_regex``, dynamics' ``channel_last`` and
``saturation_bounds``): compiled and checked once, and matched at most once per (pattern, name).

Why not a time limit: Python's ``re`` has no timeout, and its matcher holds the GIL, so a helper
thread cannot interrupt it (the training thread would stall with it); a subprocess per match
costs more than a saved step. Two things keep a catastrophic pattern such as ``(a+)+$``
(exponential in the name's length: 25 s on a 25-character name) from costing every step:

- each (pattern, name) pair is matched once and the answer kept (:func:`search`): patterns are
  asked about the same few thousand names at every saved step, so a slow pattern costs its one
  match per name, at the first step that meets the name, never again;
- a pattern with a repeat of unbounded length inside another one (``(a+)+``, ``(\\w*\\.)*``), the
  shape of nearly every catastrophic backtracking, gets one warning where it is given
  (:func:`compile_pattern`), naming the pattern and how to rewrite it (a possessive ``++`` or
  an atomic group ``(?>...)`` never backtracks). Ambiguous alternations (``(a|a)*``) are not
  detected: telling them apart needs more than the pattern's shape.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any

from tensorlens._checks import expected

try:  # Python 3.11+
    from re import _constants as _sre_constants  # type: ignore[attr-defined]
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # Python 3.10
    import sre_constants as _sre_constants  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

_REPEATS = {_sre_constants.MAX_REPEAT, _sre_constants.MIN_REPEAT}
_ATOMIC = {getattr(_sre_constants, op) for op in ("POSSESSIVE_REPEAT", "ATOMIC_GROUP") if hasattr(_sre_constants, op)}
#: Answers kept: enough for the names of a very large model times a few patterns; past it the
#: least recently asked are matched again (a model's names are asked at every saved step, so
#: they stay).
CACHE_SIZE = 1 << 17


def nested_quantifiers(pattern: str) -> bool:
    """Whether ``pattern`` repeats, without bound, something that itself repeats without bound.

    >>> nested_quantifiers(r"(a+)+$"), nested_quantifiers(r"encoder\\.layers\\.\\d+\\.mlp"), nested_quantifiers(r"(a++)+")
    (True, False, False)
    """
    try:
        parsed = _sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return False  # compile_pattern reports what cannot be parsed
    return _walk(parsed, inside_unbounded=False)


def _walk(items: Any, inside_unbounded: bool) -> bool:
    for op, av in items:
        if op in _REPEATS:
            _low, high, body = av
            unbounded = high == _sre_constants.MAXREPEAT
            if (unbounded and inside_unbounded) or _walk(body, inside_unbounded or unbounded):
                return True
        elif op in _ATOMIC:  # never backtracked into from outside: only what is inside counts
            if any(_walk(sub, False) for sub in _children(av)):
                return True
        elif any(_walk(sub, inside_unbounded) for sub in _children(av)):
            return True
    return False


def _children(av: Any) -> list[Any]:
    """The sub-patterns inside one parsed item's argument (groups, branches, lookarounds)."""
    if isinstance(av, _sre_parse.SubPattern):
        return [av]
    if isinstance(av, (tuple, list)):
        out = []
        for part in av:
            out += _children(part)
        return out
    return []


def compile_pattern(pattern: Any, name: str = "regex") -> re.Pattern[str]:
    """``pattern`` compiled; a clear error for what is not a valid regular expression, and one
    warning for a pattern whose matching can take exponential time (see the module docstring)."""
    if not isinstance(pattern, str):
        raise expected(name, "a string", pattern)
    try:
        compiled = re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as err:
        raise expected(name, "a valid regular expression", pattern) from err
    if nested_quantifiers(pattern):
        warnings.warn(
            f"tensorlens: the pattern {pattern!r} ({name}) repeats a repeat: matching it can take time exponential "
            "in a name's length (Python's re cannot be interrupted). Each name is matched against it once per run; "
            "rewrite it without nested repeats, or make the inner one possessive (a++) or atomic ((?>a+))",
            stacklevel=3,
        )
    return compiled


@functools.lru_cache(maxsize=CACHE_SIZE)
def search(pattern: re.Pattern[str], name: str) -> bool:
    """Whether ``pattern`` is found in ``name`` (``re.search``), matched once per pair and kept.

    >>> search(re.compile(r"fc\\d"), "model.fc1.weight")
    True
    """
    return pattern.search(name) is not None


def matches_count() -> int:
    """How many (pattern, name) pairs were actually matched (not answered from the cache)."""
    return search.cache_info().misses
