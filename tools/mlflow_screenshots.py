"""Make the MLflow screenshots in docs/: the "Model metrics" tab of a run that tensorlens logged to.

    python tools/mlflow_screenshots.py          # a minute or two: starts a server, trains, opens the UI

Starts ``mlflow server`` on 127.0.0.1 (SQLite store and artifacts in a temporary folder), trains
the 4-layer, 64-wide GPT-2 of issue 24 from ``GPT2Config`` for 40 steps with
``tl.watch(model, activations=True, dynamics=True, save_interval=5)`` and the MLflow backend
(the default payload), then opens the run's Model metrics tab in headless Chromium and waits
until every chart has drawn and every image card's image has loaded (MLflow's UI fetches them
one by one after the page settles: a fixed delay caught the cards with no image yet). Writes

- ``docs/mlflow_model_metrics.png``: the top of the tab, the global groups first;
- ``docs/mlflow_images.png``: the ``tensorlens/per-layer/<collection>`` groups of images.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

import tensorlens as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "reports"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from browser import Browser  # noqa: E402
from sync import start_mlflow_server  # noqa: E402 - the sync benchmark's server: SQLite, one worker

#: Seconds to wait for the UI to draw every chart and image before giving up.
SETTLE = 120


def train(url: str, folder: str) -> tuple[str, str]:
    import mlflow
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=1024, n_positions=128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, 1024, (8, 64))
    mlflow.set_tracking_uri(url)
    mlflow.set_experiment("tensorlens-docs")
    with mlflow.start_run(run_name="gpt2-4x64") as run, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hook = tl.watch(model, activations=True, dynamics=True, save_interval=5, backends=["mlflow"],
                        out_dir=os.path.join(folder, "store"))
        for step in range(40):
            loss = model(batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            mlflow.log_metric("train_loss", float(loss), step=step)
        hook.close()
        return run.info.experiment_id, run.info.run_id


#: How many image cards' images the tab holds and has loaded, and how many charts it drew.
PROGRESS = """(() => {
  const images = [...document.images].filter(i => !i.src.startsWith('data:'));
  return {images: images.length, loaded: images.filter(i => i.complete && i.naturalWidth > 0).length,
          plots: document.querySelectorAll('.js-plotly-plot').length};
})()"""

#: The page position of the first ``tensorlens/per-layer/...`` group's title.
IMAGES_TOP = """(() => {
  const title = [...document.querySelectorAll('*')].find(
    e => e.childElementCount === 0 && /^tensorlens\\/per-layer\\//.test(e.textContent.trim()));
  return title ? title.getBoundingClientRect().top + window.scrollY : null;
})()"""

#: A window tall enough to hold every card: MLflow draws a card only once it is in view.
WINDOW = {"width": 1400, "height": 6000}


def wait_until_drawn(page: Any, images_expected: int, plots_expected: int) -> dict:
    deadline = time.time() + SETTLE
    state: dict = {}
    while time.time() < deadline:
        state = page.evaluate(PROGRESS)
        if state["images"] >= images_expected and state["loaded"] == state["images"] and state["plots"] >= plots_expected:
            page.pump(2.0)  # the last chart's layout
            return state
        page.pump(1.0)
    raise RuntimeError(f"the Model metrics tab did not finish drawing in {SETTLE} s: {state}")


def clip(page: Any, top: float, height: int) -> bytes:
    import base64

    shot = page.call("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": False,  # the window holds it: no re-layout
        "clip": {"x": 0, "y": max(0.0, top), "width": WINDOW["width"], "height": height, "scale": 1},
    })
    return base64.b64decode(shot["data"])


def main() -> int:
    folder = tempfile.mkdtemp(prefix="tl-mlflow-shots-")
    server, url = start_mlflow_server(folder)
    try:
        experiment, run_id = train(url, folder)
        with Browser() as browser:
            page = browser.open("about:blank")
            page.call("Emulation.setDeviceMetricsOverride", {**WINDOW, "deviceScaleFactor": 1, "mobile": False})
            page.navigate(f"{url}/#/experiments/{experiment}/runs/{run_id}/model-metrics")
            # 4 collections' per-layer images at least; the global groups' 9 charts
            print("drawn:", wait_until_drawn(page, images_expected=4, plots_expected=9))
            with open(os.path.join(ROOT, "docs", "mlflow_model_metrics.png"), "wb") as f:
                f.write(clip(page, 0, 1500))
            top = page.evaluate(IMAGES_TOP)
            if top is None:
                raise RuntimeError("no tensorlens/per-layer group on the page")
            with open(os.path.join(ROOT, "docs", "mlflow_images.png"), "wb") as f:
                f.write(clip(page, top - 20, 1400))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    print("wrote docs/mlflow_model_metrics.png and docs/mlflow_images.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
