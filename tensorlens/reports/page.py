"""One self-contained HTML page: the vendored Vega, Vega-Lite and vega-embed builds, the page's
own script and style, and its data, all inlined. Nothing on the page makes a request.

Data travels as one JSON document in a ``<script type="application/json">`` element, written so
that no text in it can end the element (``<``, ``>`` and ``&`` are ``\\u`` escapes, so neither
``</script`` nor ``<!--`` can appear), and read with ``JSON.parse``; the page's script puts names
on the page only as text (``textContent``, ``title``), never as markup. Some characters are shown
as their escape, in the markup and in the data alike (:func:`unicode_text`): U+2028 and U+2029
(invisible, and the end of a Vega expression string), surrogates (a lone one, such as
``"layer\\udc80"`` in a name an older store holds, cannot be written as UTF-8) and the
bidirectional controls (they reorder the text around them): the page can always be written, every
chart drawn, and a name reads as it is.

Datasets are compact: columns rather than rows (:func:`table`), heatmaps as quantised levels in
base64 (:func:`grid`); the script expands them before a chart is drawn.
"""

from __future__ import annotations

import base64
import functools
import html
import json
import math
import os
import re
from collections.abc import Sequence
from importlib import resources
from typing import Any

import numpy as np

#: The vendored scripts, in load order (see ``assets/VERSIONS.json`` and ``tools/fetch_report_assets.py``).
VENDORED = ("vega.min.js", "vega-lite.min.js", "vega-embed.min.js")
#: Heatmap cells are quantised to this many levels of log10(fraction) in ``[LOG_FLOOR, 0]``.
LEVELS = 255
LOG_FLOOR = -4.0


@functools.cache
def asset(name: str) -> str:
    """The text of a packaged asset (``tensorlens/reports/assets/<name>``), without source-map
    comments (a browser's developer tools would try to fetch the map)."""
    text = resources.files("tensorlens.reports").joinpath("assets", name).read_text(encoding="utf-8")
    return re.sub(r"^//# sourceMappingURL=.*$", "", text, flags=re.MULTILINE)


def asset_versions() -> dict[str, Any]:
    return json.loads(asset("VERSIONS.json"))


