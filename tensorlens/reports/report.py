"""The HTML report of one or several runs: ``tl.report(run_or_runs, path="report.html")``.

One self-contained file (see :mod:`tensorlens.reports.page`): opens offline, from a mail
attachment or a CI artifact, with no server. Runs given together are overlaid, one colour each.
"""

from __future__ import annotations

import html
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from tensorlens.reports.blocks import RUN_COLORS, to_html
from tensorlens.reports.data import LoadOptions, RunData, load_run
from tensorlens.reports.health import rules_reader
from tensorlens.reports.page import esc, render, write
from tensorlens.reports.sections import ReportOptions, build_sections
from tensorlens.store.reader import Run


class Page:
    """A built page: ``.html`` (the text), ``.save(path)``, and inline display in Jupyter."""

    def __init__(self, html_text: str, title: str, path: str | None = None) -> None:
        self.html = html_text
        self.title = title
        self.path = path

    def save(self, path: str | os.PathLike[str]) -> str:
        self.path = write(path, self.html)
        return self.path

    def _repr_html_(self) -> str:
        # an iframe keeps the page's scripts and styles apart from the notebook's
        return (f'<iframe title="{esc(self.title)}" srcdoc="{html.escape(self.html, quote=True)}" '
                'style="width:100%;height:820px;border:1px solid #ddd" sandbox="allow-scripts"></iframe>')

    def __repr__(self) -> str:
        return f"Page({self.title!r}, {len(self.html)} characters{', ' + repr(self.path) if self.path else ''})"


def _as_list(runs: Any) -> list[Any]:
    if isinstance(runs, (str, os.PathLike, Run)):
        return [runs]
    if isinstance(runs, Sequence) and runs and all(isinstance(r, (str, os.PathLike, Run)) for r in runs):
        return list(runs)
    raise ValueError(f"Expected `runs` to be a run folder, a tl.Run or a non-empty list of them, but got {runs!r}")


def load_runs(runs: Any, load: LoadOptions, progress: Callable[[int], None] | None = None) -> list[RunData]:
    # the default rules run in the pass that loads each run: the health summary costs no second read
    loaded = [load_run(r, load, progress, reader=rules_reader) for r in _as_list(runs)]
    seen: dict[str, int] = {}
    for data in loaded:  # two runs with one name would share a colour and a legend entry
        count = seen.get(data.name, 0)
        seen[data.name] = count + 1
        if count:
            data.name = f"{data.name} ({count + 1})"
    return loaded


def build_report(
    runs: Any,
    options: ReportOptions | None = None,
    load: LoadOptions | None = None,
    title: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> Page:
    """The report page of ``runs`` (see :func:`report`)."""
    options = options or ReportOptions()
    loaded = load_runs(runs, load or LoadOptions(), progress)
    title = title or "tensorlens report: " + ", ".join(r.name for r in loaded)
    charts: dict[str, dict[str, Any]] = {}
    sections = build_sections(loaded, options)
    nav = "".join(f'<a href="#{esc(s.key)}">{esc(s.title)}</a>' for s in sections)
    body = (
        f'<header class="tl-header"><h1>{esc(title)}</h1>'
        f'<p class="tl-meta">generated {esc(time.strftime("%Y-%m-%d %H:%M:%S"))}</p>{_runs_table(loaded)}'
        f'<nav class="tl-nav">{nav}</nav></header>\n<main>{to_html(sections, charts)}</main>'
    )
    return Page(render("report", title, body, {"page": "report", "charts": charts}), title)


def _runs_table(runs: Sequence[RunData]) -> str:
    rows = []
    for i, r in enumerate(runs):
        steps = f"{len(r.steps)}" + (f" ({r.steps[0]} … {r.steps[-1]})" if r.steps else "")
        workers = r.worker or "-"
        if len(r.workers) > 1:
            workers = f"{r.worker} of {len(r.workers)}"
        color = RUN_COLORS[i % len(RUN_COLORS)]
        rows.append(
            f'<tr><td><span class="tl-swatch" style="background:{color}"></span>{esc(r.name)}</td>'
            f"<td>{esc(r.path)}</td><td>{esc(steps)}</td><td>{esc(', '.join(r.modes))}</td>"
            f"<td>{esc(workers)}</td><td>{len(r.tensors)}</td></tr>"
        )
    return ('<table class="tl-table tl-runs"><thead><tr><th>run</th><th>folder</th><th>saved steps</th><th>modes</th>'
            f'<th>worker shown</th><th>tensors</th></tr></thead><tbody>{"".join(rows)}</tbody></table>')


def report(
    run_or_runs: Any,
    path: str | os.PathLike[str] | None = "report.html",
    *,
    stat: str = "l2",
    histogram_axis: str = "quantile",
    worker: str | None = None,
    title: str | None = None,
) -> Page:
    """Write the HTML report of one run or several (overlaid) and return it; in Jupyter the
    returned page shows inline. ``path=None`` writes nothing.

    >>> page = tl.report("tensorlens_runs/my-run")                          # doctest: +SKIP
    >>> page = tl.report([run_a, run_b], path="compare.html", stat="std")   # doctest: +SKIP
    """
    if histogram_axis not in ("quantile", "symlog", "range"):
        raise ValueError(f"Expected `histogram_axis` to be 'quantile', 'symlog' or 'range', but got {histogram_axis!r}")
    if not isinstance(stat, str) or not stat:
        raise ValueError(f"Expected `stat` to be a statistic name such as 'l2', but got {stat!r}")
    page = build_report(run_or_runs, ReportOptions(stat=stat, histogram_axis=histogram_axis),
                        LoadOptions(worker=worker), title=title)
    if path is not None:
        page.save(path)
    return page
