"""The log2 scale plot: what it draws, the format lines from torch.finfo, readability at 200 nodes."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import matplotlib.image
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from scale_models import TinyLM
from torch import nn

import tensorlens.scales as S
from tensorlens.scales.plot import FormatRange

FORMATS = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")


def _graph(layers: int = 1) -> torch.fx.Graph:
    torch.manual_seed(0)
    tracked = S.track_scales(TinyLM(layers))
    tracked(torch.randint(0, 50, (2, 5))).square().mean().backward()
    return S.prune_non_float_tensors(tracked.scales_graph())


def _vertical_lines(ax) -> set[float]:  # noqa: ANN001
    return {round(line.get_xdata()[0], 9) for line in ax.get_lines()
            if len(line.get_xdata()) == 2 and line.get_xdata()[0] == line.get_xdata()[1] and line.get_linestyle() != "None"
            and tuple(line.get_ydata()) == (0, 1)}


@pytest.mark.parametrize(
    ("name", "dtype", "largest", "normal", "subnormal"),
    [
        ("fp16", torch.float16, 65504.0, 2.0**-14, 2.0**-24),
        ("bf16", torch.bfloat16, (2 - 2**-7) * 2.0**127, 2.0**-126, 2.0**-133),
        ("fp8_e4m3", torch.float8_e4m3fn, 448.0, 2.0**-6, 2.0**-9),
        ("fp8_e5m2", torch.float8_e5m2, 57344.0, 2.0**-14, 2.0**-16),
    ],
)
def test_format_ranges_come_from_finfo(name: str, dtype: torch.dtype, largest: float, normal: float,
                                       subnormal: float) -> None:
    fmt = FormatRange.of(name)
    assert (fmt.max, fmt.min_normal, fmt.min_subnormal) == (largest, normal, subnormal)
    assert fmt.max == torch.finfo(dtype).max and fmt.min_normal == torch.finfo(dtype).smallest_normal
    assert torch.tensor(subnormal, dtype=torch.float64).to(dtype).item() == subnormal  # representable ...
    assert torch.tensor(subnormal / 2, dtype=torch.float64).to(dtype).item() in (0.0, subnormal)  # ... the smallest
    assert FormatRange.of(dtype).max == largest


def test_plot_draws_every_node_both_directions_and_the_format_lines(tmp_path) -> None:
    graph = _graph()
    path = tmp_path / "scales.png"
    fig = S.plot_scales(graph, formats=FORMATS, path=path)
    rows = [n for n in graph.nodes if "metrics" in n.meta]
    forward, backward = fig.axes[1], fig.axes[3]
    labels = [t.get_text() for t in forward.get_yticklabels()]
    assert labels == [n.meta["clean_name"] for n in rows]
    low, high = forward.get_xlim()
    lines = {FormatRange.of(f).name: FormatRange.of(f) for f in FORMATS}
    expected = {round(math.log2(getattr(fmt, key)), 9) for fmt in lines.values()
                for key in ("max", "min_normal", "min_subnormal")}
    inside = {x for x in expected if low <= x <= high}
    assert _vertical_lines(forward) >= inside and _vertical_lines(backward) >= inside
    assert inside >= {round(math.log2(65504.0), 9), -14.0, -24.0, -9.0, -6.0, round(math.log2(448.0), 9), -16.0}
    note = " ".join(t.get_text() for t in fig.texts)
    assert "bf16 largest finite" in note and "bf16 smallest subnormal $2^{-133}$" in note  # off the chart, listed
    # each node's forward and backward markers at log2(abs_max) and log2(mean_abs)
    for ax, direction in ((forward, "fwd"), (backward, "bwd")):
        points = {(round(float(x), 9), int(y)) for line in ax.get_lines() if line.get_marker() not in ("None", None, "")
                  for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True)}
        for y, node in enumerate(rows):
            data = getattr(node.meta["metrics"], direction)
            for value in (data.abs_max, data.mean_abs):
                if value > 0:
                    assert (round(math.log2(value), 9), y) in points, (node.meta["clean_name"], direction)
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 800 and image.shape[1] > 1000 and image[..., :3].std() > 0.05


def test_two_hundred_nodes_have_readable_labels() -> None:
    graph = _graph(layers=6)
    assert sum(1 for n in graph.nodes if "metrics" in n.meta) >= 200
    fig = S.plot_scales(graph)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    labels = fig.axes[1].get_yticklabels()
    assert len(labels) >= 200 and all(label.get_fontsize() >= 7 for label in labels)
    boxes = sorted((b.y0, b.y1) for b in (label.get_window_extent(renderer) for label in labels))
    assert all(upper[0] >= lower[1] - 0.5 for lower, upper in zip(boxes, boxes[1:], strict=False)), "labels overlap"
    figure_box = fig.bbox
    assert all(b.x0 >= 0 for b in (label.get_window_extent(renderer) for label in labels))  # not cut off
    assert figure_box.height / len(labels) >= 15  # at least 15 pixels per row at the default 100 dpi


def test_zero_nan_and_missing_backward_are_drawn() -> None:
    class Net(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x * 0.0, x.log()])  # zeros, and NaN from log of negatives

    tracked = S.track_scales(Net())
    with torch.no_grad():
        tracked(torch.tensor([-1.0, 2.0]))
    fig = S.plot_scales(tracked.scales_graph(), formats=["fp16"])
    markers = {line.get_marker() for line in fig.axes[1].get_lines()}
    assert {"x", "X"} <= markers  # zero at the left edge, NaN / inf at the right


def test_png_bytes_bad_formats_and_empty_graphs() -> None:
    graph = _graph()
    png = S.render_scales_png(graph, formats=("fp8_e4m3", torch.float16), title="step 3")
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    with pytest.raises(ValueError, match="Expected `formats` to be format names"):
        S.plot_scales(graph, formats=("fp7",))
    with pytest.raises(ValueError, match="Expected `formats` to be floating-point formats"):
        S.plot_scales(graph, formats=(torch.int8,))
    with pytest.raises(ValueError, match="no node with metrics"):
        S.plot_scales(torch.fx.Graph())


def test_core_import_stays_light_and_matplotlib_missing_gives_the_hint() -> None:
    script = textwrap.dedent(
        """
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "matplotlib":
                    raise ImportError("blocked for the test")
        sys.meta_path.insert(0, Block())
        import torch
        import tensorlens as tl
        assert "torch._dynamo" not in sys.modules and "matplotlib" not in sys.modules
        tracked = tl.track_scales(torch.nn.Linear(2, 2))
        tracked(torch.ones(1, 2)).sum().backward()
        try:
            tl.plot_scales(tracked.scales_graph())
        except ImportError as error:
            print("hint:", error)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'tensorlens[plot]'" in proc.stdout
