"""One self-contained HTML page: the vendored Vega, Vega-Lite and vega-embed builds, the page's
own script and style, and its data, all inlined. Nothing on the page makes a request.

Data travels as one JSON document in a ``<script type="application/json">`` element, written so
that no text in it can end the element (``<``, ``>`` and ``&`` are ``\\u`` escapes), and read
with ``JSON.parse``; the page's script puts names on the page only as text (``textContent``),
never as markup. Datasets are compact: columns rather than rows (:func:`table`), heatmaps as
quantised levels in base64 (:func:`grid`); the script expands them before a chart is drawn.
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
    """``document`` as JSON that is safe inside a ``<script>`` element (no ``<``, ``>``, ``&``)."""
    text = json.dumps(document, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").replace(
        "\u2028", "\\u2028").replace("\u2029", "\\u2029")


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


def _ends(steps: np.ndarray) -> np.ndarray:
    """Where each column ends: at the next column, overlapping it by 15 % of the gap so that a
    canvas draws no hairline seam between neighbours (the next column is drawn over it); the
    last column spans the median gap."""
    if not len(steps):
        return steps
    gaps = np.diff(steps)
    last = float(np.median(gaps)) if len(gaps) else 1.0
    return np.append(steps[1:] + 0.15 * gaps, steps[-1] + last)


def grid(steps: Sequence[int], grid_edges: np.ndarray, image: np.ndarray, **constant: Any) -> dict[str, Any]:
    """A histogram-over-time heatmap: ``image[row, column]`` fractions (rows along ``grid_edges``,
    columns at ``steps``) as ``LEVELS`` levels of log10(fraction) from ``LOG_FLOOR`` to 0, in
    base64. Expanded by the page into rows ``{step, step_end, low, high, log_fraction}`` plus
    ``constant`` fields; empty cells are left out. A column ends where the next one begins
    (:func:`_ends`), so uneven gaps between saved steps are drawn to scale."""
    image = np.asarray(image, dtype=np.float64)
    with np.errstate(divide="ignore"):
        logs = np.log10(np.where(image > 0, image, np.nan))
    levels = np.where(
        np.isfinite(logs), 1 + np.round((np.clip(logs, LOG_FLOOR, 0) - LOG_FLOOR) / -LOG_FLOOR * (LEVELS - 1)), 0
    ).astype(np.uint8)
    steps = np.asarray(steps, dtype=np.float64)
    ends = _ends(steps)
    return {
        "format": "grid",
        "steps": rounded(steps, 12),
        "ends": rounded(ends, 12),
        "edges": rounded(grid_edges, 6),
        "levels": base64.b64encode(np.ascontiguousarray(levels.T).tobytes()).decode("ascii"),  # column-major
        "floor": LOG_FLOOR,
        "count": LEVELS,
        "constant": constant,
    }


def render(kind: str, title: str, body: str, payload: dict[str, Any]) -> str:
    """The whole page: ``body`` is trusted markup built by this package (every name in it passed
    through :func:`html.escape`); ``payload`` is the JSON the page's script reads."""
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
        f"<title>{html.escape(title)}</title>\n<style>{asset('page.css')}</style>\n</head>\n"
        f"<body class=\"tl-page-{kind}\">\n{body}\n"
        f"<script type=\"application/json\" id=\"tl-data\">{script_json(payload)}</script>\n"
        f"{vendored}\n<script>{asset('page.js')}</script>\n</body>\n</html>\n"
    )


def _version() -> str:
    from tensorlens import __version__

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


def matrix(rows: Sequence[str], steps: Sequence[int], values: np.ndarray) -> dict[str, Any]:
    """A rows x steps table of values (a layer x step heatmap): expanded by the page into rows
    ``{tensor, step, step_end, value}``; NaN cells are left out."""
    steps = np.asarray(steps, dtype=np.float64)
    ends = _ends(steps)
    return {
        "format": "matrix",
        "rows": list(rows),
        "steps": rounded(steps, 12),
        "ends": rounded(ends, 12),
        "values": rounded(np.asarray(values, dtype=np.float64).reshape(-1)),  # row-major
    }
