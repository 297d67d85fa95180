"""Make the README's screenshots of the report and the explorer (docs/report.png, docs/explorer.png).

    python tools/report_screenshots.py            # trains a small Transformer for ~1 minute on a CPU

Trains a two-layer Transformer encoder on a synthetic copy task with ``tl.watch`` (activations on,
an eval pass every 100 steps), adds the model's module list to the run's meta (what the recorder
will store; see ``tensorlens.reports.describe_modules``), builds both pages and photographs them
in headless Chromium (the browser driver of the tests).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
from torch import nn

import tensorlens as tl
from tensorlens.reports import build_explorer, build_report, describe_modules
from tensorlens.store.writer import RunStoreWriter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "reports"))
from browser import Browser  # noqa: E402


class Model(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=128, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


def train(out_dir: str, steps: int = 800) -> str:
    torch.manual_seed(0)
    model = Model()
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    hook = tl.watch(model, loss_fn, save_interval=10, activations=True, backends=["local"], out_dir=out_dir,
                    run_name="copy-transformer")
    for step in range(steps):
        x = torch.randint(0, 32, (32, 16))
        loss = loss_fn(model(x).reshape(-1, 32), x.flip(1).reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 99:
            model.eval()
            with torch.no_grad():
                x = torch.randint(0, 32, (64, 16))
                loss_fn(model(x).reshape(-1, 32), x.flip(1).reshape(-1))
            model.train()
    hook.close()
    # what the recorder will store: the module list (type, extra_repr, parameter shapes)
    RunStoreWriter(os.path.join(hook.run_dir, "tensorlens.sqlite"), {"modules": json.dumps(describe_modules(model))}).close()
    return hook.run_dir


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = train(tmp)
        report, explorer = os.path.join(tmp, "report.html"), os.path.join(tmp, "explorer.html")
        build_report(run).save(report)
        build_explorer(run).save(explorer)
        with Browser() as browser:
            page = browser.open("file://" + report)
            page.evaluate("window.tensorlens.renderVisible()")
            page.pump(1.0)
            with open(os.path.join(ROOT, "docs", "report.png"), "wb") as f:
                f.write(page.screenshot(1280, 1500, full_page=False))
            page.close()
            page = browser.open("file://" + explorer)
            page.evaluate("window.tensorlens.explorer.ready")
            page.evaluate("window.tensorlens.explorer.select('encoder.layers.0.linear1')")
            page.pump(1.0)
            with open(os.path.join(ROOT, "docs", "explorer.png"), "wb") as f:
                f.write(page.screenshot(1280, 900))
            page.close()
    print("wrote docs/report.png and docs/explorer.png")


if __name__ == "__main__":
    main()
