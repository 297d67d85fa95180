"""Plain-text tables that fit the terminal: numbers right-aligned, the widest text column
(tensor names) shortened in the middle with ``…`` when the table is too wide, and trailing
columns left out (and named) when even that is not enough.

Every line the CLI prints passes through :func:`printable` (tables through :func:`cell`, other
lines through :func:`echo`): names come from run stores, which are untrusted files, and a name
holding a terminal control sequence (OSC 52 writes the clipboard, ``ESC[2J`` clears the screen,
a bare CR overwrites the line) must reach the terminal as visible text, never as a command."""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

#: What :func:`printable` escapes: C0 controls and DEL, C1 controls (``\x9b`` is a one-byte CSI),
#: the bidirectional overrides, embeddings and isolates (they reorder the text around them, the
#: "Trojan Source" trick) with the marks LRM, RLM and ALM, and lone surrogates (not encodable).
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_UNPRINTABLE_KEEP_NEWLINES = re.compile(
    r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object, newlines: bool = False) -> str:
    """``text`` with every character that a terminal would act on, rather than show, written as
    a Python-style escape (``\\x1b``, ``\\x9b``, ``\\u202e``, ``\\udc80``). ``newlines=True`` keeps
    ``\\n`` (several lines of output); otherwise it is escaped too (one table cell, one line)."""
    text = text if isinstance(text, str) else str(text)
    return (_UNPRINTABLE_KEEP_NEWLINES if newlines else _UNPRINTABLE).sub(_escape, text)


def echo(text: object = "", err: bool = False) -> None:
    """``click.echo`` of :func:`printable` text (newlines kept): the one way the CLI prints a
    line that may hold a name from a run store, a path or any other text it did not write."""
    import click

    click.echo(printable(text, newlines=True), err=err)


def terminal_width() -> int | None:
    """The terminal's width, or ``None`` (no limit) when standard output is not a terminal and
    ``COLUMNS`` is not set: a table piped into a file or ``grep`` keeps its names whole."""
    if os.environ.get("COLUMNS", "").isdigit():
        return int(os.environ["COLUMNS"])
    try:
        if not sys.stdout.isatty():
            return None
    except (AttributeError, ValueError):
        return None
    return shutil.get_terminal_size((120, 24)).columns


def cell(value: Any) -> str:
    """A value as table text: floats with 6 significant digits, NaN and Inf spelled out, text
    through :func:`printable`."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value == int(value) and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.6g}"
    return printable(value)


def shorten(text: str, width: int) -> str:
    """``text`` cut in the middle to ``width`` characters (names differ at both ends)."""
    if len(text) <= width:
        return text
    if width <= 1:
        return text[:width]
    keep = width - 1
    return text[: keep - keep // 2] + "…" + text[len(text) - keep // 2:]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], width: int | None = None,
                 flexible: int = 0, min_flexible: int = 16, keep_flexible: int = 36,
                 hint: str = "widen the terminal", keep: int = 0) -> list[str]:
    """Lines of a table no wider than ``width`` (default: :func:`terminal_width`). Column
    ``flexible`` (names) is shortened to ``keep_flexible`` characters first, then columns past
    the first ``keep`` are dropped from the right (the last line says which, and ``hint`` what
    to do), then names are shortened further down to ``min_flexible``, then more columns go."""
    width = width if width is not None else terminal_width()
    if width is None:
        width = 1 << 30
    headers = [printable(h) for h in headers]
    texts = [[cell(v) for v in row] for row in rows]
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) if rows else False
               for i in range(len(headers))]
    widths = [max([len(h)] + [len(r[i]) for r in texts]) for i, h in enumerate(headers)]
    columns = list(range(len(headers)))
    dropped: list[str] = []

    def total() -> int:
        return sum(widths[i] for i in columns) + 2 * (len(columns) - 1)

    def shrink(floor: int) -> None:
        if total() > width and flexible in columns:
            widths[flexible] = max(floor, len(headers[flexible]), widths[flexible] - (total() - width))

    shrink(min(keep_flexible, widths[flexible]) if flexible in columns else 0)
    while total() > width and len(columns) > max(2, keep):
        dropped.insert(0, headers[columns.pop()])
    shrink(min_flexible)
    while total() > width and len(columns) > 2:
        dropped.insert(0, headers[columns.pop()])
    lines = []
    for row in [list(headers), *texts]:
        parts = []
        for i in columns:
            text = shorten(row[i], widths[i])
            parts.append(text.rjust(widths[i]) if numeric[i] else text.ljust(widths[i]))
        lines.append("  ".join(parts).rstrip())
    if dropped:
        note = f"({len(dropped)} more column{'s' if len(dropped) > 1 else ''} not shown: {', '.join(dropped)}; {hint})"
        lines.extend(textwrap.wrap(note, width=max(width, 20)))
    return lines
