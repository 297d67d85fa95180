"""The building blocks of a page and the charts they hold, as plain data.

A section is a title and a list of blocks: :class:`Chart` (a Vega-Lite spec plus its datasets),
:class:`Note` (a sentence), :class:`Table` (rows of text), :class:`Group` (collapsible blocks,
found by the page's filter box), :class:`Choice` (one of several blocks at a time, picked in
a drop-down) and :class:`Card` (one run's summary with a status badge; :class:`Cards` side by side). :func:`to_html` turns them into escaped markup; the specs and datasets go into the
page's JSON. Chart specs are plain Vega-Lite, so the same spec can be installed as a W&B custom
chart.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tensorlens.reports.page import esc

#: Colours of the runs, in order (Tableau 10, Vega-Lite's default scheme), the same in every chart.
RUN_COLORS = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6", "#9d755d", "#bab0ac")


@dataclasses.dataclass
class Chart:
    """A Vega-Lite ``spec`` whose ``data`` names (``{"data": {"name": "values"}}``) are keys of
    ``datasets`` (made with :func:`~tensorlens.reports.page.table`, ``grid`` or ``matrix``).
    ``eager`` charts are drawn at once; the others when they scroll into view."""

    spec: dict[str, Any]
    datasets: dict[str, dict[str, Any]]
    caption: str = ""
    eager: bool = False


@dataclasses.dataclass
class Note:
    text: str


@dataclasses.dataclass
class Table:
    columns: Sequence[str]
    rows: Sequence[Sequence[Any]]


@dataclasses.dataclass
class Group:
    """Collapsible blocks under ``title``; the page's filter box matches ``title``."""

    title: str
    blocks: list[Block]
    open: bool = False
    kind: str = "item"  # "item": matched by the filter box; "collection": holds items, hidden when none matches


@dataclasses.dataclass
class Choice:
    """One of ``options`` (label, blocks) shown at a time, picked in a drop-down labelled ``label``."""

    label: str
    options: list[tuple[str, list[Block]]]


@dataclasses.dataclass
class Card:
    """One run's summary: a ``title`` with the run's ``color``, a ``status`` (``critical``,
    ``warning``, ``healthy``; drawn as a badge saying ``status_text``), labelled ``facts`` (label,
    text) and blocks below them."""

    title: str
    status: str
    status_text: str
    facts: list[tuple[str, str]]
    blocks: list[Block] = dataclasses.field(default_factory=list)
    color: str = ""


@dataclasses.dataclass
class Cards:
    """Cards side by side (as many as fit the page's width)."""

    cards: list[Card]


Block = Chart | Note | Table | Group | Choice | Card | Cards


@dataclasses.dataclass
class Section:
    """A titled part of a page, built by a section provider (see :mod:`tensorlens.reports.sections`)."""

    key: str
    title: str
    blocks: list[Block]
    intro: str = ""
    filter: bool = False  # a filter box over the section's groups


def to_html(sections: Sequence[Section], charts: dict[str, dict[str, Any]]) -> str:
    """Markup for ``sections``; every chart's spec and datasets are added to ``charts`` by id."""
    counter = itertools.count()
    out = []
    for section in sections:
        out.append(f'<section id="{esc(section.key)}" class="tl-section"><h2>{esc(section.title)}</h2>')
        if section.intro:
            out.append(f'<p class="tl-intro">{esc(section.intro)}</p>')
        if section.filter:
            out.append(
                '<div class="tl-filter"><input type="search" placeholder="filter by name (regular expression)" '
                'aria-label="filter by name"><span class="tl-filter-count"></span></div>'
            )
        out.extend(_block(block, charts, counter) for block in section.blocks)
        out.append("</section>")
    return "\n".join(out)


