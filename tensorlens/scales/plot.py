"""The log2 scale plot: per node, the forward and backward ``abs_max`` and ``mean_abs`` against
the ranges of low-precision formats.

matplotlib is optional (``pip install 'tensorlens[plot]'``) and imported when a plot is drawn;
the figure is built with ``matplotlib.figure.Figure`` directly, so no pyplot state or GUI backend
is involved (it works in a training process and on a headless machine).
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from tensorlens._checks import expected

_INSTALL_HINT = "tl.plot_scales needs matplotlib: pip install 'tensorlens[plot]'"

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}
for _name, _attr in (("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2"), ("fp8_e4m3fnuz", "float8_e4m3fnuz"),
                     ("fp8_e5m2fnuz", "float8_e5m2fnuz")):
    if hasattr(torch, _attr):  # float8 dtypes exist from torch 2.1
        _DTYPES[_name] = _DTYPES[_attr] = _DTYPES[_name.removeprefix("fp8_")] = getattr(torch, _attr)

# one color per format, apart from the data's blues (from the colorblind-safe Okabe-Ito palette)
_FORMAT_COLORS = ["#E69F00", "#009E73", "#CC79A7", "#7B3294", "#D55E00", "#666666"]
_LINESTYLES = {"max": "-", "min_normal": "--", "min_subnormal": ":"}
_MARKERS: dict[tuple[str, str], dict[str, Any]] = {
    ("abs_max", "tensor"): {"marker": "^", "color": "#0B3C8C", "markersize": 4.2},
    ("mean_abs", "tensor"): {"marker": "o", "color": "#4FA3E0", "markersize": 4.2},
    ("abs_max", "parameter"): {"marker": "s", "color": "#0B3C8C", "markersize": 4.2},
    ("mean_abs", "parameter"): {"marker": "D", "color": "#4FA3E0", "markersize": 4.2},
    ("zero", ""): {"marker": "x", "color": "#555555", "markersize": 4.5},
    ("bad", ""): {"marker": "X", "color": "#C00000", "markersize": 5},
}
_LINE_LABELS = {"max": "largest finite", "min_normal": "smallest normal", "min_subnormal": "smallest subnormal"}


@dataclass(frozen=True)
class FormatRange:
    """The representable range of one number format (values from ``torch.finfo``)."""

    name: str
    max: float
    min_normal: float
    min_subnormal: float

    @staticmethod
    def of(spec: str | torch.dtype) -> FormatRange:
        """``FormatRange.of("fp8_e4m3")`` -> largest 448, smallest normal 2**-6, smallest subnormal 2**-9."""
        if isinstance(spec, torch.dtype):
            dtype, name = spec, str(spec).removeprefix("torch.")
        elif isinstance(spec, str) and spec.lower() in _DTYPES:
            dtype, name = _DTYPES[spec.lower()], spec
        else:
            raise expected("formats", f"format names among {sorted(_DTYPES)} or floating-point torch dtypes", spec)
        if not dtype.is_floating_point:
            raise expected("formats", "floating-point formats", spec)
        info = torch.finfo(dtype)
        # the subnormal spacing is the smallest normal times the machine epsilon (2**-mantissa_bits)
        return FormatRange(name, float(info.max), float(info.smallest_normal), float(info.smallest_normal * info.eps))


def _matplotlib() -> Any:
    try:
        import matplotlib
        import matplotlib.ticker
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - exercised by blocking the import in a test
        raise ImportError(_INSTALL_HINT) from error
    return matplotlib, Figure


def _log2(value: float) -> float:
    if math.isnan(value) or math.isinf(value):
        return math.nan
    return -math.inf if value == 0 else math.log2(value)


def _rows(graph: fx.Graph) -> list[tuple[str, bool, list[float | None]]]:
    """``(name, is parameter, [fwd abs_max, fwd mean_abs, bwd abs_max, bwd mean_abs] in log2)`` per node;
    ``None`` where no gradient reached the node, ``-inf`` for zero, NaN for NaN or inf in the data."""
    rows = []
    for node in graph.nodes:
        metrics = node.meta.get("metrics")
        if node.op == "output" or metrics is None:
            continue
        values = [_log2(metrics.fwd.abs_max), _log2(metrics.fwd.mean_abs)]
        bwd = metrics.bwd
        values += [_log2(bwd.abs_max), _log2(bwd.mean_abs)] if bwd is not None else [None, None]
        rows.append((str(node.meta.get("clean_name", node.name)), bool(node.meta.get("requires_grad")), values))
    return rows


def plot_scales(
    graph: fx.Graph,
    formats: Sequence[str | torch.dtype] = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2"),
    path: str | os.PathLike[str] | None = None,
    title: str | None = None,
) -> Any:
    """Plot log2 of each node's ``abs_max`` and ``mean_abs``, forward (left) and backward (right),
    with vertical lines at each format's largest finite value, smallest normal and smallest
    subnormal. Returns the matplotlib ``Figure``; ``path=`` also saves it as PNG.

    >>> fig = plot_scales(tracked.scales_graph(), formats=("fp16", "fp8_e4m3"), path="scales.png")  # doctest: +SKIP
    """
    matplotlib, Figure = _matplotlib()
    from matplotlib.lines import Line2D  # after _matplotlib(): that raises the install hint

    if not isinstance(graph, fx.Graph):
        raise expected("graph", "a torch.fx.Graph from scales_graph()", graph)
    if isinstance(formats, (str, torch.dtype)):
        formats = (formats,)
    ranges = [FormatRange.of(f) for f in formats]
    rows = _rows(graph)
    if not rows:
        raise ValueError("The graph has no node with metrics: run a forward (and backward) of the tracked model first")

    finite = [v for _, _, values in rows for v in values if v is not None and math.isfinite(v)]
    low, high = (min(finite), max(finite)) if finite else (-16.0, 16.0)
    lines = [(i, key, math.log2(getattr(r, key))) for i, r in enumerate(ranges) for key in _LINESTYLES]
    # the axis covers the data and every format line within 24 octaves of it: bf16's 2**-133 would
    # squeeze the data into a sliver, so lines farther out are listed in a note instead
    near = [x for _, _, x in lines if low - 24 <= x <= high + 24]
    x_low = math.floor(min([low, *near])) - 2
    x_high = math.ceil(max([high, *near])) + 2
    zero_x, bad_x = x_low + 0.8, x_high - 0.8

    n = len(rows)
    label_chars = max([len(name) for name, _, _ in rows] + [len(r.name) for r in ranges])
    strip = 0.22 * len(ranges) + 0.2  # inches: the formats' ranges above the panels
    body = 0.16 * n + 0.4
    gap = 0.4 if n > 40 else 0.08  # inches between the strip and the panels (room for the top tick labels)
    height = 2.2 + strip + gap + body
    width = 11.0 + 0.065 * label_chars
    fig = Figure(figsize=(width, height), dpi=100)
    # gridspec spacing is a fraction of the mean axes height: converted from inches
    grid = fig.add_gridspec(2, 2, height_ratios=[strip, body], hspace=gap / ((strip + body) / 2), wspace=0.06)
    panels = []
    for column, (offset, side) in enumerate(((0, "forward: values"), (2, "backward: gradients"))):
        top_ax = fig.add_subplot(grid[0, column])
        ax = fig.add_subplot(grid[1, column], sharex=top_ax, sharey=panels[0][1] if panels else None)
        panels.append((top_ax, ax))
        _draw_format_strip(top_ax, ranges, column == 0)
        top_ax.set_title(side, fontsize=11, loc="left")
        for y in range(0, n, 2):
            ax.axhspan(y - 0.5, y + 0.5, color="#F2F2F2", zorder=0, linewidth=0)
        for i, fmt in enumerate(ranges):
            for key, style in _LINESTYLES.items():
                ax.axvline(math.log2(getattr(fmt, key)), color=_FORMAT_COLORS[i % len(_FORMAT_COLORS)],
                           linestyle=style, linewidth=1.1, zorder=1)
        # one artist per series, not per point: drawing stays fast at hundreds of nodes
        ranges_x: list[list[float]] = []
        points: dict[tuple[str, str], tuple[list[float], list[int]]] = {}
        for y, (_, is_param, values) in enumerate(rows):
            top, mean = values[offset], values[offset + 1]
            if top is None or mean is None:
                continue  # no gradient reached this node
            if math.isfinite(top) and math.isfinite(mean):
                ranges_x.append([mean, top, y])
            for value, key in ((top, "abs_max"), (mean, "mean_abs")):
                if math.isfinite(value):
                    series = (key, "parameter" if is_param else "tensor")
                elif value == -math.inf:
                    series, value = ("zero", ""), zero_x  # zero: at the left edge
                else:
                    series, value = ("bad", ""), bad_x  # NaN or inf in the data: at the right edge
                xs, ys = points.setdefault(series, ([], []))
                xs.append(value)
                ys.append(y)
        if ranges_x:
            ax.hlines([r[2] for r in ranges_x], [r[0] for r in ranges_x], [r[1] for r in ranges_x],
                      color="#9AA7B8", linewidth=1.0, zorder=2)
        for (key, kind), (xs, ys) in points.items():
            ax.plot(xs, ys, linestyle="none", zorder=3, **_MARKERS[(key, kind)])
        ax.set_xlim(x_low, x_high)
        ax.xaxis.set_major_locator(matplotlib.ticker.MultipleLocator(_tick_step(x_high - x_low)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"$2^{{{int(v)}}}$"))
        ax.tick_params(axis="x", labelsize=8, top=n > 40, labeltop=n > 40, bottom=True, labelbottom=True)
        ax.tick_params(axis="y", labelsize=7.5, length=0, labelleft=column == 0)
        ax.grid(axis="x", color="#DDDDDD", linewidth=0.6, zorder=0)
        ax.set_axisbelow(True)
        ax.spines["right"].set_visible(False)
        ax.set_xlabel("log2 of the value" if column == 0 else "log2 of the gradient", fontsize=9)
    main = panels[0][1]
    main.set_yticks(range(n))
    main.set_yticklabels([name for name, _, _ in rows])
    for label, (_, is_param, _) in zip(main.get_yticklabels(), rows, strict=True):
        if is_param:
            label.set_color("#6B4E16")
    main.set_ylim(n - 0.5, -0.5)

    labels = {("abs_max", "tensor"): "abs_max", ("mean_abs", "tensor"): "mean_abs",
              ("abs_max", "parameter"): "parameter abs_max", ("mean_abs", "parameter"): "parameter mean_abs",
              ("zero", ""): "zero", ("bad", ""): "NaN / inf"}
    handles = [Line2D([], [], linestyle="none", label=label, **_MARKERS[key]) for key, label in labels.items()]
    handles += [Line2D([], [], color="#444444", linestyle=style, label=_LINE_LABELS[key])
                for key, style in _LINESTYLES.items()]
    off_chart = [f"{ranges[i].name} {_LINE_LABELS[key]} $2^{{{x:.4g}}}$" for i, key, x in lines
                 if not x_low <= x <= x_high]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.4 / height), handletextpad=0.3, columnspacing=1.2)
    fig.suptitle(title or f"Scales of {n} tensors (log2)", fontsize=12, y=1 - 0.1 / height, fontweight="bold")
    if off_chart:
        fig.text(0.5, 0.12 / height, "off the chart: " + ", ".join(off_chart), ha="center", fontsize=8,
                 color="#444444")
    fig.subplots_adjust(left=(0.3 + 0.065 * label_chars) / width, right=1 - 0.25 / width, top=1 - 1.05 / height,
                        bottom=(0.95 if off_chart else 0.7) / height)
    if path is not None:
        fig.savefig(os.fspath(path), format="png", dpi=100)
    return fig


def _draw_format_strip(ax: Any, ranges: Sequence[FormatRange], labels: bool) -> None:
    """One bar per format: its normal range solid, its subnormal range light, named on the left."""
    for i, fmt in enumerate(ranges):
        color = _FORMAT_COLORS[i % len(_FORMAT_COLORS)]
        low, normal, high = (math.log2(v) for v in (fmt.min_subnormal, fmt.min_normal, fmt.max))
        ax.barh(i, high - normal, left=normal, height=0.55, color=color, alpha=0.85, linewidth=0)
        ax.barh(i, normal - low, left=low, height=0.55, color=color, alpha=0.3, linewidth=0)
    ax.set_yticks(range(len(ranges)))
    ax.set_yticklabels([r.name for r in ranges] if labels else [])
    for i, label in enumerate(ax.get_yticklabels()):
        label.set_color(_FORMAT_COLORS[i % len(_FORMAT_COLORS)])
        label.set_fontweight("bold")
    ax.set_ylim(len(ranges) - 0.5, -0.5)
    ax.tick_params(axis="y", labelsize=8.5, length=0)
    ax.tick_params(axis="x", bottom=False, labelbottom=False)
    for spine in ("top", "right", "bottom"):
        ax.spines[spine].set_visible(False)


def _tick_step(span: float) -> int:
    for step in (1, 2, 4, 8, 16, 32):
        if span / step <= 14:
            return step
    return 64


def render_scales_png(graph: fx.Graph, **kwargs: Any) -> bytes:
    """The plot of :func:`plot_scales` as PNG bytes (for a tracker image: ``wandb.Image``, ``mlflow.log_image``).

    >>> png = render_scales_png(capture.graph(), formats=("fp16", "fp8_e4m3"))   # doctest: +SKIP
    """
    fig = plot_scales(graph, **kwargs)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()
