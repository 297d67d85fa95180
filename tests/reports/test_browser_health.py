"""Health at a glance in a real browser (headless Chromium): the report of a healthy, a dead-ReLU and
a NaN run shows each run's health card, the ranked differences and their heatmap, heatmaps on one
colour scale with the NaN cells drawn; the explorer marks the modules with findings. No console
error, no request beyond the file. ``TENSORLENS_SCREENSHOTS=dir`` keeps the screenshots."""

from __future__ import annotations

from pathlib import Path

from tensorlens.reports import build_explorer, build_report

try:
    from .browser import BROWSER_TESTS, Browser, assert_clean
    from .conftest import FAULT_STEP
    from .health_runs import DEAD_RELU
    from .test_browser_pages import _assert_not_blank
except ImportError:
    from browser import BROWSER_TESTS, Browser, assert_clean
    from conftest import FAULT_STEP
    from health_runs import DEAD_RELU
    from test_browser_pages import _assert_not_blank

pytestmark = BROWSER_TESTS


def test_compared_report_in_a_browser(browser: Browser, health_runs: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "compare.html"
    build_report(list(health_runs.values())).save(path)
    url = path.resolve().as_uri()
    page = browser.open(url)
    page.evaluate("window.tensorlens.renderVisible()")
    # the cards: one per run, side by side, each with its status badge
    cards = page.evaluate("""[...document.querySelectorAll('#health .tl-card')].map(c => [c.dataset.status,
        c.querySelector('.tl-badge').innerText, c.getBoundingClientRect().top])""")
    assert [c[0] for c in cards] == ["healthy", "warning", "critical"]
    assert cards[0][2] == cards[1][2]  # side by side in a 1400-pixel window
    assert "critical" in cards[2][1] and cards[0][1] == "healthy: no rule fired"
    text = page.evaluate("document.getElementById('health').innerText")
    assert f"step {FAULT_STEP}: activations/0" in text and "DeadRelu" in text
    # what differs: two groups, each with its ranking table and the relative-difference heatmap
    page.evaluate("document.getElementById('differences').scrollIntoView()")
    page.evaluate("window.tensorlens.renderVisible()")
    groups = page.evaluate("[...document.querySelectorAll('#differences details')].map(d => d.dataset.name)")
    assert len(groups) == 2 and groups[0].startswith("dead against healthy")
    drawn = page.evaluate("[...document.querySelectorAll('#differences .tl-chart')].map(c => c.dataset.rendered)")
    assert drawn == ["1", "1"]
    # the layer heatmaps: the NaN run's gradients have red cells from the fault on
    page.evaluate("document.getElementById('layers').scrollIntoView()")
    page.evaluate("window.tensorlens.renderVisible()")
    red = page.evaluate("""(() => { for (const v of Object.values(window.tensorlens.views)) {
        let rows = [];
        try { rows = v.data('values').filter(d => d.nonfinite); } catch (e) { continue; }
        if (!rows.length) continue;
        let red = 0;  // the rects drawn in the NaN colour
        const walk = (node) => { (node.items || []).forEach(item => {
            if (node.marktype === 'rect' && item.fill === '#e4002b') red++;
            walk(item); }); };
        walk(v.scenegraph().root);
        return [Math.min(...rows.map(d => d.step)), rows.length, red]; } return null; })()""")
    assert red is not None and red[0] == FAULT_STEP and red[2] == red[1] > 0
    assert_clean(page, url)
    page.evaluate("window.scrollTo(0, 0)")
    _assert_not_blank(page.screenshot(1400, 1000), "report_compare.png")
    page.close()


def test_explorer_health_marks_in_a_browser(browser: Browser, health_runs: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "explorer.html"
    build_explorer(health_runs["dead"]).save(path)
    url = path.resolve().as_uri()
    page = browser.open(url)
    page.evaluate("window.tensorlens.explorer.ready")
    marks = {m[0]: m for m in page.evaluate("window.tensorlens.explorer.marks()")}
    assert marks[DEAD_RELU][1] == "warning" and marks[DEAD_RELU][2].startswith("\u25b2 ")
    row = page.evaluate(f"""[...document.querySelectorAll('#tl-tree .tl-node')].find(r => r.querySelector('.tl-name')
        .textContent === {DEAD_RELU!r}).title""")
    assert "warning: DeadRelu" in row
    # folded, the root shows that there are findings below it
    page.evaluate("document.querySelector('#tl-tree .tl-fold').click()")
    assert page.evaluate("document.querySelector('#tl-tree .tl-node .tl-mark-below, #tl-tree .tl-node .tl-mark') !== null")
    page.evaluate(f"window.tensorlens.explorer.select({DEAD_RELU!r})")
    findings = page.evaluate("[...document.querySelectorAll('#tl-detail .tl-findings tbody tr')].map(r => r.innerText)")
    assert findings and findings[0].startswith(f"DeadRelu\t{FAULT_STEP}\tactivations/{DEAD_RELU}")
    assert_clean(page, url)
    page.close()
    # the NaN run: every layer critical
    path = tmp_path / "explorer-nan.html"
    build_explorer(health_runs["nan"]).save(path)
    page = browser.open(path.resolve().as_uri())
    page.evaluate("window.tensorlens.explorer.ready")
    statuses = {m[0]: m[1] for m in page.evaluate("window.tensorlens.explorer.marks()")}
    assert statuses["0"] == "critical" and statuses["2"] == "critical"
    assert page.evaluate("document.querySelector('.tl-health-line').innerText").startswith("modules with findings:")
    assert_clean(page, path.resolve().as_uri())
    _assert_not_blank(page.screenshot(1400, 900), "explorer_health.png")
    page.close()
