"""What the MLflow backend uploads besides metrics: histograms as compact JSON artifacts, one file
per ``histogram_every`` saved steps, and at ``close()`` one heatmap image per tensor of its
histogram over time (drawn with matplotlib, imported only when a heatmap is drawn).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tensorlens.backends.base import RunInfo
from tensorlens.modes import ModeKeys
from tensorlens.records import HistogramEntry, StepRecord
from tensorlens.stats.views import StrideThinner, heatmap_grid

# Heatmaps keep at most this many columns per tensor (every other one is dropped when full).
_HEATMAP_COLUMNS = 256
_HEATMAP_ROWS = 100
_HEATMAP_LOG_FLOOR = -4.0  # colours span fractions 1e-4 .. 1; smaller ones are drawn at the floor


class HistogramChunk:
    """The histograms of up to ``histogram_every`` saved steps of one mode, as one JSON artifact."""

    def __init__(self, mode: ModeKeys) -> None:
        self.mode = mode
        self.records: list[dict[str, Any]] = []
        self.dirty = False

    @property
    def filename(self) -> str:
        # the first mode step names the file: fixed once the chunk begins, unique within a mode
        return f"histograms-{self.records[0]['mode_step']:09d}.json"

    def add(self, record: StepRecord) -> None:
        self.records.append({
            "step": record.step,
            "mode_step": record.mode_step,
            "wall_time": record.wall_time,
            "worker": record.worker,
            "histograms": {h.tensor: histogram_json(h) for h in record.histograms},
        })
        self.dirty = True

    def document(self, run: RunInfo | None) -> dict[str, Any]:
        return {
            "format": "tensorlens.histograms",
            "version": 1,
            "run_name": run.run_name if run else None,
            "mode": str(self.mode),
            "records": self.records,
        }


def _finite_or_none(value: float) -> float | None:
    # JSON has no NaN/Inf; None (null) marks a statistic that is not a finite number
    return value if math.isfinite(value) else None


def histogram_json(h: HistogramEntry) -> dict[str, Any]:
    return {
        "counts": [int(c) for c in h.counts],
        "edges": [_finite_or_none(float(e)) for e in h.edges],
        "min": _finite_or_none(float(h.min)),
        "max": _finite_or_none(float(h.max)),
        "count": int(h.count),
        "nan_count": int(h.nan_count),
        "inf_count": int(h.inf_count),
        "rejected": int(h.rejected),
        "underflow": int(h.underflow),
        "overflow": int(h.overflow),
        "sampled": bool(h.sampled),
    }


class HeatmapColumns:
    """One tensor's histograms over time, thinned by :class:`~tensorlens.stats.views.StrideThinner`:
    when ``2 * _HEATMAP_COLUMNS`` columns are reached, every other one is dropped."""

    def __init__(self) -> None:
        self._kept = StrideThinner(2 * _HEATMAP_COLUMNS - 1)
        self._seen = 0

    def add(self, step: int, histogram: HistogramEntry) -> None:
        self._kept.add(self._seen, (step, np.asarray(histogram.counts, dtype=np.float64), np.asarray(histogram.edges, dtype=np.float64)))
        self._seen += 1

    @property
    def steps(self) -> list[int]:
        return [step for step, _, _ in self._kept.values(latest=False)]

    @property
    def counts(self) -> list[np.ndarray]:
        return [counts for _, counts, _ in self._kept.values(latest=False)]

    @property
    def edges(self) -> list[np.ndarray]:
        return [edges for _, _, edges in self._kept.values(latest=False)]


class HeatmapPainter:
    """Draws heatmaps into one reused figure: axes, colorbar and layout are built once, which
    makes each image several times cheaper than a fresh figure (savefig is most of what is left)."""

    def __init__(self) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize
        from matplotlib.figure import Figure

        self.figure = Figure(figsize=(7, 3.6), dpi=100)
        FigureCanvasAgg(self.figure)  # an Agg canvas: no pyplot, no global state, safe off the main thread
        # fixed axes rectangles instead of tight_layout, which costs more than drawing the image
        self.axes = self.figure.add_axes((0.10, 0.14, 0.76, 0.76))
        colorbar_axes = self.figure.add_axes((0.88, 0.14, 0.025, 0.76))
        self.scale = ScalarMappable(norm=Normalize(_HEATMAP_LOG_FLOOR, 0.0), cmap="viridis")
        self.figure.colorbar(self.scale, cax=colorbar_axes, label="log10 fraction of values")
        self.mesh: Any = None

    def draw(self, columns: HeatmapColumns, title: str, xlabel: str, path: str) -> None:
        grid, image = heatmap_grid(columns.counts, columns.edges, _HEATMAP_ROWS, axis="range")
        low, high = float(grid[0]), float(grid[-1])
        steps = np.asarray(columns.steps, dtype=np.float64)
        # column boundaries halfway between saved steps, so uneven save intervals are drawn to scale
        if len(steps) > 1:
            middle = (steps[:-1] + steps[1:]) / 2
            x = np.concatenate([[2 * steps[0] - middle[0]], middle, [2 * steps[-1] - middle[-1]]])
        else:
            x = np.array([steps[0] - 0.5, steps[0] + 0.5])
        # empty cells stay blank; tiny fractions are drawn in the floor colour
        positive = image > 0
        shown = np.ma.array(np.maximum(np.log10(np.where(positive, image, 1.0)), _HEATMAP_LOG_FLOOR), mask=~positive)
        if self.mesh is not None:
            self.mesh.remove()
        self.mesh = self.axes.pcolormesh(x, grid, shown, norm=self.scale.norm, cmap=self.scale.cmap, shading="flat")
        self.axes.set_xlim(x[0], x[-1])
        self.axes.set_ylim(low, high)
        self.axes.set_title(title, fontsize=9)
        self.axes.set_xlabel(xlabel)
        self.axes.set_ylabel("value")
        self.figure.savefig(path)
