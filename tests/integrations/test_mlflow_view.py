"""What MLflow shows of a realistic run (issue 24), against a real ``mlflow server`` on loopback:
the documented name of every global and derived statistic is the key to query, no key carries a
hash suffix, the artifacts are a bounded number (one image per collection and statistic, not one
per tensor), the default payload is a few keys where ``"all"`` is the store, and ``tensorlens
sync`` gives the live run's keys, values and images."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens.sync import sync_run

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("matplotlib")

from mlflow import MlflowClient  # noqa: E402

from tensorlens.backends.payload import layer_panels  # noqa: E402
from tensorlens.integrations.mlflow import MLflowBackend  # noqa: E402

try:  # tests/integrations may or may not be a package
    from .test_mlflow import _new_run, mlflow_server  # noqa: F401 - the fixture is used by name
    from .test_sync_mlflow import artifacts, metrics
except ImportError:
    from test_mlflow import _new_run, mlflow_server  # noqa: F401
    from test_sync_mlflow import artifacts, metrics

STEPS, SAVE_INTERVAL = 12, 3
HASHED = re.compile(r"-[0-9a-f]{8,}$")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(self.norm(x)))


def record_live(out_dir: Path, backends: list[Any], tracker_stats: str | None = None) -> str:
    """A small residual net with activations and dynamics, a loss, an evaluation at the end."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 3))
    loss_fn = nn.CrossEntropyLoss()
    hook = tl.watch(model, loss_fn, activations=True, dynamics=True, save_interval=SAVE_INTERVAL, backends=backends,
                    out_dir=out_dir, tracker_stats=tracker_stats)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(STEPS):
        opt.zero_grad()
        loss_fn(model(torch.randn(16, 8)), torch.randint(0, 3, (16,))).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        model(torch.randn(4, 8))
    hook.close()
    assert all(s.failed == 0 and s.dropped == 0 for s in hook.backend_stats().values()), hook.backend_stats()
    return hook.run_dir


def images(files: list[str]) -> list[str]:
    """The keys of the logged images (``images/<key with ~ for />+step+...png``)."""
    return sorted(f.split("+", 1)[0][len("images/"):].replace("~", "/") for f in files
                  if f.startswith("images/") and f.endswith(".png"))


def test_default_view_documented_keys_bounded_artifacts_and_sync_equal_to_live(mlflow_server: str, tmp_path: Path) -> None:
    client = MlflowClient(mlflow_server)
    live = _new_run(client, tmp_path / "live")
    run_dir = record_live(tmp_path / "run", [MLflowBackend(tracking_uri=mlflow_server, run_id=live, histogram_every=3)])
    logged = metrics(client, live)

    with tl.open_run(run_dir) as stored:
        records = list(stored.records())
    train = [r for r in records if r.mode == tl.ModeKeys.TRAIN]
    global_stats = sorted({s for r in train for t, s in r.scalar_names if t == "dynamics/global"})
    assert {"grad_norm", "weight_norm", "update_norm", "grad_nonfinite_count"} <= set(global_stats)
    # every global statistic under its documented name, each saved step with the stored value
    for stat in global_stats:
        history = client.get_metric_history(live, f"tensorlens/dynamics/global/{stat}")
        expected = [(r.step, r.scalar("dynamics/global", stat)) for r in train if ("dynamics/global", stat) in r.scalar_names]
        got = sorted((m.step, m.value) for m in history)
        assert [s for s, _ in got] == [s for s, _ in expected], stat
        assert all(math.isclose(a, b, rel_tol=0, abs_tol=0) or (math.isnan(a) and math.isnan(b))
                   for (_, a), (_, b) in zip(got, expected, strict=True)), stat
    assert [m.value for m in client.get_metric_history(live, "tensorlens/nonfinite_count")] == [0.0] * len(train)
    assert {"tensorlens-losses/crossentropyloss"} <= set(logged)
    # no hash suffix anywhere, and a view of a few keys: no series per tensor by default
    assert not [k for k in logged if HASHED.search(k)]
    assert not [k for k in logged if "/per-layer/" in k]  # panels are images, not metrics
    assert len(logged) <= len(global_stats) + 6, sorted(logged)

    # artifacts: one image per collection and statistic of the panels (and mode), not per tensor
    files = artifacts(client, live)
    panels = sorted({(str(r.mode), p.collection, p.stat) for r in records for p in layer_panels(r)})
    tensors = {t for r in records for t, _ in r.histogram_names}
    assert len(tensors) > 2 * len(panels)  # what one image per tensor would have been
    expected_images = sorted(
        ("tensorlens" if mode == "train" else f"tensorlens-{mode}") + f"/per-layer/{collection}/{stat.replace('/', '_')}"
        for mode, collection, stat in panels
    )
    assert images(files) == expected_images
    assert {("activations", "dead_fraction"), ("dynamics", "update_ratio"), ("gradients", "l2"), ("weights", "l2")} <= {
        (c, s) for _, c, s in panels}
    histogram_files = [f for f in files if f.startswith("tensorlens/histograms/")]
    train_files = [f for f in histogram_files if "/train/" in f]
    # the parameters' histograms of the first saved step of every 100 train steps, 3 such records per file
    assert len(train_files) == math.ceil(len({r.step // 100 for r in train}) / 3)
    # each image has MLflow's thumbnail; one file holds the run's metadata
    assert len(files) == len(histogram_files) + 2 * len(expected_images) + 1 and "tensorlens/metadata.json" in files

    # the same run synced: the live run's keys, values and images (a second sync sends nothing)
    synced = sync_run(run_dir, "mlflow", tracking_uri=mlflow_server, experiment="view-sync", progress=False)
    assert synced.records_sent == len(records)
    assert metrics(client, synced.run_id) == logged
    assert images(artifacts(client, synced.run_id)) == expected_images
    # the histogram files too, but for their size (a sync's backend keeps histogram_every=10)
    assert [f for f in artifacts(client, synced.run_id) if f.startswith("images/")] == [f for f in files if f.startswith("images/")]
    assert sync_run(run_dir, "mlflow", tracking_uri=mlflow_server, experiment="view-sync", progress=False).records_sent == 0


def test_all_is_the_store_without_suffixes_and_two_runs_give_one_key_set(mlflow_server: str, tmp_path: Path) -> None:
    client = MlflowClient(mlflow_server)
    first, second = _new_run(client, tmp_path / "a"), _new_run(client, tmp_path / "b")
    run_dir = record_live(tmp_path / "run-a", [MLflowBackend(tracking_uri=mlflow_server, run_id=first, heatmaps=False)], "all")
    record_live(tmp_path / "run-b", [MLflowBackend(tracking_uri=mlflow_server, run_id=second, heatmaps=False)], "all")
    keys = set(client.get_run(first).data.metrics)
    assert keys == set(client.get_run(second).data.metrics)  # two runs of one model: one key set
    assert not [k for k in keys if HASHED.search(k)]
    backend = MLflowBackend(tracking_uri=mlflow_server, run_id=first)
    with tl.open_run(run_dir) as stored:
        series = {backend.metric_key(t, s, r.mode, r.worker) for r in stored.records() for t, s in r.scalar_names}
        modes = {r.mode for r in stored.records()}
    # every stored series (derived and epoch-free here), plus the payload's global non-finite count per mode
    assert keys == series | {backend.global_metric_key("nonfinite_count", m) for m in modes}
    assert "tensorlens/dynamics/global/grad_norm" in keys and "tensorlens-dynamics/0.weight/update_ratio" in keys
    assert "tensorlens-activations/1.act/dead_fraction" in keys
