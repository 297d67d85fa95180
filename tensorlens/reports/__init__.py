"""Pages to look at a stored run: the HTML report (``tl.report``) and the module explorer
(``tl.explore``), each one self-contained file that needs no server and no network.

>>> tl.report("tensorlens_runs/my-run", path="report.html")       # doctest: +SKIP
>>> tl.explore("tensorlens_runs/my-run", path="explorer.html")    # doctest: +SKIP

Layout: :mod:`.data` reads a run in one pass; :mod:`.health` checks it (the default rules on the
store, first NaN/Inf, dead layers, update ratios); :mod:`.summary` makes the sections a report opens
with (each run's health, what differs between runs) and :mod:`.sections` the others (register your
own with :func:`register_section`); :mod:`.blocks` holds the page's building blocks and Vega-Lite
specs; :mod:`.page` inlines everything into one HTML file; :mod:`.explorer` builds the module tree
and marks the modules with findings.
"""

from __future__ import annotations

from tensorlens.reports.data import LoadOptions, RunData, load_run
from tensorlens.reports.explorer import build_explorer, explore
from tensorlens.reports.report import Page, build_report, report
from tensorlens.reports.sections import ReportOptions, register_section, registered_sections

__all__ = [
    "LoadOptions",
    "Page",
    "ReportOptions",
    "RunData",
    "build_explorer",
    "build_report",
    "describe_modules",
    "explore",
    "load_run",
    "register_section",
    "registered_sections",
    "report",
]


def __getattr__(name: str) -> object:
    # describe_modules walks an nn.Module, so it needs torch: imported when asked for, and reading a
    # run (show, export, report, explore) never imports torch
    if name == "describe_modules":
        from tensorlens.capture.modules import describe_modules

        return describe_modules
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
