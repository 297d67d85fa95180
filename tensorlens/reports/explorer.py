"""The module explorer: the model's module tree, each module with its tensors' statistics and
histograms, in one self-contained HTML file (``tensorlens explore RUN -o explorer.html``).

The tree is HTML: nested lists whose names are text (the browser's find, copying and screen
readers reach them; a name is never cut, a long one wraps), each module's full name, type,
``extra_repr``, parameter shapes and tensors in its ``title`` (shown on hover). The page folds and
unfolds it, searches it by name and shows a module's charts when a name is clicked. No graphviz,
no server.

Where the tree comes from: the run's ``modules`` meta entry when the recorder stored one (a JSON
list of ``{"name", "type", "extra_repr", "parameters": {name: shape}, "call_order"}``, see
:func:`tensorlens.capture.modules.describe_modules`); otherwise the tensor names themselves: parameters
(``weights/encoder.0.weight``) belong to the module before their last dot, activations
(``activations/encoder.0``) to the module they name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tensorlens.reports.blocks import histogram_heatmap_spec, line_spec
from tensorlens.reports.data import LoadOptions, RunData, load_run
from tensorlens.reports.health import SEVERITIES, module_findings, rules_reader, run_health, severity
from tensorlens.reports.page import esc, grid, render, rounded, table
from tensorlens.reports.report import Page
from tensorlens.stats.views import heatmap_grid

#: Collections whose tensors are a parameter of a module: the module is the name before the last dot.
PARAMETER_KINDS = ("weights", "biases", "gradients", "updates", "dynamics", "optimizer_state")
#: Collections whose tensors are a module's output or input: the name is the module (plus a path into the output).
MODULE_KINDS = ("activations", "inputs", "activation_gradients")
#: Collections of per-module derived tensors (dynamics): ``input_gradients/<module>.<input>/sample_norm``.
DERIVED_MODULE_KINDS = ("input_gradients",)
#: Statistics shown first in a module's table, in this order.
STAT_ORDER = ("numel", "mean", "std", "min", "max", "l2", "l1", "linf", "abs_max", "nan_count", "inf_count", "zero_fraction")


def _split(tensor: str, modules: set[str]) -> tuple[str, str, str]:
    """``(kind, module, local name)`` of a tensor name such as ``gradients/enc.0.weight``."""
    kind, _, rest = tensor.partition("/")
    if "/" in rest and rest.split("/", 1)[0] in PARAMETER_KINDS + MODULE_KINDS:  # custom collection: attn/weights/x
        kind, rest = rest.split("/", 1)
    if not rest:
        return kind, "", tensor
    if kind in MODULE_KINDS or kind in DERIVED_MODULE_KINDS:
        # a statistic derived per module (activations/<module>/sample_norm) belongs to the module
        # before its "/", unless the whole name is a module's
        names = [rest] if "/" not in rest else [rest, rest.split("/", 1)[0]]
        if modules:
            candidates = [n.rsplit(".", k)[0] if k else n for n in names for k in range(n.count(".") + 1)]
            owner = next((c for c in candidates if c in modules), "")
        else:
            owner = names[-1]
        return kind, owner, tensor
    if kind in PARAMETER_KINDS:
        owner = rest.rsplit(".", 1)[0] if "." in rest else ""
        return kind, owner, tensor
    return kind, "", tensor  # losses, summaries, scalars, optimizer: the run's own


def build_tree(data: RunData) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """The nodes ``{id, parent, label, type, extra_repr, parameters, call_order}`` (the root's id
    is ``""``) and each node's tensors."""
    described = data.modules() or []
    known = {m["name"]: m for m in described}
    nodes: dict[str, dict[str, Any]] = {}

    def add(name: str) -> None:
        missing = []  # the name and its ancestors not yet in the tree (a loop: a name may have many dots)
        while name not in nodes and name not in missing:
            missing.append(name)
            if not name:
                break
            name = name.rsplit(".", 1)[0] if "." in name else ""
        for name in reversed(missing):  # parents first
            parent = (name.rsplit(".", 1)[0] if "." in name else "") if name else None
            info = known.get(name, {})
            nodes[name] = {
                "id": name, "parent": parent, "label": (name.rsplit(".", 1)[-1] if name else data.name),
                "type": str(info.get("type", "")), "extra_repr": str(info.get("extra_repr", "")),
                "parameters": {str(k): v for k, v in dict(info.get("parameters") or {}).items()},
                "call_order": info.get("call_order"),
            }

    add("")
    for m in described:
        add(m["name"])
    owned: dict[str, list[str]] = {}
    names = set(known)
    for tensor in data.tensors:
        _, owner, _ = _split(tensor, names)
        add(owner)
        owned.setdefault(owner, []).append(tensor)
    return list(nodes.values()), owned


