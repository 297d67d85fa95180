"""Argument checks shared by every public constructor: one wording for every configuration error."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def expected(name: str, what: str, got: Any) -> ValueError:
    """The uniform wording of every configuration error."""
    return ValueError(f"Expected `{name}` to be {what}, but got {got!r}")


def _int_or_none(name: str, value: Any, minimum: int = 0) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise expected(name, f"None or an integer >= {minimum}", value)


def names_list(name: str, value: Iterable[str]) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Iterable):
        raise expected(name, "a list of collection names", value)
    out = list(value)
    for item in out:
        if not isinstance(item, str):
            raise expected(name, "a list of collection names", value)
    return out
