"""The W&B custom charts of :class:`~tensorlens.integrations.wandb.WandbBackend`: one chart per
collection and statistic holding every layer, and the histogram-over-steps heatmaps.

A chart is a ``wandb.Table`` plus a Vega spec. The table keeps a bounded number of steps
(:class:`~tensorlens.stats.views.StrideThinner`) and is logged rarely (every ``table_every``
saved steps and at ``close()``): each logged table is an artifact, so never every step.

- ``<section>/per-layer/<stat>`` (``tensorlens-gradients/per-layer/l2``): the layer profile, the
  statistic of every layer by depth, one line per logged step (built-in preset ``wandb/line/v0``:
  works offline and with no chart installed).
- ``<section>/per-layer/<stat> heatmap`` (``layer_heatmaps=True``): the same table as a heatmap,
  steps across, layers down, colored by the value (the Vega-Lite spec ``wandb_layers_spec.json``).
- ``<section>/<tensor>/heatmap`` (``heatmap_tensors``): a tensor's histogram over steps
  (``wandb_heatmap_spec.json``).

Both specs are installed once per W&B entity with ``tensorlens wandb-install-chart --entity E``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

from tensorlens._checks import expected
from tensorlens.backends.optional import import_optional
from tensorlens.backends.payload import LayerPanel
from tensorlens.stats.views import StrideThinner

_HERE = os.path.dirname(os.path.abspath(__file__))
#: Name under which ``tensorlens wandb-install-chart`` installs the histogram heatmap spec.
HEATMAP_CHART_NAME = "tensorlens/histogram-heatmap"
#: The Vega-Lite spec of the histogram heatmap chart, shipped as package data.
HEATMAP_SPEC_PATH = os.path.join(_HERE, "wandb_heatmap_spec.json")
#: Name under which the per-layer heatmap spec is installed.
LAYERS_CHART_NAME = "tensorlens/layer-heatmap"
#: The Vega-Lite spec of the per-layer heatmap (steps across, layers down).
LAYERS_SPEC_PATH = os.path.join(_HERE, "wandb_layers_spec.json")
#: More lines than this make the profile chart unreadable; older ones are thinned evenly.
MAX_PROFILE_LINES = 24
#: Steps kept per heatmap table (steps x bins rows are re-logged every time).
MAX_HEATMAP_STEPS = 64
#: Columns of a per-layer table: one row per (logged step, layer).
PROFILE_COLUMNS = ("step", "depth", "tensor", "value")
#: Columns of a histogram heatmap table: one row per (logged step, bin); the spec's ``${field:...}`` names.
HEATMAP_COLUMNS = ("step", "low", "high", "count")


class ChartTables:
    """The snapshots behind a run's custom charts, and the chart values to log (``charts()``)."""

    def __init__(self, layer_heatmaps: bool) -> None:
        self.layer_heatmaps = layer_heatmaps
        self.layers_chart = LAYERS_CHART_NAME
        self.heatmap_chart = HEATMAP_CHART_NAME
        self._panels: dict[str, tuple[str, str, StrideThinner]] = {}  # key -> (collection, stat, steps)
        self._heatmaps: dict[str, tuple[str, StrideThinner]] = {}  # key -> (tensor, steps)

    def add_panel(self, key: str, index: int, step: int, panel: LayerPanel) -> None:
        kept = self._panels.setdefault(key, (panel.collection, panel.stat, StrideThinner(MAX_PROFILE_LINES)))[2]
        kept.add(index, (step, panel.layers, panel.values))

    def add_histogram(self, key: str, index: int, step: int, tensor: str, counts: np.ndarray, edges: np.ndarray) -> None:
        kept = self._heatmaps.setdefault(key, (tensor, StrideThinner(MAX_HEATMAP_STEPS)))[1]
        kept.add(index, (step, np.asarray(counts), np.asarray(edges)))

    def charts(self, wandb: Any) -> dict[str, Any]:
        """``{key: chart}`` for every chart, its table covering the steps kept so far."""
        charts: dict[str, Any] = {}
        for key, (collection, stat, kept) in self._panels.items():
            rows = [
                [step, depth, layer, value]
                for step, layers, values in kept.values()
                for depth, (layer, value) in enumerate(zip(layers, values.tolist(), strict=True))
            ]
            table = _table(wandb, PROFILE_COLUMNS, rows)
            charts[key] = wandb.plot.line(
                table, "depth", "value", stroke="step", title=f"{collection} {stat} by layer depth (one line per step)"
            )
            if self.layer_heatmaps:
                charts[f"{key} heatmap"] = wandb.plot_table(
                    self.layers_chart, table, {name: name for name in PROFILE_COLUMNS},
                    {"title": f"{collection} {stat} of every layer over steps"},
                )
        for key, (tensor, kept) in self._heatmaps.items():
            rows = [
                [step, float(edges[i]), float(edges[i + 1]), int(counts[i])]
                for step, counts, edges in kept.values()
                for i in range(len(counts))
            ]
            table = _table(wandb, HEATMAP_COLUMNS, rows)
            charts[key] = wandb.plot_table(
                self.heatmap_chart, table, {name: name for name in HEATMAP_COLUMNS}, {"title": f"{tensor}: histogram over steps"}
            )
        return charts