def _tensor_payload(data: RunData, tensor: str, rows: int) -> dict[str, Any]:
    latest = data.latest
    stats: dict[str, float | None] = {}
    step = None
    if latest is not None:
        step = latest.step
        recorded = list(data.stats.get(tensor, {}))
        ordered = [s for s in STAT_ORDER if s in recorded] + [s for s in recorded if s not in STAT_ORDER]
        for stat in ordered:
            value = latest.scalar(tensor, stat)
            stats[stat] = None if value is None else rounded([value], 6)[0]
        plain = latest.scalar(tensor, "")
        if plain is not None:
            stats["value"] = rounded([plain], 6)[0]
    out: dict[str, Any] = {"step": step, "stats": stats, "shape": list(latest.shapes.get(tensor, ())) if latest else []}
    recorded = data.stats.get(tensor, {})
    series_stat = next((s for s in ("l2", "std", "mean", "max") if s in recorded), None)
    if series_stat is not None and data.column_records:
        values = data.column_matrix([tensor], series_stat)[0]
        out["series"] = {"stat": series_stat, "data": table(run=[data.name] * len(values), step=data.column_steps,
                                                            value=values)}
    elif any(t == tensor for (t, _) in data.plain):
        steps, values = data.plain.get((tensor, "train"), ([], []))
        out["series"] = {"stat": "value", "data": table(run=[data.name] * len(values), step=np.asarray(steps),
                                                        value=np.asarray(values, dtype=np.float64))}
    columns = [(r.step, r.histogram(tensor)) for r in data.histogram_records]
    columns = [(s, h) for s, h in columns if h is not None]
    if columns:
        grid_edges, image = heatmap_grid([h.counts for _, h in columns], [h.edges for _, h in columns], rows, axis="quantile")
        out["heatmap"] = grid([s for s, _ in columns], grid_edges, image)
        last_step, last = columns[-1]
        if len(last.counts) and np.all(np.isfinite(last.edges)):
            out["histogram"] = {"step": last_step, "data": table(
                low=np.asarray(last.edges[:-1], dtype=np.float64), high=np.asarray(last.edges[1:], dtype=np.float64),
                count=np.asarray(last.counts, dtype=np.int64))}
    return out


#: Findings listed per module in the explorer's detail pane at most (the first of each rule and tensor first).
MAX_MODULE_FINDINGS = 50


