"""The report and the explorer in a real browser (headless Chromium over the DevTools protocol):
no console error, no request beyond the file itself, the charts drawn, names shown as text,
screenshots that are not blank.

Chromium comes from Debian's ``chromium`` package (``.ci/run`` installs it); these tests skip,
saying so, only where no Chromium can be found.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tensorlens.reports import build_explorer, build_report

try:
    from .browser import BROWSER_TESTS, Browser, assert_clean, png_pixels
    from .report_runs import HOSTILE
except ImportError:
    from browser import BROWSER_TESTS, Browser, assert_clean, png_pixels
    from report_runs import HOSTILE

pytestmark = BROWSER_TESTS
SCREENSHOTS = os.environ.get("TENSORLENS_SCREENSHOTS")  # a folder to keep the screenshots in


def _open(browser: Browser, path: Path):
    page = browser.open(path.resolve().as_uri())
    return page


def _assert_not_blank(png: bytes, name: str) -> np.ndarray:
    pixels = png_pixels(png)[..., :3]
    if SCREENSHOTS:
        os.makedirs(SCREENSHOTS, exist_ok=True)
        Path(SCREENSHOTS, name).write_bytes(png)
    assert pixels.std() > 0.05, "the screenshot is (nearly) blank"
    # not one colour with a few specks: many distinct colours (charts, text, colour scales)
    distinct = len(np.unique((pixels[::4, ::4] * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    assert distinct > 50, distinct
    return pixels


def test_report_in_a_browser(browser: Browser, real_run: str, tmp_path: Path) -> None:
    path = tmp_path / "report.html"
    build_report(real_run).save(path)
    page = _open(browser, path)
    url = path.resolve().as_uri()
    drawn = page.evaluate("window.tensorlens.renderVisible()")
    # gradient norm, loss (x1 scalar), the layer heatmap shown first, the NaN note (no chart),
    # two open histogram groups
    assert drawn >= 5
    canvases = page.evaluate("document.querySelectorAll('.tl-chart[data-rendered=\"1\"] canvas').length")
    assert canvases == drawn
    marks = page.evaluate(
        "Object.values(window.tensorlens.views).map(v => v.scenegraph().root.items.length).reduce((a, b) => a + b, 0)")
    assert marks >= drawn
    # a layer heatmap has one rect per (tensor, kept step): 4 gradients x 12 steps
    cells = page.evaluate("""(() => {
        const v = Object.values(window.tensorlens.views).find(v => (v.data('data_0') || []).some(d => d.tensor));
        return v ? v.data('data_0').length : -1; })()""")
    assert cells == 4 * 12
    # the statistic drop-down shows another heatmap, drawn on demand
    page.evaluate("""(() => { const s = document.querySelector('.tl-choice select'); s.value = '1';
        s.dispatchEvent(new Event('change')); })()""")
    page.evaluate("window.tensorlens.renderVisible()")
    assert page.evaluate("""[...document.querySelectorAll('.tl-choice-pane')].map(p => [p.hidden,
        p.querySelector('.tl-chart').getAttribute('data-rendered')])""")[:2] == [[True, "1"], [False, "1"]]
    # the filter box hides histogram groups that do not match
    shown = page.evaluate("""(() => { const i = document.querySelector('.tl-filter input'); i.value = '^weights/';
        i.dispatchEvent(new Event('input'));
        return [...document.querySelectorAll('.tl-group')].filter(g => !g.hidden).map(g => g.dataset.name); })()""")
    assert shown == ["weights/0.weight", "weights/2.weight"]
    assert_clean(page, url)
    page.evaluate("window.scrollTo(0, 0)")
    _assert_not_blank(page.screenshot(1400, 1000), "report.png")
    page.close()


def test_explorer_in_a_browser(browser: Browser, real_run: str, tmp_path: Path) -> None:
    path = tmp_path / "explorer.html"
    build_explorer(real_run).save(path)
    page = _open(browser, path)
    page.evaluate("window.tensorlens.explorer.ready")
    rows = page.evaluate("window.tensorlens.explorer.rows()")
    assert [r[0] for r in rows] == ["", "0", "1", "2"]  # the root (the run), then the modules in order
    # the tree is HTML: nested lists, one row per module, the name as text and the full name in the title
    run_name = page.evaluate("window.tensorlens.payload.nodes.find(n => n.id === '').label")
    assert page.evaluate("[...document.querySelectorAll('#tl-tree .tl-node .tl-name')].map(e => e.textContent)") == [
        run_name, "0", "1", "2"]
    assert page.evaluate("document.querySelectorAll('#tl-tree ul ul li').length") == 3
    titles = page.evaluate("[...document.querySelectorAll('#tl-tree .tl-node')].map(e => e.title.split('\\n')[0])")
    assert titles == [f"(root) {run_name}", "0", "1", "2"]
    # the first module with tensors is shown: its tensors' charts are drawn
    assert page.evaluate("document.querySelector('#tl-detail h2').textContent") == "0"
    headings = page.evaluate("[...document.querySelectorAll('#tl-detail h3')].map(h => h.textContent)")
    assert set(headings) == {"weights/0.weight", "biases/0.bias", "gradients/0.weight", "gradients/0.bias", "activations/0"}
    assert page.evaluate("document.querySelectorAll('#tl-detail canvas').length") == 3 * len(headings)
    # folding the root hides its children; search unfolds to the match
    page.evaluate("""(() => { const s = document.querySelector('.tl-tree-tools [data-action=collapse]'); s.click(); })()""")
    page.evaluate("document.querySelector('#tl-tree .tl-fold').click()")  # the root's
    assert [r[0] for r in page.evaluate("window.tensorlens.explorer.rows()")] == [""]
    assert page.evaluate("document.querySelector('#tl-tree .tl-node:has(+ ul) + ul').checkVisibility()") is False
    page.evaluate("""(() => { const i = document.querySelector('.tl-search'); i.value = '2';
        i.dispatchEvent(new Event('input')); })()""")
    shown = page.evaluate("window.tensorlens.explorer.rows()")
    assert [r[0] for r in shown if r[3]] == ["2"] and "2" in [r[0] for r in shown]
    assert page.evaluate("document.querySelector('#tl-tree .tl-match .tl-name').textContent") == "2"
    page.evaluate("window.tensorlens.explorer.select('2')")
    assert page.evaluate("document.querySelector('#tl-detail h2').textContent") == "2"
    assert_clean(page, path.resolve().as_uri())
    _assert_not_blank(page.screenshot(1400, 900), "explorer.png")
    page.close()


def test_hostile_names_render_as_text(browser: Browser, hostile_run: str, tmp_path: Path) -> None:
    for builder, name in ((build_report, "report"), (build_explorer, "explorer")):
        path = tmp_path / f"{name}.html"
        builder(hostile_run).save(path)
        page = _open(browser, path)
        if name == "explorer":
            page.evaluate("window.tensorlens.explorer.ready")
            page.evaluate(f"window.tensorlens.explorer.select({repr('enc.' + HOSTILE)})")
        else:
            page.evaluate("window.tensorlens.openAll()")
            page.evaluate("window.tensorlens.renderVisible()")
        text = page.evaluate("document.body.innerText")
        assert HOSTILE in text  # visible, literally
        assert page.evaluate("document.querySelectorAll('img').length") == 0  # never became an element
        assert page.evaluate("document.querySelectorAll('[onerror]').length") == 0
        assert_clean(page, path.resolve().as_uri())
        if name == "explorer":  # the hover text (a title attribute) shows extra_repr as text too
            titles = page.evaluate("[...document.querySelectorAll('#tl-tree .tl-node')].map(e => e.title)")
            enc = next(t for t in titles if t.startswith("enc\n"))
            assert f"extra_repr: note={HOSTILE}" in enc
            assert any(t.startswith(f"enc.{HOSTILE}\n") for t in titles)
        page.close()


def test_scales_and_findings_sections_draw(browser: Browser, scales_run: str, hostile_run: str, tmp_path: Path) -> None:
    path = tmp_path / "both.html"
    build_report([scales_run, hostile_run]).save(path)
    page = _open(browser, path)
    page.evaluate("window.tensorlens.renderVisible()")
    page.evaluate("document.getElementById('scales').scrollIntoView()")
    page.evaluate("window.tensorlens.renderVisible()")
    drawn = page.evaluate("""[...document.querySelectorAll('#findings .tl-chart, #scales .tl-chart')]
        .map(c => c.getAttribute('data-rendered'))""")
    assert drawn == ["1", "1", "1"]  # the findings ticks, forward and backward scales
    assert_clean(page, path.resolve().as_uri())
    page.close()


def test_large_report_draws_within_budget(browser: Browser, tmp_path: Path) -> None:
    """200 tensors x 300 steps: the page loads and draws what is in view without errors."""
    try:
        from .report_runs import write_run
    except ImportError:
        from report_runs import write_run
    names = [f"{kind}/blocks.{b}.fc{i}.weight" for b in range(20) for i in range(5) for kind in ("weights", "gradients")]
    run = write_run(str(tmp_path / "big"), 300, names)
    path = tmp_path / "big.html"
    build_report(run).save(path)
    assert path.stat().st_size < 4_000_000
    page = _open(browser, path)
    assert page.evaluate("window.tensorlens.renderVisible()") >= 5
    assert_clean(page, path.resolve().as_uri())
    page.close()