def _table(wandb: Any, columns: tuple[str, ...], rows: list[list[Any]]) -> Any:
    """A ``wandb.Table`` of ``rows``, whose columns all have one type each (int, int, str, float).

    ``wandb.Table(data=rows)`` infers and checks the type of every row through W&B's type system,
    about 0.3 ms a row here: a chart of 148 layers x 24 steps took over a second on the dispatcher
    thread (holding the GIL the training loop needs). The column types are taken from the first
    row and the rows are set as the table's ``data`` (a public attribute) at once."""
    table = wandb.Table(columns=list(columns), data=rows[:1], allow_mixed_types=True)
    table.data = [list(row) for row in rows]
    return table


# ---------------------------------------------------------------------- the chart specs


def heatmap_spec() -> dict[str, Any]:
    """The Vega-Lite spec of the histogram-over-steps heatmap (``wandb_heatmap_spec.json``)."""
    with open(HEATMAP_SPEC_PATH, encoding="utf-8") as f:
        return json.load(f)


def layers_spec() -> dict[str, Any]:
    """The Vega-Lite spec of the per-layer heatmap (``wandb_layers_spec.json``)."""
    with open(LAYERS_SPEC_PATH, encoding="utf-8") as f:
        return json.load(f)


#: name -> (display name, spec) of every chart ``tensorlens wandb-install-chart`` installs.
CHARTS = {
    HEATMAP_CHART_NAME: ("tensorlens: histogram over steps", heatmap_spec),
    LAYERS_CHART_NAME: ("tensorlens: every layer over steps", layers_spec),
}


def install_heatmap_chart(entity: str, name: str = HEATMAP_CHART_NAME, access: str = "private") -> str:
    """Install a tensorlens spec on the W&B server as a custom chart; returns its id. ``name``
    picks the spec (:data:`CHARTS`; any other name gets the histogram heatmap).

    >>> install_heatmap_chart("my-team")     # doctest: +SKIP
    'my-team/tensorlens/histogram-heatmap'
    """
    if not isinstance(entity, str) or not entity:
        raise expected("entity", "a W&B entity (user or team name)", entity)
    if access not in ("private", "public"):
        raise expected("access", "'private' or 'public'", access)
    wandb = import_optional("wandb", "wandb", "The W&B backend")
    display, spec = CHARTS.get(name, CHARTS[HEATMAP_CHART_NAME])
    return wandb.Api().create_custom_chart(
        entity=entity, name=name, display_name=display, spec_type="vega2", access=access, spec=spec(),
    )


def install_chart_command(
    entity: str | None, name: str = HEATMAP_CHART_NAME, access: str = "private", print_spec: bool = False
) -> int:
    """``tensorlens wandb-install-chart``: install the specs online, or say what to do offline.
    With the default ``name`` both charts are installed (the histogram and the per-layer heatmap);
    ``print_spec`` prints the spec ``name`` names."""
    names = list(CHARTS) if name == HEATMAP_CHART_NAME else [name]
    if print_spec:  # one spec, the one --name names (a JSON document on stdout)
        print(json.dumps(CHARTS.get(name, CHARTS[HEATMAP_CHART_NAME])[1](), indent=2))
        return 0
    if not entity:
        print("tensorlens wandb-install-chart: --entity is required (the W&B user or team that owns the chart)",
              file=sys.stderr)
        return 2
    offline = os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled")
    steps_offline = (
        "Offline there is no server to install it on. Runs logged offline keep their chart tables; to see\n"
        "them as heatmaps, run this command once where W&B is online (the chart is per entity, not per run),\n"
        f"or paste the spec (`tensorlens wandb-install-chart --print-spec`, files {HEATMAP_SPEC_PATH} and\n"
        f"{LAYERS_SPEC_PATH}) into the custom chart editor of the W&B UI and save it under the name above."
    )
    if offline:
        print(f"WANDB_MODE={os.environ.get('WANDB_MODE')}: the chart {entity}/{names[0]} was not installed.\n{steps_offline}")
        return 1
    installed = []
    for chart in names:
        try:
            installed.append(install_heatmap_chart(entity, chart, access))
        except Exception as err:
            print(f"Could not install the chart {entity}/{chart}: {type(err).__name__}: {err}\n{steps_offline}")
            return 1
    for chart_id in installed:
        print(f"Installed the custom chart {chart_id!r}.")
    print(f"Log into them with WandbBackend(heatmap_tensors=r'^gradients/', layer_heatmaps=True,\n"
          f"    heatmap_chart={installed[0]!r})")
    return 0