def health_marks(data: RunData, nodes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each module with findings (the run's health, :func:`~tensorlens.reports.health.run_health`):
    ``{status, count, rules: [[rule, severity, findings, first step]], findings: [[rule, step, tensor,
    message]]}``, by module id. A finding belongs to the module of its tensor (the root for a finding
    about the whole step, or a tensor of no module)."""
    health = run_health(data)
    ids = {n["id"] for n in nodes}
    names = {m["name"] for m in data.modules() or []}

    def owner(tensor: str) -> str:
        module = _split(tensor, names)[1]
        while module and module not in ids:
            module = module.rsplit(".", 1)[0] if "." in module else ""
        return module

    marks: dict[str, dict[str, Any]] = {}
    for module, found in module_findings(health, owner).items():
        by_rule: dict[str, list[Any]] = {}
        for f in found:
            by_rule.setdefault(f.rule, []).append(f)
        rules = sorted(([rule, severity(rule), len(fs), min(f.step for f in fs)] for rule, fs in by_rule.items()),
                       key=lambda r: (SEVERITIES.index(r[1]) if r[1] in SEVERITIES else 9, r[3], r[0]))
        firsts: dict[tuple[str, str | None], Any] = {}
        for f in sorted(found, key=lambda f: f.step):
            firsts.setdefault((f.rule, f.tensor), f)
        listed = sorted(firsts.values(), key=lambda f: (f.step, f.rule))[:MAX_MODULE_FINDINGS]
        marks[module] = {"status": rules[0][1], "count": len(found), "rules": rules,
                         "findings": [[f.rule, f.step, f.tensor or "", f.message] for f in listed]}
    return marks


def build_explorer(
    run: Any,
    load: LoadOptions | None = None,
    title: str | None = None,
    progress: Callable[[int], None] | None = None,
    rows: int = 32,
) -> Page:
    """The explorer page of one run (see :func:`explore`)."""
    data = load_run(run, load or LoadOptions(columns=120, histogram_columns=60), progress, reader=rules_reader)
    title = title or f"tensorlens explorer: {data.name}"
    nodes, owned = build_tree(data)
    tensors = {t: _tensor_payload(data, t, rows) for names in owned.values() for t in names}
    templates = {
        "series": line_spec("", "", [data.name]),
        "heatmap": histogram_heatmap_spec("", "quantile", None, height=160),
        "histogram": _bar_spec(),
    }
    for spec in templates.values():
        spec["height"] = 160
    templates["series"]["encoding"]["color"]["legend"] = None
    marks = health_marks(data, nodes)
    payload = {"page": "explorer", "charts": {}, "nodes": nodes, "owned": owned, "tensors": tensors,
               "templates": templates, "described": bool(data.modules()), "health": marks}
    if data.modules():
        source = "the recorded module list"
    elif data.meta.get("modules"):
        source = "tensor names (the recorded module list is damaged)"
    else:
        source = "tensor names (no module list recorded)"
    steps = f"{len(data.steps)} saved steps" + (f", latest {data.steps[-1]}" if data.steps else "")
    health = run_health(data)
    flagged = {s: sum(1 for m in marks.values() if m["status"] == s) for s in SEVERITIES}
    if marks:
        marked = " · ".join(f"{n} {s}" for s, n in flagged.items() if n)
        health_line = (f'<p class="tl-meta tl-health-line tl-status-{esc(health.status)}">modules with findings: '
                       f'{esc(marked)} ({len(health.findings)} findings of {len(health.rules)} rules evaluated on the '
                       'store; marked in the tree: \u2716 critical, \u25b2 warning)</p>')
    else:
        health_line = (f'<p class="tl-meta tl-health-line tl-status-healthy">no finding: {len(health.rules)} rules '
                       'evaluated on the store</p>')
    body = (
        f'<header class="tl-header"><h1>{esc(title)}</h1><p class="tl-meta">{esc(data.path)} · {esc(steps)} · '
        f'{len(nodes)} modules from {esc(source)}</p>{health_line}</header>'
        '<div class="tl-explorer"><div class="tl-tree-pane"><div class="tl-tree-tools">'
        '<input type="search" class="tl-search" placeholder="search modules" aria-label="search modules">'
        '<button type="button" data-action="expand">expand all</button>'
        '<button type="button" data-action="collapse">collapse all</button>'
        '<span class="tl-filter-count"></span></div>'
        '<div class="tl-tree" id="tl-tree" role="tree" aria-label="modules"></div></div>'
        '<div class="tl-detail" id="tl-detail"><p class="tl-note">Click a module name to see its statistics '
        'and histograms; click a triangle to fold or unfold it. Hover for shapes and extra_repr.</p></div></div>'
    )
    return Page(render("explorer", title, body, payload), title)


def _bar_spec() -> dict[str, Any]:
    return {
        "$schema": "https://vega.github.io/schema/vega-lite/v6.json",
        "title": {"text": "", "anchor": "start"},
        "data": {"name": "values"},
        "width": "container",
        "mark": {"type": "rect", "color": "#4c78a8"},
        "encoding": {
            "x": {"field": "low", "type": "quantitative", "title": "value", "scale": {"zero": False, "nice": False},
                  "axis": {"format": ".3~g"}},
            "x2": {"field": "high"},
            "y": {"field": "count", "type": "quantitative", "title": "count"},
            "tooltip": [{"field": "low", "format": ".4~g", "title": "from"}, {"field": "high", "format": ".4~g", "title": "to"},
                        {"field": "count", "type": "quantitative"}],
        },
    }


def explore(
    run: Any, path: str | os.PathLike[str] | None = "explorer.html", *, worker: str | None = None,
    title: str | None = None,
) -> Page:
    """Write the module explorer of a run and return it (shown inline in Jupyter); ``path=None``
    writes nothing.

    >>> page = tl.explore("tensorlens_runs/my-run", "explorer.html")     # doctest: +SKIP
    """
    page = build_explorer(run, LoadOptions(columns=120, histogram_columns=60, worker=worker), title=title)
    if path is not None:
        page.save(path)
    return page


__all__: Sequence[str] = ("build_explorer", "build_tree", "explore")
