"""Rule findings in every tracker, read back from the real libraries: a W&B alert and summary
(offline run file), an MLflow tag and metric (a real server), a TensorBoard text entry."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens import rules as R

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")

from mlflow import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator  # noqa: E402

from tensorlens.integrations.mlflow import MLflowBackend  # noqa: E402
from tensorlens.integrations.tensorboard import TensorBoardBackend  # noqa: E402
from tensorlens.integrations.wandb import WandbBackend  # noqa: E402

try:  # tests/integrations may or may not be a package
    from .test_mlflow import _new_run, mlflow_server  # noqa: F401 - the fixture is used by name
    from .wandb_runfile import read_run_dir
except ImportError:
    from test_mlflow import _new_run, mlflow_server  # noqa: F401
    from wandb_runfile import read_run_dir

pytestmark = pytest.mark.filterwarnings("ignore::tensorlens.rules.RuleWarning")


def train_dead_relu(tmp_path: Any, backend: tl.Backend) -> R.RuleRunner:
    """Four saved steps of a net whose ReLUs are all dead: VanishingGradient fires on three tensors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    runner = R.RuleRunner([R.VanishingGradient(), R.ExplodingTensor()])
    hook = tl.Hook(out_dir=os.path.join(str(tmp_path), "run"), save_config=tl.SaveConfig(save_interval=1),
                   backends=[backend, runner], include_collections=["weights", "biases", "gradients"])
    hook.register_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for _ in range(4):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    hook.close()
    found = runner.findings()
    assert len(found) == 12 and {f.rule for f in found} == {"VanishingGradient"}
    assert hook.backend_stats()[backend.name].failed == 0
    return runner


def test_wandb_alert_once_per_tensor_and_summary(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(dir=str(tmp_path), project="tensorlens-tests")
    try:
        runner = train_dead_relu(tmp_path, WandbBackend())
    finally:
        wandb.finish()
    stored = read_run_dir(str(tmp_path))
    found = runner.findings()
    first = {f.tensor: f for f in reversed(found)}  # the first finding of each tensor
    assert sorted(a["text"] for a in stored.alerts) == sorted(str(f) for f in first.values())
    assert {(a["title"], a["level"]) for a in stored.alerts} == {("tensorlens rule VanishingGradient", "WARN")}
    key = "tensorlens/rules/VanishingGradient"
    assert stored.summary[f"{key}/count"] == 12
    assert (stored.summary[f"{key}/first_step"], stored.summary[f"{key}/last_step"]) == (0, 3)
    assert stored.summary[f"{key}/last_message"] == str(found[-1])
    assert run.id in stored.path


def test_mlflow_tag_and_metric(tmp_path: Any, mlflow_server: str) -> None:
    client = MlflowClient(tracking_uri=mlflow_server)
    run_id = _new_run(client, tmp_path / "artifacts")
    runner = train_dead_relu(tmp_path, MLflowBackend(tracking_uri=mlflow_server, run_id=run_id, heatmaps=False, histogram_every=0))
    found = runner.findings()
    data = client.get_run(run_id).data
    assert data.tags["tensorlens.rules.VanishingGradient"] == str(found[-1])
    history = client.get_metric_history(run_id, "tensorlens/rules/VanishingGradient")
    per_step = Counter(f.step for f in found)
    # the count so far, at each finding's step: the last point of each step holds the total up to it
    last = {}
    for point in sorted(history, key=lambda m: m.timestamp):
        last[point.step] = point.value
    totals, running = {}, 0
    for step in sorted(per_step):
        running += per_step[step]
        totals[step] = float(running)
    assert last == totals and len(history) == len(found)


def test_tensorboard_text(tmp_path: Any) -> None:
    log_dir = tmp_path / "tb"
    runner = train_dead_relu(tmp_path, TensorBoardBackend(log_dir=str(log_dir)))
    events = EventAccumulator(str(log_dir), size_guidance={TENSORS: 0})
    events.Reload()
    tag = next(t for t in events.Tags()["tensors"] if t.startswith("tensorlens/rules/VanishingGradient"))
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(tag)]
    expected = [(f.step, f"**{f.rule}** at train step {f.step} `{f.tensor}`: {f.message}") for f in runner.findings()]
    assert sorted(texts) == sorted(expected)
