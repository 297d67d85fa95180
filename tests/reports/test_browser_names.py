"""Names from a run that broke the pages in a real browser (headless Chromium over the DevTools
protocol): JavaScript object members as module names, ``image`` as a tooltip key, line and
paragraph separators, lone surrogates; the module tree as text; integer step ticks and heatmap
axes that end at the last step.

Every page must draw with no console error, no exception and no request beyond the file itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from tensorlens.reports import ReportOptions, build_explorer, build_report, register_section
from tensorlens.reports.blocks import Chart, Section
from tensorlens.reports.page import table
from tensorlens.reports.sections import _PROVIDERS

try:
    from .browser import BROWSER_TESTS, Browser, assert_clean
    from .report_runs import LONG_TYPE, PROTOTYPE_NAMES, SEPARATORS, write_run
except ImportError:
    from browser import BROWSER_TESTS, Browser, assert_clean
    from report_runs import LONG_TYPE, PROTOTYPE_NAMES, SEPARATORS, write_run

pytestmark = BROWSER_TESTS


def _load(browser: Browser, page_html: str, path: Path):
    path.write_text(page_html, encoding="utf-8")
    page = browser.open(path.resolve().as_uri())
    if '"page":"explorer"' in page_html:
        page.evaluate("window.tensorlens.explorer.ready")
    return page, path.resolve().as_uri()


def _draw_everything(page) -> list[str]:
    """Open every group, show every pane of every drop-down and draw every chart; their states."""
    page.evaluate("window.tensorlens.openAll()")
    page.evaluate("""document.querySelectorAll('.tl-choice-pane').forEach(p => { p.hidden = false; })""")
    page.evaluate("window.tensorlens.renderVisible()")
    return page.evaluate("[...document.querySelectorAll('.tl-chart')].map(c => c.getAttribute('data-rendered'))")


#: Every axis's tick labels in every chart drawn: {chart id: [[label, ...] per axis]}.
AXIS_LABELS = """(() => { const out = {};
  for (const [id, view] of Object.entries(window.tensorlens.views)) {
    const axes = [];
    (function walk(node) {
      if (!node) return;
      if (node.marktype === 'text' && node.role === 'axis-label') axes.push(node.items.map(i => i.text));
      (node.items || []).forEach(walk);
    })(view.scenegraph().root);
    out[id] = axes;
  }
  return out; })()"""


def _hover_middle(page, view_expression: str) -> str:
    """Move the mouse to the middle of a chart's plot area and return the tooltip's HTML once shown."""
    x, y = page.evaluate(f"""(() => {{ const v = {view_expression}, o = v.origin();
        v.container().scrollIntoView({{block: 'center'}});
        const b = v.container().querySelector('canvas').getBoundingClientRect();
        return [b.left + o[0] + v.width() / 2, b.top + o[1] + v.height() / 2]; }})()""")
    page.hover(x - 1, y - 1)
    page.hover(x, y)
    page.pump(0.5)
    return page.evaluate("""(() => { const t = document.getElementById('vg-tooltip-element');
        return t && t.classList.contains('visible') ? t.innerHTML : null; })()""")


# ---------------------------------------------------------------------------- case 1: object members


def test_object_member_names_render_the_whole_tree(browser: Browser, names_run: str, tmp_path: Path) -> None:
    page, url = _load(browser, build_explorer(names_run).html, tmp_path / "explorer.html")
    payload_ids = page.evaluate("window.tensorlens.payload.nodes.map(n => n.id)")
    for name in PROTOTYPE_NAMES:
        assert name in payload_ids and f"{name}.constructor" in payload_ids
    page.evaluate("document.querySelector('.tl-tree-tools [data-action=expand]').click()")
    assert sorted(r[0] for r in page.evaluate("window.tensorlens.explorer.rows()")) == sorted(payload_ids)
    # each shows its own tensors (and a module without any says so), not Object.prototype's members
    for name in PROTOTYPE_NAMES:
        page.evaluate(f"window.tensorlens.explorer.select({json.dumps(name)})")
        assert page.evaluate("document.querySelector('#tl-detail h2').textContent") == name
        headings = page.evaluate("[...document.querySelectorAll('#tl-detail h3')].map(h => h.textContent)")
        want = [f"weights/{name}.weight"] + ([f"gradients/{name}.weight"] if name == "__proto__" else [])
        assert sorted(headings) == sorted(want)
        page.evaluate(f"window.tensorlens.explorer.select({json.dumps(name + '.constructor')})")
        assert "No tensor of this module" in page.evaluate("document.getElementById('tl-detail').innerText")
    page.evaluate("window.tensorlens.explorer.select('')")  # the root owns `image`, `title` and the loss
    assert {"image", "title", "losses/loss"} <= set(
        page.evaluate("[...document.querySelectorAll('#tl-detail h3')].map(h => h.textContent)"))
    page.evaluate("window.tensorlens.explorer.charts")
    assert_clean(page, url)
    page.close()


# ---------------------------------------------------------------------------- case 2: tooltip keys


def test_a_tooltip_key_named_image_loads_nothing(browser: Browser, real_run: str, tmp_path: Path) -> None:
    """vega-tooltip's own formatter turns a key ``image`` into an <img> (a request) and ``title`` into a
    heading: every tooltip on the page is a table of escaped text instead, whatever its keys."""

    def probe(runs, options):
        data = table(x=[0.0], x2=[1.0], image=["picture.png"], title=["<b>heading</b>"])
        spec = {"$schema": "https://vega.github.io/schema/vega-lite/v6.json", "data": {"name": "values"},
                "width": 400, "height": 200, "mark": "rect",
                "encoding": {"x": {"field": "x", "type": "quantitative"}, "x2": {"field": "x2"},
                             "tooltip": [{"field": "image"}, {"field": "title"}]}}
        return Section("probe", "Probe", [Chart(spec, {"values": data}, eager=True)])

    register_section("tooltip-probe", probe, order=1)
    try:
        page_html = build_report(real_run).html
    finally:
        del _PROVIDERS["tooltip-probe"]
    page, url = _load(browser, page_html, tmp_path / "report.html")
    page.evaluate("window.tensorlens.renderVisible()")
    shown = _hover_middle(page, "window.tensorlens.views[document.querySelector('#probe .tl-chart').dataset.chart]")
    assert shown is not None, "no tooltip appeared"
    assert "<img" not in shown and "<h2" not in shown and "<b>" not in shown
    assert "picture.png" in shown and "&lt;b&gt;heading&lt;/b&gt;" in shown
    assert_clean(page, url)  # and no request for picture.png
    page.close()


def test_a_statistic_or_tensor_named_image_loads_nothing(browser: Browser, odd_scales_run: str, names_run: str,
                                                          tmp_path: Path) -> None:
    page, url = _load(browser, build_report(odd_scales_run, ReportOptions(stat="image")).html, tmp_path / "report.html")
    page.evaluate("window.tensorlens.renderVisible()")
    shown = _hover_middle(page, "window.tensorlens.views[document.querySelector('#layers .tl-chart').dataset.chart]")
    assert shown is not None and "<img" not in shown and ">image<" in shown  # the statistic, as a value
    assert_clean(page, url)
    page.close()
    page, url = _load(browser, build_explorer(names_run).html, tmp_path / "explorer.html")
    page.evaluate("window.tensorlens.explorer.select('image')")
    shown = _hover_middle(page, "Object.values(window.tensorlens.views).at(-1)")
    assert shown is None or "<img" not in shown
    assert_clean(page, url)
    page.close()


# ---------------------------------------------------------------------------- case 3: separators


def test_line_and_paragraph_separators_in_names_draw(browser: Browser, names_run: str, odd_scales_run: str,
                                                      tmp_path: Path) -> None:
    """U+2028 and U+2029 in rule, run, tensor, op and statistic names: every chart draws (Vega's
    expression parser stops at them, so no name may reach a Vega expression)."""
    for i, page_html in enumerate((build_report([names_run, odd_scales_run]).html,
                                   build_report(odd_scales_run, ReportOptions(stat=f"s{SEPARATORS}")).html)):
        page, url = _load(browser, page_html, tmp_path / f"report{i}.html")
        states = _draw_everything(page)
        assert states and set(states) == {"1"}, states
        text = page.evaluate("document.body.innerText")
        if i == 0:
            assert page.evaluate("document.querySelectorAll('#findings .tl-chart[data-rendered=\"1\"]').length") == 1
            assert page.evaluate("document.querySelectorAll('#scales .tl-chart[data-rendered=\"1\"]').length") == 2
            assert "Rule\\u2028\\u20291" in text  # shown as escapes (invisible, and the end of a Vega string)
        assert_clean(page, url)
        page.close()
    page, url = _load(browser, build_explorer(names_run).html, tmp_path / "explorer.html")
    shown = "odd\\u2028\\u2029name"  # the page's name for it
    assert shown in [r[1] for r in page.evaluate("window.tensorlens.explorer.rows()")]
    page.evaluate(f"window.tensorlens.explorer.select({json.dumps(shown)})")
    assert f"weights/{shown}.weight" in page.evaluate(
        "[...document.querySelectorAll('#tl-detail h3')].map(h => h.textContent)")
    assert "Sep\\u2028\\u2029Type" in page.evaluate("document.getElementById('tl-detail').innerText")
    assert_clean(page, url)
    page.close()


# ---------------------------------------------------------------------------- case 5: lone surrogates


def test_lone_surrogates_in_names_show_as_escapes(browser: Browser, surrogate_run: str, tmp_path: Path) -> None:
    for builder in (build_report, build_explorer):
        path = tmp_path / f"{builder.__name__}.html"
        builder(surrogate_run).save(path)
        page, url = _load(browser, path.read_text(encoding="utf-8"), path)
        if builder is build_explorer:
            page.evaluate(f"window.tensorlens.explorer.select({json.dumps('layer' + chr(92) + 'udc80')})")
            page.evaluate("window.tensorlens.explorer.charts")
        else:
            assert set(_draw_everything(page)) == {"1"}
        text = page.evaluate("document.body.innerText")
        assert "weights/layer\\udc80.weight" in text  # the escape, as text, in the markup and the data alike
        assert "\ufffd" not in text
        assert_clean(page, url)
        page.close()


# ---------------------------------------------------------------------------- case 6: the tree as text


def test_the_module_tree_is_text(browser: Browser, names_run: str, tmp_path: Path) -> None:
    page, url = _load(browser, build_explorer(names_run).html, tmp_path / "explorer.html")
    nodes = page.evaluate("window.tensorlens.payload.nodes")
    rows = page.evaluate("""[...document.querySelectorAll('#tl-tree .tl-node')].map(r => [r.title,
        r.querySelector('.tl-name').textContent, (r.querySelector('.tl-type') || {}).textContent || ''])""")
    assert len(rows) == len(nodes)
    by_name = {title.split("\n", 1)[0]: (label, kind) for title, label, kind in rows}
    for n in nodes:  # every module: its name and type in full as text, its full name on hover
        full = n["id"] or f"(root) {n['label']}"
        assert by_name[full] == (n["label"], n["type"])
    # nested lists: a module's full name is the names of its ancestors' rows, joined by dots
    deep = "copy-transformer-encoder.layers.0.self_attn.out_proj"
    path = page.evaluate("""(() => { const names = []; let li = [...document.querySelectorAll('#tl-tree .tl-node')]
        .find(r => r.title.startsWith('copy-transformer-encoder.layers.0.self_attn.out_proj\\n')).parentNode;
        while (li && li.matches('li')) { names.unshift(li.querySelector(':scope > .tl-node .tl-name').textContent);
        li = li.parentNode.closest('li'); } return names; })()""")
    assert ".".join(path[1:]) == deep
    # the browser's find reaches names (a canvas has none), and they are not cut: each fits in the pane
    page.evaluate("document.querySelector('.tl-tree-tools [data-action=expand]').click()")
    for word in (LONG_TYPE, "copy-transformer-encoder", "hasOwnProperty"):
        assert page.evaluate(f"window.getSelection().removeAllRanges() || window.find({json.dumps(word)})") is True
    clipped = page.evaluate("""(() => { const pane = document.getElementById('tl-tree').getBoundingClientRect();
        return [...document.querySelectorAll('#tl-tree .tl-name, #tl-tree .tl-type')].filter(e => {
          const b = e.getBoundingClientRect(); return b.right > pane.right + 0.5 || e.scrollWidth > Math.ceil(b.width) + 1;
        }).map(e => e.textContent); })()""")
    assert clipped == []
    # a name can be selected and copied as text
    assert page.evaluate("""(() => { const e = [...document.querySelectorAll('#tl-tree .tl-type')]
        .find(e => e.textContent === 'NonDynamicallyQuantizableLinear'); const r = document.createRange();
        r.selectNodeContents(e); const s = window.getSelection(); s.removeAllRanges(); s.addRange(r);
        const text = String(s); s.removeAllRanges(); return text; })()""") == LONG_TYPE
    # keyboard: a name is focusable, Enter shows the module
    page.evaluate("""(() => { const e = [...document.querySelectorAll('#tl-tree .tl-name')]
        .find(e => e.textContent === 'out_proj'); e.focus();
        e.dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter', bubbles: true})); })()""")
    assert page.evaluate("document.querySelector('#tl-detail h2').textContent") == deep
    assert page.evaluate("document.activeElement.textContent") == "out_proj"
    # a screen reader sees a tree of items whose names are their text
    assert page.evaluate("document.querySelectorAll('#tl-tree[role=tree] li[role=treeitem]').length") == len(nodes)
    # folding: the triangle hides a module's children, which stay in the document
    page.evaluate("""[...document.querySelectorAll('#tl-tree .tl-node')].find(r => r.title.startsWith('encoder\\n')
        || r.title.startsWith('copy-transformer-encoder\\n')).querySelector('.tl-fold').click()""")
    hidden = page.evaluate("""[...document.querySelectorAll('#tl-tree .tl-name')].filter(e => !e.checkVisibility())
        .map(e => e.textContent)""")
    assert "out_proj" in hidden and "layers" in hidden
    assert_clean(page, url)
    page.close()


# ---------------------------------------------------------------------------- case 7: step axes


def test_step_axes_have_integer_ticks_and_end_at_the_last_step(browser: Browser, tmp_path: Path) -> None:
    run = write_run(str(tmp_path / "short"), 3, ["weights/a.weight", "gradients/a.weight"])
    page, url = _load(browser, build_report(run).html, tmp_path / "report.html")
    assert set(_draw_everything(page)) == {"1"}
    labels = page.evaluate(AXIS_LABELS)
    assert len(labels) >= 5
    for chart, axes in labels.items():
        for axis in axes:
            assert len(set(axis)) == len(axis), (chart, axis)  # no repeated tick (`0 0 0 1 1 1`)
        assert ["0", "1", "2"] in axes, (chart, axes)  # the step axis: the three steps, nothing between
    domains = page.evaluate("Object.values(window.tensorlens.views).map(v => v.scale('x').domain())")
    assert all(d == [0, 2] for d in domains), domains  # heatmaps too: the last column ends at the last step
    assert_clean(page, url)
    page.close()
    page, url = _load(browser, build_explorer(run).html, tmp_path / "explorer.html")
    page.evaluate("window.tensorlens.explorer.select('a')")
    for axes in page.evaluate(AXIS_LABELS).values():
        assert all(len(set(axis)) == len(axis) for axis in axes), axes
    domains = page.evaluate("Object.values(window.tensorlens.views).map(v => v.scale('x').domain())")
    # two tensors, each with a series and a histogram over steps on a step axis (and a histogram);
    # the charts of the module shown before are gone
    assert len(domains) == 6, domains
    assert sum(d == [0, 2] for d in domains) == 4, domains
    assert_clean(page, url)
    page.close()
    # one saved step: every chart still draws, its one tick the step
    run = write_run(str(tmp_path / "one"), 1, ["weights/a.weight", "gradients/a.weight"])
    page, url = _load(browser, build_report(run).html, tmp_path / "one.html")
    assert set(_draw_everything(page)) == {"1"}
    assert all(["0"] in axes for axes in page.evaluate(AXIS_LABELS).values())
    assert_clean(page, url)
    page.close()
    page, url = _load(browser, build_explorer(run).html, tmp_path / "one-explorer.html")
    page.evaluate("window.tensorlens.explorer.select('a')")
    assert_clean(page, url)
    page.close()