def _block(block: Block, charts: dict[str, dict[str, Any]], counter: itertools.count) -> str:
    if isinstance(block, Chart):
        chart_id = f"c{next(counter)}"
        charts[chart_id] = {"spec": block.spec, "data": block.datasets}
        caption = f'<div class="tl-caption">{esc(block.caption)}</div>' if block.caption else ""
        eager = ' data-eager="1"' if block.eager else ""
        return f'<figure class="tl-figure"><div class="tl-chart" data-chart="{chart_id}"{eager}></div>{caption}</figure>'
    if isinstance(block, Note):
        return f'<p class="tl-note">{esc(block.text)}</p>'
    if isinstance(block, Table):
        head = "".join(f"<th>{esc(c)}</th>" for c in block.columns)
        body = "".join("<tr>" + "".join(f"<td>{esc(_cell(v))}</td>" for v in row) + "</tr>" for row in block.rows)
        return f'<div class="tl-table-wrap"><table class="tl-table"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'
    if isinstance(block, Group):
        inner = "".join(_block(b, charts, counter) for b in block.blocks)
        opened = " open" if block.open else ""
        if block.kind == "collection":
            return f'<details class="tl-collection"{opened}><summary>{esc(block.title)}</summary>{inner}</details>'
        return (
            f'<details class="tl-group" data-name="{esc(block.title)}"{opened}><summary>{esc(block.title)}</summary>'
            f"{inner}</details>"
        )
    if isinstance(block, Choice):
        options = "".join(f'<option value="{i}">{esc(label)}</option>' for i, (label, _) in enumerate(block.options))
        panes = "".join(
            f'<div class="tl-choice-pane" data-option="{i}"{"" if i == 0 else " hidden"}>'
            + "".join(_block(b, charts, counter) for b in blocks) + "</div>"
            for i, (_, blocks) in enumerate(block.options)
        )
        return (
            f'<div class="tl-choice"><label>{esc(block.label)} <select>{options}</select></label>{panes}</div>'
        )
    if isinstance(block, Cards):
        return '<div class="tl-cards">' + "".join(_block(c, charts, counter) for c in block.cards) + "</div>"
    if isinstance(block, Card):
        swatch = f'<span class="tl-swatch" style="background:{esc(block.color)}"></span>' if block.color else ""
        facts = "".join(f"<dt>{esc(label)}</dt><dd>{esc(text)}</dd>" for label, text in block.facts)
        inner = "".join(_block(b, charts, counter) for b in block.blocks)
        return (
            f'<div class="tl-card tl-status-{esc(block.status)}" data-status="{esc(block.status)}">'
            f'<div class="tl-card-head"><h3>{swatch}{esc(block.title)}</h3>'
            f'<span class="tl-badge">{esc(block.status_text)}</span></div>'
            f'<dl class="tl-facts">{facts}</dl>{inner}</div>'
        )
    raise TypeError(f"Expected a block (Chart, Note, Table, Group, Choice, Card, Cards), but got {block!r}")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# ---------------------------------------------------------------------------- Vega-Lite specs
#
# Names from a run (tensors, rules, runs, statistics) go into a spec where Vega-Lite keeps them
# as data (a scale's domain rather than a ``sort`` array, which it compiles into an expression
# string; the page shows U+2028 and U+2029, which end such a string, as escapes anyway), and never
# as a tooltip's title: vega-tooltip's own formatter reads a key ``image`` as a picture to load
# and ``title`` as a heading (the page formats tooltips itself too). Tooltip titles are fixed
# words; a statistic's name travels in a data column.


def step_scale() -> dict[str, Any]:
    """The x scale of steps: from the first step drawn to the last, not rounded out (a line ends
    where its run's last step is, as a heatmap above or below it does)."""
    return {"nice": False, "zero": False}


def step_axis() -> dict[str, Any]:
    """The x axis of steps: integer ticks only (``tickMinStep`` 1; a short run otherwise gets ticks
    at 0.5 that ``d`` prints as ``0 0 1 1``)."""
    return {"format": ",d", "tickCount": 8, "tickMinStep": 1}


def ordered_nominal(field: str, order: Sequence[str], axis: dict[str, Any]) -> dict[str, Any]:
    """A nominal axis in the given ``order``: as the scale's domain, which Vega keeps as data (a
    ``sort`` array would become an expression string; see above)."""
    return {"field": field, "type": "nominal", "title": None, "sort": None, "scale": {"domain": list(order)},
            "axis": axis}


def _color(runs: Sequence[str]) -> dict[str, Any]:
    return {
        "field": "run", "type": "nominal", "title": "run",
        "scale": {"domain": list(runs), "range": [RUN_COLORS[i % len(RUN_COLORS)] for i in range(len(runs))]},
        "legend": {"orient": "top", "labelLimit": 360},
    }


def line_spec(title: str, y_title: str, runs: Sequence[str], log: bool = False, dash: str | None = None,
              color_field: str | None = None, modes: Sequence[str] = ()) -> dict[str, Any]:
    """Lines of ``value`` over ``step`` from the dataset ``values`` (columns ``run``, ``step``,
    ``value`` and ``dash`` / ``color_field`` when given), coloured by run. With ``dash`` (the
    ``mode`` column, whose values are ``modes``), train is solid, other modes dashed and dotted."""
    color = _color(runs) if color_field is None else {
        "field": color_field, "type": "nominal", "legend": {"orient": "top", "labelLimit": 360}}
    if color_field is None and len(runs) == 1:
        color["legend"] = None  # one run: its name is in the page header
    encoding: dict[str, Any] = {
        "x": {"field": "step", "type": "quantitative", "title": "step", "axis": step_axis(), "scale": step_scale()},
        "y": {"field": "value", "type": "quantitative", "title": y_title,
              "scale": {"type": "log"} if log else {"zero": False}},
        "color": color,
        "tooltip": [
            {"field": "run", "type": "nominal"},
            {"field": "step", "type": "quantitative"},
            {"field": "value", "type": "quantitative", "format": ".5~g"},
        ],
    }
    line = {"type": "line", "interpolate": "linear", "strokeWidth": 1.5, "point": False, "clip": True}
    spec: dict[str, Any] = {"mark": line}
    if dash:
        patterns = {"train": [1, 0], "eval": [6, 3], "predict": [2, 2], "global": [8, 2, 2, 2]}
        shown = [m for m in patterns if m in modes] or list(patterns)
        stroke_dash = {"field": dash, "type": "nominal", "legend": {"orient": "top"}, "scale": {
            "domain": shown, "range": [patterns[m] for m in shown]}}
        encoding["tooltip"].append({"field": dash, "type": "nominal"})
        # other modes are often saved at a few steps only: points show them even where no line can
        points = {"mark": {"type": "point", "filled": True, "size": 30, "clip": True},
                  "transform": [{"filter": f"datum.{dash} !== 'train'"}]}
        spec = {"layer": [{"mark": line, "encoding": {"strokeDash": stroke_dash}}, points]}
    return {
        "$schema": "https://vega.github.io/schema/vega-lite/v6.json",
        "title": {"text": title, "anchor": "start", "limit": 900},
        "data": {"name": "values"},
        "width": "container",
        "height": 220,
        **spec,
        "encoding": encoding,
    }


