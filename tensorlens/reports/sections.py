"""The sections of the report, each made by a *section provider*: a function that looks at the
runs and returns a :class:`~tensorlens.reports.blocks.Section`, or ``None`` when it has nothing to
show (a rules section for runs without findings, say).

Adding a section (the rule findings and per-op scales sections are providers like any other)::

    from tensorlens.reports.sections import register_section
    from tensorlens.reports.blocks import Section, Table

    def findings(runs, options):
        rows = [(r.name, f.rule, f.step, f.message) for r in runs for f in my_findings(r.run)]
        return Section("findings", "Rule findings", [Table(["run", "rule", "step", "message"], rows)]) if rows else None

    register_section("my-findings", findings, order=16)

``runs`` are :class:`~tensorlens.reports.data.RunData` (each has the open ``Run`` as ``.run`` for
anything not already loaded); ``options`` is the report's :class:`ReportOptions`. Providers run
in ``order`` (built-ins: health 5, differences 8, overview 10, findings 15, layers 20, nonfinite 30,
scales 35, distributions 40).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tensorlens.reports.blocks import (
    Chart,
    Choice,
    Group,
    Note,
    Section,
    Table,
    histogram_heatmap_spec,
    layer_heatmap_spec,
    line_spec,
    ordered_nominal,
    step_axis,
    step_scale,
)
from tensorlens.reports.data import RunData
from tensorlens.reports.health import run_health
from tensorlens.reports.page import grid, matrix, table
from tensorlens.reports.summary import differences, health
from tensorlens.stats.views import decimate_minmax, heatmap_grid


@dataclasses.dataclass(frozen=True)
class ReportOptions:
    """What the built-in sections draw.

    ``stat``: the statistic of the layer x step heatmap shown first (any recorded one).
    ``max_points``: points per line before min/max thinning (:func:`~tensorlens.stats.views.decimate_minmax`).
    ``histogram_axis``: ``"quantile"`` (0.5 %..99.5 % over the run), ``"symlog"`` or ``"range"``
    (see :func:`~tensorlens.stats.views.heatmap_grid`). ``histogram_rows``: cells per column.
    ``open_histograms``: how many histogram groups start open.
    """

    stat: str = "l2"
    max_points: int = 2000
    histogram_axis: str = "quantile"
    histogram_rows: int = 40
    open_histograms: int = 2
    max_scalar_charts: int = 12


Provider = Callable[[Sequence[RunData], ReportOptions], "Section | None"]
_PROVIDERS: dict[str, tuple[int, Provider]] = {}


def register_section(key: str, provider: Provider, order: int = 100) -> None:
    """Add (or replace) the section ``key``, made by ``provider(runs, options)``, at ``order``."""
    if not callable(provider):
        raise ValueError(f"Expected `provider` to be a callable (runs, options) -> Section | None, but got {provider!r}")
    _PROVIDERS[key] = (order, provider)


def registered_sections() -> list[tuple[str, Provider]]:
    return [(key, provider) for key, (_, provider) in sorted(_PROVIDERS.items(), key=lambda kv: kv[1][0])]


def build_sections(runs: Sequence[RunData], options: ReportOptions) -> list[Section]:
    out = []
    for _, provider in registered_sections():
        section = provider(runs, options)
        if section is not None:
            out.append(section)
    return out


# ---------------------------------------------------------------------------- helpers


def _line_table(runs: Sequence[RunData], series: Sequence[tuple[str, np.ndarray, np.ndarray, dict[str, str]]],
                max_points: int) -> tuple[dict[str, Any], bool]:
    """Columns ``run, step, value`` (+ extra) for thinned series; and whether a log axis suits them."""
    cols: dict[str, list[Any]] = {"run": [], "step": [], "value": []}
    extra_keys = sorted({k for *_, extra in series for k in extra})
    for k in extra_keys:
        cols[k] = []
    finite_values = []
    for run_name, steps, values, extra in series:
        steps, values = decimate_minmax(steps, values, max_points)
        cols["run"] += [run_name] * len(steps)
        cols["step"] += steps.tolist()
        cols["value"] += values.tolist()
        for k in extra_keys:
            cols[k] += [extra.get(k, "")] * len(steps)
        finite_values.append(values[np.isfinite(values)])
    found = np.concatenate(finite_values) if finite_values else np.zeros(0)
    log = bool(found.size and np.all(found > 0) and found.max() / found.min() > 50)
    return table(**{k: (np.asarray(v, dtype=np.float64) if k == "value" else v) for k, v in cols.items()}), log


# ---------------------------------------------------------------------------- overview


def overview(runs: Sequence[RunData], options: ReportOptions) -> Section | None:
    names = [r.name for r in runs]
    blocks: list[Any] = []
    norm = [(r.name, *r.grad_norm, {}) for r in runs if r.grad_norm_steps]
    if norm:
        data, log = _line_table(runs, norm, options.max_points)
        sources = sorted({r.grad_norm_source for r in runs if r.grad_norm_steps})
        blocks.append(Chart(line_spec("Global gradient norm", "gradient norm", names, log=log), {"values": data},
                            caption="from " + "; ".join(sources), eager=True))
    else:
        blocks.append(Note("No gradient statistics recorded (the gradients collection with l2), so no global gradient norm."))
    plain = sorted({t for r in runs for (t, _) in r.plain}, key=lambda t: (not t.startswith("losses/"), t))
    for tensor in plain[: options.max_scalar_charts]:
        series = [
            (r.name, np.asarray(s, dtype=np.int64), np.asarray(v, dtype=np.float64), {"mode": mode})
            for r in runs for (t, mode), (s, v) in sorted(r.plain.items()) if t == tensor
        ]
        data, log = _line_table(runs, series, options.max_points)
        modes = {extra["mode"] for *_, extra in series}
        blocks.append(Chart(line_spec(tensor, tensor.split("/", 1)[-1], names, log=log,
                                      dash="mode" if len(modes) > 1 else None, modes=sorted(modes)),
                            {"values": data}, eager=len(blocks) < 3))
    if len(plain) > options.max_scalar_charts:
        blocks.append(Note(f"{len(plain) - options.max_scalar_charts} more scalars not drawn: "
                           + ", ".join(plain[options.max_scalar_charts:])))
    if not plain:
        blocks.append(Note("No loss or other plain scalar recorded (tl.watch(model, loss_fn) or hook.register_loss records losses)."))
    intro = (f"Lines with more than {options.max_points} points are thinned: the steps are cut into "
             f"{options.max_points // 2} stretches and each keeps its smallest and largest value, so spikes stay "
             "visible; NaN and Inf are gaps. Eval and other modes are dashed, at the global step they were recorded at.")
    return Section("overview", "Gradient norm and losses", blocks, intro=intro)


# ---------------------------------------------------------------------------- layer x step


#: (collection, stat) choices of the layer heatmap, in the order offered, when recorded.
LAYER_CHOICES = (
    ("gradients", "l2"), ("weights", "l2"), ("activations", "l2"), ("dynamics", "update_ratio"),
    ("activations", "dead_fraction"), ("activations", "zero_fraction"), ("updates", "l2"), ("biases", "l2"),
    ("activation_gradients", "l2"), ("gradients", "std"), ("weights", "std"), ("activations", "std"),
)


#: Statistics that are fractions: their colour scale is always [0, 1] (10 % dead is dark, 100 % bright).
FRACTIONS = frozenset({"dead_fraction", "zero_fraction", "saturation_fraction", "active_rate_mean"})


def shared_scale(stat: str, matrices: Sequence[np.ndarray]) -> tuple[bool, tuple[float, float] | None]:
    """``(log, domain)`` of the colour scale of ``stat`` over every run's values: a fraction runs
    from 0 to 1; otherwise from the smallest to the largest finite value of all runs, on a log
    scale when all are positive and span more than a factor of 20. ``None`` when nothing is finite."""
    if stat in FRACTIONS:
        return False, (0.0, 1.0)
    finite = np.concatenate([m[np.isfinite(m)] for m in matrices]) if matrices else np.zeros(0)
    if not finite.size:
        return False, None
    low, high = float(finite.min()), float(finite.max())
    log = bool(low > 0 and high / low > 20)
    if high == low:  # one value: a scale of no width draws nothing
        pad = abs(low) * 0.5 or 0.5
        low, high = (low / 2, high * 2) if low > 0 else (low - pad, high + pad)
    return log, (low, high)


def _held_nonfinite(run: RunData, tensors: list[str]) -> np.ndarray:
    """Where a tensor held NaN or Inf values (its ``nan_count`` + ``inf_count`` > 0) at the kept
    steps: a statistic of such a tensor (a dead fraction of NaN activations) says nothing about it."""
    held = np.zeros((len(tensors), len(run.column_records)), dtype=bool)
    for stat in ("nan_count", "inf_count"):
        counts, _ = run.column_values(tensors, stat)
        held |= np.nan_to_num(counts, nan=0.0) > 0
    return held


def layers(runs: Sequence[RunData], options: ReportOptions) -> Section | None:
    available: dict[tuple[str, str], None] = {}
    wanted = [(c, options.stat) for c in ("gradients", "weights", "activations", "updates", "dynamics", "biases")]
    for collection, stat in [*wanted, *LAYER_CHOICES]:
        for r in runs:
            if any(t.split("/", 1)[0] == collection and stat in r.stats.get(t, ()) for t in r.tensors):
                available.setdefault((collection, stat))
    if not available:
        return None
    choices = []
    for collection, stat in available:
        blocks: list[Any] = []
        drawn = []
        for r in runs:
            tensors = [t for t in r.tensors if t.split("/", 1)[0] == collection and stat in r.stats.get(t, ())]
            if tensors and r.column_records:
                drawn.append((r, tensors, *r.column_values(tensors, stat)))
        log, domain = shared_scale(stat, [values for *_, values, _ in drawn])
        for r, tensors, values, present in drawn:
            title = f"{collection} {stat}" + (f" — {r.name}" if len(runs) > 1 else "")
            labels = [t.split("/", 1)[1] if "/" in t else t for t in tensors]
            nonfinite = present & (~np.isfinite(values) | _held_nonfinite(r, tensors))
            caption = f"red: the tensor held NaN or Inf ({int(nonfinite.sum())} cells)" if nonfinite.any() else ""
            blocks.append(Chart(layer_heatmap_spec(title, stat, len(tensors), log, domain, bool(nonfinite.any())),
                                {"values": matrix(labels, r.column_steps, values, nonfinite, stat=stat)},
                                caption=caption, eager=not choices))
        choices.append((f"{collection} · {stat}", blocks))
    columns = max(len(r.column_records) for r in runs)
    shared = " The colour scale of a statistic is the same for every run: one colour is one value." if len(runs) > 1 else ""
    intro = (f"One row per tensor in the order they were recorded, one column per kept step (at most {columns}, "
             "evenly spread over the run, the last step always). The colour scale is logarithmic when the values "
             f"are positive and span more than a factor of 20; fractions always run from 0 to 1.{shared} "
             "A red cell: the tensor held NaN or Inf at that step.")
    return Section("layers", "Layers over steps", [Choice("statistic", choices)], intro=intro)


# ---------------------------------------------------------------------------- distributions


def distributions(runs: Sequence[RunData], options: ReportOptions) -> Section | None:
    tensors: dict[str, None] = {}
    for r in runs:
        for record in r.histogram_records[-1:]:
            for tensor, _ in record.histogram_names:
                tensors.setdefault(tensor)
    if not tensors:
        return None
    by_collection: dict[str, list[str]] = {}
    for tensor in tensors:
        by_collection.setdefault(tensor.split("/", 1)[0], []).append(tensor)
    collections = sorted(by_collection, key=lambda c: (_COLLECTION_ORDER.get(c, 99), c))
    outer = []
    opened = 0
    for collection in collections:
        groups = []
        for tensor in by_collection[collection]:
            blocks = _histogram_blocks(runs, tensor, options)
            if blocks:
                groups.append(Group(tensor, blocks, open=opened < options.open_histograms))
                opened += 1
        if groups:
            outer.append(Group(f"{collection} ({len(groups)} tensors)", groups, open=not outer, kind="collection"))
    axis = {"quantile": "from the 0.5 % to the 99.5 % quantile over the whole run (rare outliers do not squash "
                        "the picture; the caption says how much falls outside)",
            "symlog": "symmetric-log, linear within about one bin width of zero",
            "range": "from the smallest to the largest value ever recorded"}[options.histogram_axis]
    intro = (f"Each tensor's histogram over the run: one column per kept step, {options.histogram_rows} cells per "
             f"column, coloured by the fraction of the step's values in the cell (log10, blank when empty). The value "
             f"axis is fixed for the whole run, {axis}.")
    return Section("distributions", "Distributions over steps", outer, intro=intro, filter=True)


def _histogram_blocks(runs: Sequence[RunData], tensor: str, options: ReportOptions) -> list[Any]:
    """One histogram heatmap per run holding ``tensor``, all on one value axis (worked out over
    every run's kept histograms together, so that runs compare at a glance)."""
    blocks: list[Any] = []
    per_run = []
    for r in runs:
        columns = [(rec.step, rec.histogram(tensor)) for rec in r.histogram_records]
        columns = [(s, h) for s, h in columns if h is not None]
        if columns:
            per_run.append((r, columns))
    if not per_run:
        return blocks
    every = [h for _, columns in per_run for _, h in columns]
    grid_edges, image = heatmap_grid([h.counts for h in every], [h.edges for h in every], options.histogram_rows,
                                     axis=options.histogram_axis)
    linthresh = None
    if options.histogram_axis == "symlog":
        widths = [float(h.edges[-1] - h.edges[0]) / max(len(h.counts), 1) for h in every]
        linthresh = float(np.median([w for w in widths if w > 0] or [1.0]))
    at = 0
    for r, columns in per_run:
        mine = image[:, at:at + len(columns)]
        at += len(columns)
        title = tensor if len(runs) == 1 else f"{tensor} — {r.name}"
        steps = [s for s, _ in columns]
        outside = float(np.mean(1.0 - mine.sum(axis=0))) if mine.size else 0.0
        caption = (f"{len(steps)} steps; {options.histogram_axis} axis"
                   + (" (shared by the runs)" if len(per_run) > 1 else "")
                   + (f"; {outside:.1%} of values fall outside the axis on average" if outside > 0.001 else ""))
        blocks.append(Chart(histogram_heatmap_spec(title, options.histogram_axis, linthresh),
                            {"values": grid(steps, grid_edges, mine)}, caption=caption))
    return blocks


_COLLECTION_ORDER = {"gradients": 0, "weights": 1, "biases": 2, "activations": 3, "updates": 4, "activation_gradients": 5}


# ---------------------------------------------------------------------------- NaN / Inf


def nonfinite(runs: Sequence[RunData], options: ReportOptions) -> Section | None:
    blocks: list[Any] = []
    rows = []
    for r in runs:
        series = [(r.name, np.asarray(s, dtype=np.int64), np.asarray(v, dtype=np.float64), {"collection": c})
                  for c, (s, v) in sorted(r.nonfinite.items())]
        total = sum(float(np.nansum(v)) for *_, v, _ in series)
        if not series:
            blocks.append(Note(f"{r.name}: no NaN/Inf counts recorded."))
            continue
        if total == 0:
            blocks.append(Note(f"{r.name}: no NaN or Inf value in any tensor in {len(r.steps)} saved steps."))
            continue
        data, _ = _line_table(runs, series, options.max_points)
        title = "NaN + Inf values per collection" + (f" — {r.name}" if len(runs) > 1 else "")
        spec = line_spec(title, "NaN + Inf count", [r.name], color_field="collection")
        spec["mark"]["point"] = {"filled": True, "size": 16}
        blocks.append(Chart(spec, {"values": data}, eager=True))
        for tensor, (first, last, most) in r.nonfinite_tensors.items():
            rows.append((r.name, tensor, first, last, int(most)))
    if rows:
        blocks.append(Table(["run", "tensor", "first step", "last step", "most in one step"], rows))
    return Section("nonfinite", "NaN and Inf", blocks,
                   intro="Counts of NaN and ±Inf values (they are counted, never binned or averaged away).")


# ---------------------------------------------------------------------------- rule findings


#: Findings listed in the table at most (the chart shows every one).
MAX_FINDING_ROWS = 500


def findings(runs: Sequence[RunData], options: ReportOptions) -> Section | None:
    cols: dict[str, list[Any]] = {"run": [], "step": [], "rule": [], "tensor": [], "message": []}
    rows = []
    for r in runs:
        for f in sorted(run_health(r).findings, key=lambda f: (f.step, f.rule)):
            cols["run"].append(r.name)
            cols["step"].append(f.step)
            cols["rule"].append(f.rule)
            cols["tensor"].append(f.tensor or "")
            cols["message"].append(f.message)
            rows.append((r.name, f.rule, f.step, str(f.mode), f.tensor or "-", f.message))
    if not rows:
        return None
    names = [r.name for r in runs]
    rules = sorted(set(cols["rule"]))
    spec = {
        "$schema": "https://vega.github.io/schema/vega-lite/v6.json",
        "title": {"text": "Rule findings over steps", "anchor": "start"},
        "data": {"name": "values"},
        "width": "container",
        "height": max(80, 26 * len(rules)),
        "mark": {"type": "tick", "thickness": 2, "clip": True},
        "encoding": {
            "x": {"field": "step", "type": "quantitative", "title": "step", "axis": step_axis(), "scale": step_scale()},
            "y": ordered_nominal("rule", rules, {"labelLimit": 260}),
            "color": line_spec("", "", names)["encoding"]["color"],
            "tooltip": [{"field": f, "type": "nominal" if f != "step" else "quantitative"}
                        for f in ("run", "rule", "step", "tensor", "message")],
        },
    }
    blocks: list[Any] = [Chart(spec, {"values": table(**cols)}, eager=True)]
    blocks.append(Table(["run", "rule", "step", "mode", "tensor", "message"], rows[:MAX_FINDING_ROWS]))
    if len(rows) > MAX_FINDING_ROWS:
        blocks.append(Note(f"{len(rows) - MAX_FINDING_ROWS} more findings not listed (all are in the chart; "
                           "`tensorlens rules RUN` prints them)."))
    return Section("findings", "Rule findings", blocks,
                   intro="What the default rules find on the store and what the rules stored while the run trained, "
                         "one tick per finding.")


# ---------------------------------------------------------------------------- per-op scales


#: Vertical lines of the scale plot: (format, log2 of the largest value, log2 of the smallest normal).
FORMAT_RANGES = (("float16", 15.9993, -14.0), ("float8_e4m3fn", 8.8074, -6.0), ("float8_e5m2", 15.8074, -14.0))


def scales(runs: Sequence[RunData], options: ReportOptions) -> Section | None:
    blocks: list[Any] = []
    for r in runs:
        record = next((rec for rec in reversed(r.column_records)
                       if any(t.startswith("scales/") for t, _ in rec.scalar_names)), None)
        if record is None:
            continue
        cols: dict[str, list[Any]] = {"node": [], "direction": [], "metric": [], "log2": []}
        nodes = [t for t in dict.fromkeys(t for t, _ in record.scalar_names) if t.startswith("scales/")]
        for tensor in nodes:
            _, direction, node = tensor.split("/", 2)
            for metric in ("abs_max", "mean_abs"):
                value = record.scalar(tensor, metric)
                if value is not None and value > 0 and np.isfinite(value):
                    cols["node"].append(node)
                    cols["direction"].append("forward" if direction == "fwd" else "backward")
                    cols["metric"].append(metric)
                    cols["log2"].append(float(np.log2(value)))
        if not cols["node"]:
            continue
        order = list(dict.fromkeys(cols["node"]))
        formats = table(format=[f for f, _, _ in FORMAT_RANGES for _ in (0, 1)],
                        log2=[v for _, high, low in FORMAT_RANGES for v in (high, low)])
        for direction in ("forward", "backward"):
            spec = {
                "$schema": "https://vega.github.io/schema/vega-lite/v6.json",
                "title": {"text": f"{direction} scales at step {record.step}" + (f" — {r.name}" if len(runs) > 1 else ""),
                          "anchor": "start"},
                "width": "container",
                "height": max(120, 16 * len(order)),
                "layer": [
                    {"data": {"name": "formats"}, "mark": {"type": "rule", "strokeDash": [4, 3], "opacity": 0.6},
                     "encoding": {"x": {"field": "log2", "type": "quantitative"},
                                  "color": {"field": "format", "type": "nominal", "title": "format range",
                                            "scale": {"scheme": "dark2"}}}},
                    {"data": {"name": "values"}, "transform": [{"filter": f"datum.direction === '{direction}'"}],
                     "mark": {"type": "point", "filled": True, "size": 40},
                     "encoding": {
                         "x": {"field": "log2", "type": "quantitative", "title": "log2 of the value"},
                         "y": ordered_nominal("node", order, {"labelLimit": 320, "labelFontSize": 10}),
                         "shape": {"field": "metric", "type": "nominal", "title": "metric"},
                         "tooltip": [{"field": "node"}, {"field": "metric"}, {"field": "log2", "format": ".2f"}]}},
                ],
                "resolve": {"scale": {"color": "independent"}},
            }
            blocks.append(Chart(spec, {"values": table(**cols), "formats": formats}))
    if not blocks:
        return None
    return Section("scales", "Per-op scales", blocks,
                   intro="log2 of each op's largest (abs_max) and mean absolute (mean_abs) value at the last step that "
                         "recorded scales, forward and backward, against the range of low-precision formats (dashed: "
                         "largest value and smallest normal).")


register_section("health", health, order=5)
register_section("differences", differences, order=8)
register_section("overview", overview, order=10)
register_section("findings", findings, order=15)
register_section("layers", layers, order=20)
register_section("nonfinite", nonfinite, order=30)
register_section("scales", scales, order=35)
register_section("distributions", distributions, order=40)