def script_json(document: Any) -> str:
    """``document`` as JSON that is safe inside a ``<script>`` element (no ``<``, ``>``, ``&``)
    and shows U+2028, U+2029, surrogates and bidirectional controls as their escapes (see
    :func:`unicode_text`). A
    non-finite number (JSON has no NaN or Infinity) is a ``ValueError`` that says where in
    ``document`` it is."""
    try:
        text = json.dumps(document, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    except ValueError:
        where = _non_finite_at(document)
        if not where:
            raise
        raise ValueError(f"the page's data holds a non-finite number at {unicode_text(where)} (JSON has no NaN "
                         "or Infinity; a chart's data goes through rounded() or table())") from None
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    # these characters can only stand inside a JSON string here: an escaped backslash makes the
    # page read the text ``\\u2028``, as the markup shows it (unicode_text)
    return _ESCAPED.sub(lambda m: f"\\\\u{ord(m.group()):04x}", text)


#: Shown as their escape ``\\u2028`` on the page, in the markup and in the data alike: the line
#: and paragraph separators (a Vega expression string, into which Vega-Lite compiles titles and
#: sort orders, ends at them: "Unexpected token ILLEGAL"; they are invisible anyway), surrogates
#: (a lone one, which an older store may hold in a name, cannot be written as UTF-8), and the
#: bidirectional overrides, embeddings, isolates and marks, which reorder the text around them (the
#: "Trojan Source" trick; the CLI escapes the same ones, see ``tensorlens.cli.table.printable``).
_ESCAPED = re.compile("[\u2028\u2029\ud800-\udfff\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def unicode_text(text: str) -> str:
    """``text`` with U+2028, U+2029, surrogates and bidirectional controls written as their escape
    (``layer\\udc80``, see ``_ESCAPED``): what the page shows for them."""
    return _ESCAPED.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _non_finite_at(document: Any, where: str = "") -> str:
    """Where the first NaN or ±Inf in ``document`` is, as ``charts.c3.data.values.columns.value[7]``."""
    if isinstance(document, float) and not math.isfinite(document):
        return where or "its top level"
    items: Any = ()
    if isinstance(document, dict):
        items = ((f"{where}.{k}" if where else str(k), v) for k, v in document.items())
    elif isinstance(document, (list, tuple)):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(document))
    for path, value in items:
        found = _non_finite_at(value, path)
        if found:
            return found
    return ""


def rounded(values: Any, digits: int = 5) -> list[float | None]:
    """Floats rounded to ``digits`` significant digits (a chart needs no more), NaN and ±Inf as
    ``None`` (JSON has neither; a chart draws a gap)."""
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    out = array.copy()
    finite = np.isfinite(array) & (array != 0)
    if np.any(finite):
        magnitude = np.floor(np.log10(np.abs(array[finite])))
        scale = 10.0 ** (digits - 1 - magnitude)
        out[finite] = np.round(array[finite] * scale) / scale
    result: list[float | None] = out.tolist()
    for i in np.flatnonzero(~np.isfinite(array)).tolist():
        result[i] = None
    return result


def table(**columns: Sequence[Any] | np.ndarray) -> dict[str, Any]:
    """A dataset as columns: ``table(step=[...], value=[...], run=[...])``. Float arrays are
    :func:`rounded`; every column must have the same length."""
    lengths = {len(v) for v in columns.values()}
    if len(lengths) > 1:
        raise ValueError(f"columns of different lengths: { {k: len(v) for k, v in columns.items()} }")
    encoded = {}
    for key, values in columns.items():
        if isinstance(values, np.ndarray) and values.dtype.kind == "f":
            encoded[key] = rounded(values)
        elif isinstance(values, np.ndarray):
            encoded[key] = values.tolist()
        else:
            encoded[key] = [None if isinstance(v, float) and not math.isfinite(v) else v for v in values]
    return {"format": "table", "columns": encoded}


def spans(steps: Sequence[float] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each heatmap column starts and ends on the step axis: centred on its step, from the
    midpoint with the previous step to the midpoint with the next, so that the first column starts
    at the first step and the last ends at the last (the axis covers exactly the saved steps) and
    uneven gaps are drawn to scale. A column reaches 15 % of the gap into the next one, which is
    drawn over it, so that a canvas draws no hairline seam between them. A single step spans ±0.5."""
    steps = np.asarray(steps, dtype=np.float64)
    if len(steps) < 2:
        return steps - 0.5, steps + 0.5
    gaps = np.diff(steps)
    middles = steps[:-1] + gaps / 2
    return np.append(steps[:1], middles), np.append(middles + 0.15 * gaps, steps[-1:])


def grid(steps: Sequence[int], grid_edges: np.ndarray, image: np.ndarray, **constant: Any) -> dict[str, Any]:
    """A histogram-over-time heatmap: ``image[row, column]`` fractions (rows along ``grid_edges``,
    columns at ``steps``) as ``LEVELS`` levels of log10(fraction) from ``LOG_FLOOR`` to 0, in
    base64. Expanded by the page into rows ``{step, step_start, step_end, low, high, log_fraction}``
    plus ``constant`` fields; empty cells are left out. Columns span the step axis as :func:`spans`
    says."""
    image = np.asarray(image, dtype=np.float64)
    with np.errstate(divide="ignore"):
        logs = np.log10(np.where(image > 0, image, np.nan))
    levels = np.where(
        np.isfinite(logs), 1 + np.round((np.clip(logs, LOG_FLOOR, 0) - LOG_FLOOR) / -LOG_FLOOR * (LEVELS - 1)), 0
    ).astype(np.uint8)
    starts, ends = spans(steps)
    return {
        "format": "grid",
        "steps": rounded(np.asarray(steps, dtype=np.float64), 12),
        "starts": rounded(starts, 12),
        "ends": rounded(ends, 12),
        "edges": rounded(grid_edges, 6),
        "levels": base64.b64encode(np.ascontiguousarray(levels.T).tobytes()).decode("ascii"),  # column-major
        "floor": LOG_FLOOR,
        "count": LEVELS,
        "constant": constant,
    }


def render(kind: str, title: str, body: str, payload: dict[str, Any]) -> str:
    """The whole page: ``body`` is trusted markup built by this package (every name in it passed
    through :func:`html.escape`); ``payload`` is the JSON the page's script reads. The result is
    always encodable as UTF-8 (see :func:`unicode_text`)."""
    vendored = "\n".join(f"<script>{asset(name)}</script>" for name in VENDORED)
    versions = ", ".join(f"{k} {v['version']}" for k, v in asset_versions().items())
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        # Only inline scripts, styles and data: images; the page can reach nothing else.
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "script-src 'unsafe-inline' 'unsafe-eval'; style-src 'unsafe-inline'; img-src data: blob:; "
        "font-src data:; connect-src 'none'\">\n"
        f"<meta name=\"generator\" content=\"tensorlens {html.escape(_version())} ({html.escape(versions)})\">\n"
        f"<title>{unicode_text(html.escape(title))}</title>\n<style>{asset('page.css')}</style>\n</head>\n"
        f"<body class=\"tl-page-{kind}\">\n{unicode_text(body)}\n"
        f"<script type=\"application/json\" id=\"tl-data\">{script_json(payload)}</script>\n"
        f"{vendored}\n<script>{asset('page.js')}</script>\n</body>\n</html>\n"
    )


def _version() -> str:
    from tensorlens._version import __version__

    return __version__


def esc(text: Any) -> str:
    """Text for HTML (element content and quoted attributes)."""
    return html.escape(str(text), quote=True)


def write(path: str | os.PathLike[str], text: str) -> str:
    """Write a page: never over a run's files, into a FIFO or a character device as it is, and
    otherwise atomically (a half-written page is never left behind); see :mod:`tensorlens.cli.output`."""
    # tensorlens.cli.output needs no click: it is the one place the CLI and the API decide where
    # a file may be written
    from tensorlens.cli.output import write_output

    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    return write_output(path, text)


def matrix(rows: Sequence[str], steps: Sequence[int], values: np.ndarray, nonfinite: np.ndarray | None = None,
           **constant: Any) -> dict[str, Any]:
    """A rows x steps table of values (a layer x step heatmap): expanded by the page into rows
    ``{tensor, step, step_start, step_end, value}`` plus ``constant`` fields; NaN cells are left
    out, except where the boolean ``nonfinite`` (same shape) is set: those become rows with
    ``value`` null and ``nonfinite`` true (a recorded NaN or Inf, drawn in its own colour).
    Columns span the step axis as :func:`spans` says."""
    starts, ends = spans(steps)
    flagged = [] if nonfinite is None else np.flatnonzero(np.asarray(nonfinite, dtype=bool).reshape(-1)).tolist()
    return {
        "nonfinite": flagged,  # row-major positions
        "format": "matrix",
        "rows": list(rows),
        "steps": rounded(np.asarray(steps, dtype=np.float64), 12),
        "starts": rounded(starts, 12),
        "ends": rounded(ends, 12),
        "values": rounded(np.asarray(values, dtype=np.float64).reshape(-1)),  # row-major
        "constant": constant,
    }
