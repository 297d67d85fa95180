"""Make the screenshots of health at a glance in docs/: the report comparing a healthy, a dead-ReLU
and a NaN run, and the explorer marking the modules with findings.

    python tools/health_screenshots.py          # trains three small MLPs (about a minute on a CPU)

The runs are those of the tests (``tests/reports/health_runs.py``), longer and wider: one MLP
trained three ways from the same seed and data; at step 60 the dead run's bias before the second
ReLU is set very negative, and the NaN run gets one NaN in its input. Writes

- ``docs/report_health.png``: the header, each run's health card and the start of "What differs";
- ``docs/report_differs.png``: the ranking of the dead run against the healthy one, and its heatmap;
- ``docs/report_layers.png``: ``activations · dead_fraction`` of the three runs on one colour scale;
- ``docs/explorer_health.png``: the explorer of the dead run, the broken ReLU selected.
"""

from __future__ import annotations

import os
import sys
import tempfile

from tensorlens.reports import build_explorer, build_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "reports"))
from browser import Browser  # noqa: E402
from health_runs import DEAD_RELU, train_all  # noqa: E402

#: How the runs are trained for the pictures (the tests train 16 steps).
RUNS = {"steps": 120, "fault_step": 60, "width": 64, "depth": 3, "save_interval": 2}


def shoot(browser: Browser, html: str, out: str, script: str = "", height: int = 1000) -> None:
    page = browser.open("file://" + html)
    page.evaluate("window.tensorlens.renderVisible()")
    if script:
        page.evaluate(script)
        page.evaluate("window.tensorlens.renderVisible()")
    page.pump(1.0)
    with open(os.path.join(ROOT, "docs", out), "wb") as f:
        f.write(page.screenshot(1400, height))
    page.close()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        runs = train_all(tmp, **RUNS)
        report, explorer = os.path.join(tmp, "report.html"), os.path.join(tmp, "explorer.html")
        build_report(list(runs.values()), title="healthy, dead-ReLU and NaN runs compared").save(report)
        build_explorer(runs["dead"]).save(explorer)
        with Browser() as browser:
            shoot(browser, report, "report_health.png", height=1050)
            shoot(browser, report, "report_differs.png",
                  "document.querySelector('#differences details').scrollIntoView()", height=1100)
            pick = """(() => { const s = document.querySelector('#layers .tl-choice select');
                s.value = [...s.options].find(o => o.text === 'activations \\u00b7 dead_fraction').value;
                s.dispatchEvent(new Event('change'));
                document.getElementById('layers').scrollIntoView(); })()"""
            shoot(browser, report, "report_layers.png", pick, height=900)
            page = browser.open("file://" + explorer)
            page.evaluate("window.tensorlens.explorer.ready")
            page.evaluate(f"window.tensorlens.explorer.select({DEAD_RELU!r})")
            page.pump(1.0)
            with open(os.path.join(ROOT, "docs", "explorer_health.png"), "wb") as f:
                f.write(page.screenshot(1400, 900))
            page.close()
    print("wrote docs/report_health.png, docs/report_differs.png, docs/report_layers.png and docs/explorer_health.png")


if __name__ == "__main__":
    main()
