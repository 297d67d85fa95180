"""What the MLflow backend uploads besides metrics: histograms as compact JSON artifacts, one file
per ``histogram_every`` saved steps, and at ``close()`` one image per collection and statistic
holding every layer (:class:`LayerHistory`, drawn by :class:`LayerPainter` with matplotlib, which
is imported only when an image is drawn: the ``[plot]`` extra).

MLflow has no chart of many series under one key, so a per-layer panel of the payload
(:class:`~tensorlens.backends.payload.LayerPanel`) becomes one image: a heatmap of the statistic
of every layer over the saved steps, beside its profile at the last step. Their number is bounded
by the collections and panel statistics, not by the tensors or the steps.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tensorlens.backends.base import RunInfo
from tensorlens.backends.keys import PRIMARY_WORKERS
from tensorlens.backends.payload import LayerPanel
from tensorlens.modes import ModeKeys
from tensorlens.records import HistogramEntry, StepRecord
from tensorlens.stats.views import StrideThinner

try:  # optional: a faster JSON encoder for the histogram artifacts (HistogramChunk.encode)
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

# close() draws the per-layer images for at most this long (the dispatcher waits for a backend's
# close() until its close timeout, 60 s by default); a dozen images take a few seconds
IMAGE_BUDGET_S = 30.0
# A layer image keeps at most this many saved steps (every other one is dropped when full).
MAX_IMAGE_STEPS = 256
# Statistics drawn on a linear colour scale (fractions); every other one (norms, ratios) on log10.
_LINEAR_STATS = frozenset({"dead_fraction", "active_rate_mean", "saturation_fraction", "zero_fraction"})


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

    def add(self, record: StepRecord, histograms: Sequence[HistogramEntry]) -> None:
        """``histograms``: those of ``record`` that the payload sends."""
        self.records.append({
            "step": record.step,
            "mode_step": record.mode_step,
            "wall_time": record.wall_time,
            "worker": record.worker,
            "histograms": {h.tensor: histogram_json(h) for h in histograms},
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

    def encode(self, run: RunInfo | None) -> bytes:
        """:meth:`document` as compact UTF-8 JSON. A chunk of a small GPT-2 holds ~250,000 numbers:
        the standard library's encoder spends ~40 ms on them in one call that holds the GIL (the
        training thread waits), ``orjson`` ~4 ms; it is used where installed (the ``[mlflow]``
        extra), with the same JSON values (shortest round-trip floats either way)."""
        document = self.document(run)
        if _orjson is not None:
            try:
                return _orjson.dumps(document)
            except (TypeError, OverflowError):  # (an integer beyond 64 bits): the standard encoder takes it
                pass
        return json.dumps(document, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _finite_or_none(value: float) -> float | None:
    # JSON has no NaN/Inf; None (null) marks a statistic that is not a finite number
    return value if math.isfinite(value) else None


def histogram_json(h: HistogramEntry) -> dict[str, Any]:
    # whole arrays at once: a Python call per bin cost ~6 ms per saved step of a GPT-2 on the
    # backend thread, which shares the GIL with training
    edges = np.asarray(h.edges, dtype=np.float64)
    finite = np.isfinite(edges)
    return {
        "counts": np.asarray(h.counts).astype(np.int64).tolist(),
        "edges": edges.tolist() if finite.all() else [e if ok else None for e, ok in zip(edges.tolist(), finite.tolist(), strict=True)],
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


class LayerHistory:
    """One panel (a collection's statistic of every layer) over the saved steps of one mode,
    thinned by :class:`~tensorlens.stats.views.StrideThinner` to :data:`MAX_IMAGE_STEPS` columns.

    Layers are kept in the order they first appear (the model's); a layer missing at a step is
    blank there."""

    def __init__(self, collection: str, stat: str) -> None:
        self.collection = collection
        self.stat = stat
        self.layers: dict[str, int] = {}
        self._kept = StrideThinner(MAX_IMAGE_STEPS)
        self._seen = 0

    def add(self, step: int, panel: LayerPanel) -> None:
        for layer in panel.layers:
            self.layers.setdefault(layer, len(self.layers))
        self._kept.add(self._seen, (step, panel.layers, np.asarray(panel.values, dtype=np.float64)))
        self._seen += 1

    def grid(self) -> tuple[list[int], np.ndarray]:
        """The kept steps and a ``[layers, steps]`` array of values (NaN where a layer is missing)."""
        columns = self._kept.values(latest=True)
        grid = np.full((len(self.layers), len(columns)), np.nan)
        for column, (_, layers, values) in enumerate(columns):
            grid[[self.layers[layer] for layer in layers], column] = values
        return [step for step, _, _ in columns], grid


class LayerImages:
    """The per-layer panels of a run, one :class:`LayerHistory` per mode, worker, collection and
    statistic, and their upload at ``close()``."""

    def __init__(self) -> None:
        self.histories: dict[tuple[ModeKeys, str | None, str, str], LayerHistory] = {}

    def __len__(self) -> int:
        return len(self.histories)

    def clear(self) -> None:
        self.histories.clear()

    def add(self, record: StepRecord, panels: Sequence[LayerPanel]) -> None:
        worker = record.worker if record.worker not in PRIMARY_WORKERS else None
        for panel in panels:
            where = (record.mode, worker, panel.collection, panel.stat)
            history = self.histories.get(where)
            if history is None:
                history = self.histories[where] = LayerHistory(panel.collection, panel.stat)
            # mode steps on the x axis: every eval step of one evaluation shares its global step
            history.add(record.mode_step, panel)

    def upload(
        self, client: Any, run_id: str, key_of: Callable[[str, str, ModeKeys, str | None], str], timestamp: int,
        probe: Callable[[], None],
    ) -> None:
        """Draw each image and ``log_image`` it under ``key_of(collection, stat, mode, worker)`` at
        its last mode step, for at most :data:`IMAGE_BUDGET_S` seconds (then one warning)."""
        try:
            painter = LayerPainter()
        except ImportError:
            return  # the images are a convenience; the metrics and histogram files hold the data
        deadline = time.monotonic() + IMAGE_BUDGET_S
        todo = sorted(self.histories.items(), key=lambda item: (str(item[0][0]), str(item[0][1]), item[0][2], item[0][3]))
        # one upload in flight while the next image is drawn: drawing holds the CPU, an upload waits
        # on the server (log_image writes the PNG and a thumbnail, two requests and a tag)
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tensorlens-mlflow-images") as uploads:
            sent: concurrent.futures.Future[Any] | None = None
            for done, ((mode, worker, collection, stat), history) in enumerate(todo):
                if time.monotonic() > deadline:
                    warnings.warn(
                        f"tensorlens: MLflowBackend drew {done} of {len(todo)} per-layer images in {IMAGE_BUDGET_S:.0f} s "
                        "and skipped the rest so that close() ends in time; the metrics hold the values",
                        stacklevel=3,
                    )
                    break
                steps, _ = history.grid()
                xlabel = "step" if mode == ModeKeys.TRAIN else f"{mode} step"
                image = painter.draw(history, f"{collection} {stat}, every layer ({mode})", xlabel)
                if sent is not None:
                    sent.result()  # the previous upload's error, if any, stops here
                probe()
                key = key_of(collection, stat, mode, worker)
                sent = uploads.submit(client.log_image, run_id, image, key=key, step=int(steps[-1]), timestamp=timestamp)
            if sent is not None:
                sent.result()


class LayerPainter:
    """Draws :class:`LayerHistory` images into one reused figure (no pyplot, no global state:
    safe off the main thread): the statistic of every layer over steps as a heatmap, and its
    profile at the last step, layers top to bottom in the model's order."""

    def __init__(self) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self._figure_type = Figure
        self._canvas_type = FigureCanvasAgg

    def draw(self, history: LayerHistory, title: str, xlabel: str) -> Any:
        """The image as a PIL image (drawn to memory: no PNG written and read back)."""
        steps, grid = history.grid()
        layers = list(history.layers)
        linear = history.stat in _LINEAR_STATS
        finite = np.isfinite(grid)
        shown = grid.copy()
        if not linear:  # norms and ratios span decades: log10 of the magnitude
            with np.errstate(divide="ignore", invalid="ignore"):
                shown = np.where(finite & (np.abs(grid) > 0), np.log10(np.abs(grid)), np.nan)
        height = min(2.0 + 0.12 * len(layers), 14.0)
        figure = self._figure_type(figsize=(11, height), dpi=90)
        self._canvas_type(figure)
        # fixed rectangles, no shared axes and few ticks: matplotlib spends its time on ticks and layout
        bottom, top = 0.5 / height, 1 - 0.35 / height
        heat = figure.add_axes((0.22, bottom, 0.5, top - bottom))
        bar = figure.add_axes((0.735, bottom, 0.012, top - bottom))
        profile = figure.add_axes((0.835, bottom, 0.145, top - bottom))  # right of the colour bar's label
        image = heat.imshow(
            np.ma.masked_invalid(shown), aspect="auto", interpolation="nearest", cmap="viridis",
            extent=(-0.5, len(steps) - 0.5, len(layers) - 0.5, -0.5),
        )
        figure.colorbar(image, cax=bar, label=history.stat if linear else f"log10 {history.stat}")
        ticks = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), 8)).round().astype(int))
        heat.set_xticks(ticks, [str(steps[i]) for i in ticks])
        heat.set_xlabel(xlabel)
        heat.set_title(title, fontsize=9)
        # at most 24 layer names, without the prefix all share ("transformer."): readable on deep
        # models, and text is most of what drawing costs
        label_every = max(1, -(-len(layers) // 24))
        shared = os.path.commonprefix(layers).rpartition(".")[0] if len(layers) > 1 else ""
        labels = [layer[len(shared) + 1 :] if shared else layer for layer in layers[::label_every]]
        heat.set_yticks(range(0, len(layers), label_every), labels, fontsize=7)
        if shared:
            heat.set_ylabel(f"{shared}.", fontsize=8)
        # the profile at the last step, on the heatmap's scale (a line: far cheaper to draw than bars)
        last = shown[:, -1]
        profile.plot(last, np.arange(len(layers)), marker="o", markersize=2.5, linewidth=1, color="#4c72b0")
        profile.set_ylim(len(layers) - 0.5, -0.5)
        profile.set_yticks([])
        profile.set_xlabel(history.stat if linear else f"log10 {history.stat}", fontsize=8)
        profile.grid(True, axis="x", linewidth=0.5, alpha=0.5)
        profile.set_title(f"step {steps[-1]}", fontsize=9)
        canvas = figure.canvas
        canvas.draw()
        from PIL import Image

        return Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba(), "raw", "RGBA", 0, 1).convert("RGB")