def layer_heatmap_spec(title: str, stat: str, rows: int, log: bool,
                       domain: tuple[float, float] | None = None, nonfinite: bool = False) -> dict[str, Any]:
    """Tensors (rows, in model order) x steps, coloured by ``value``, from the ``matrix`` dataset
    ``values`` (made with ``stat=`` the statistic's name, shown in the tooltip). ``domain`` fixes
    the colour scale (the same for every run's heatmap of one statistic, so one colour is one
    value across runs). With ``nonfinite``, cells whose value was NaN or Inf are drawn red (a layer
    of its own, left out when no cell needs it: an empty layer has no extent, which Vega warns about)."""
    scale: dict[str, Any] = {"type": "log" if log else "linear", "scheme": "viridis"}
    if domain is not None:
        scale["domain"] = [domain[0], domain[1]]
        scale["clamp"] = True
    tooltip = [
        {"field": "tensor", "type": "nominal"},
        {"field": "step", "type": "quantitative"},
        {"field": "stat", "type": "nominal", "title": "statistic"},
        {"field": "value", "type": "quantitative", "format": ".5~g"},
    ]
    return {
        "$schema": "https://vega.github.io/schema/vega-lite/v6.json",
        "title": {"text": title, "anchor": "start", "limit": 900},
        "data": {"name": "values"},
        "width": "container",
        "height": max(120, min(14 * rows, 1400)),
        "encoding": {
            "x": {"field": "step_start", "type": "quantitative", "title": "step", "axis": step_axis(),
                  "scale": step_scale()},
            "x2": {"field": "step_end"},
            "y": {"field": "tensor", "type": "ordinal", "title": None, "sort": None,
                  "axis": {"labelLimit": 320, "labelFontSize": 10}},
        },
        "layer": [
            {"transform": [{"filter": "datum.value !== null"}], "mark": {"type": "rect"}, "encoding": {
                "color": {"field": "value", "type": "quantitative", "title": stat, "scale": scale,
                          "legend": {"orient": "right", "format": ".2~g"}},
                "tooltip": tooltip}},
        ] + ([
            {"transform": [{"filter": "datum.nonfinite"}], "mark": {"type": "rect", "color": NONFINITE_COLOR},
             "encoding": {"tooltip": [*tooltip[:3], {"field": "nonfinite", "type": "nominal", "title": "value"}]}},
        ] if nonfinite else []),
    }


#: The colour of a heatmap cell whose value was NaN or Inf (outside viridis).
NONFINITE_COLOR = "#e4002b"


def histogram_heatmap_spec(title: str, axis: str, linthresh: float | None, height: int = 200) -> dict[str, Any]:
    """A histogram over time from the ``grid`` dataset ``values``: one column per kept step, cells
    coloured by log10 of the fraction of the step's values in them (empty cells left blank)."""
    y_scale: dict[str, Any] = {"zero": False, "nice": False}
    if axis == "symlog" and linthresh:
        y_scale = {"type": "symlog", "constant": linthresh, "zero": False, "nice": False}
    return {
        "$schema": "https://vega.github.io/schema/vega-lite/v6.json",
        "title": {"text": title, "anchor": "start", "limit": 900, "fontSize": 12},
        "data": {"name": "values"},
        "width": "container",
        "height": height,
        "mark": {"type": "rect", "clip": True},
        "encoding": {
            "x": {"field": "step_start", "type": "quantitative", "title": "step", "axis": step_axis(),
                  "scale": step_scale()},
            "x2": {"field": "step_end"},
            "y": {"field": "low", "type": "quantitative", "title": "value", "scale": y_scale, "axis": {"format": ".3~g"}},
            "y2": {"field": "high"},
            "color": {"field": "log_fraction", "type": "quantitative", "title": "log10 fraction",
                      "scale": {"scheme": "viridis", "domain": [-4, 0]}, "legend": {"orient": "right"}},

            "tooltip": [
                {"field": "step", "type": "quantitative"},
                {"field": "low", "type": "quantitative", "format": ".4~g", "title": "from"},
                {"field": "high", "type": "quantitative", "format": ".4~g", "title": "to"},
                {"field": "log_fraction", "type": "quantitative", "format": ".2f", "title": "log10 fraction"},
            ],
        },
    }
