"""The one error of reading a run store that is not what it should be: :class:`CorruptRunError`.

Its own module because the schema (finding a run's files), the checks of what is read and the
reader all raise it, and ``tl.CorruptRunError`` is what users catch.
"""

from __future__ import annotations

__all__ = ["CorruptRunError"]


class CorruptRunError(ValueError):
    """A run store that cannot be read as one: what is wrong, in which file, table and step.

    ``path``, ``table`` and ``where`` hold the place, ``problem`` the reason.
    """

    def __init__(self, path: str, problem: str, table: str | None = None, where: str | None = None) -> None:
        self.path, self.problem, self.table, self.where = path, problem, table, where
        place = ", ".join(p for p in (f"table {table}" if table else None, _brief(where)) if p)
        super().__init__(f"corrupt run store {path}{f' ({place})' if place else ''}: {_brief(problem, 1000)}")


def _brief(text: str | None, limit: int = 300) -> str | None:
    """``text`` cut to ``limit`` characters: a hostile store's values (a mode, a worker, a name)
    may be megabytes, and the message is one line for a person."""
    if text is None or len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"
