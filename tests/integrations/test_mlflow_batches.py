"""The MLflow backend holds the metrics of saved steps for ``send_interval`` seconds and sends them
in one ``log_batch``: against a real ``sqlite:///`` store, read back with ``get_metric_history``
and compared with the local run store of the same training. The client is MLflow's own, counting
the requests it makes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens.findings import Finding

mlflow = pytest.importorskip("mlflow")

from mlflow import MlflowClient  # noqa: E402

from tensorlens.integrations.mlflow import MAX_METRICS_PER_BATCH, MLflowBackend  # noqa: E402

STEPS, SAVE_INTERVAL = 12, 2


class CountingClient(MlflowClient):
    """MLflow's client, counting the ``log_batch`` requests that carry metrics."""

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        self.metric_requests: list[int] = []

    def log_batch(self, run_id: str, metrics: Any = (), *args: Any, **kwargs: Any) -> Any:
        if metrics:
            self.metric_requests.append(len(metrics))
        return super().log_batch(run_id, metrics, *args, **kwargs)


def _store(tmp_path: Path) -> tuple[CountingClient, str]:
    client = CountingClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment(
        f"batches-{time.time_ns()}", artifact_location=(tmp_path / "artifacts").as_uri()
    )
    return client, client.create_run(experiment).info.run_id


def _train(tmp_path: Path, backend: MLflowBackend) -> tl.Hook:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    hook = tl.watch(
        model, backends=[backend], out_dir=str(tmp_path / "runs"), save_interval=SAVE_INTERVAL, run_name="batches"
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(STEPS):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(torch.randn(16, 4)), torch.randn(16, 2)).backward()
        optimizer.step()
    hook.close()
    return hook


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, int, float]]:
    return sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(run_id, key))


@pytest.mark.parametrize("send_interval", [0.0, 3600.0])
def test_held_metrics_all_arrive_at_close_with_their_steps_in_fewer_requests(
    tmp_path: Path, send_interval: float
) -> None:
    client, run_id = _store(tmp_path)
    backend = MLflowBackend(
        client=client,
        run_id=run_id,
        tracker_stats="all",
        histogram_every=0,
        heatmaps=False,
        send_interval=send_interval,
    )
    hook = _train(tmp_path, backend)
    assert hook.backend_stats()["mlflow"].failed == 0

    saved = list(range(0, STEPS, SAVE_INTERVAL))
    with tl.open_run(hook.run_dir) as run:
        assert run.steps(mode="train") == saved
        reference = {
            (tensor, stat): run.tensor(tensor).reduction_values(stat)
            for tensor, stat in (("gradients/0.weight", "l2"), ("biases/2.bias", "max"))
        }
    for (tensor, stat), values in reference.items():
        history = _history(client, run_id, backend.metric_key(tensor, stat))
        assert [(step, value) for step, _, value in history] == sorted(values.items()), (tensor, stat)
    # every record's timestamp after the one before, held or not
    timestamps = [t for _, t, _ in _history(client, run_id, backend.metric_key("gradients/0.weight", "l2"))]
    assert timestamps == sorted(set(timestamps))
    if send_interval == 0:
        assert len(client.metric_requests) == len(saved)  # one per saved step
    else:
        assert len(client.metric_requests) == 1  # everything held until close()
        assert client.metric_requests[0] == sum(
            len(_history(client, run_id, k)) for k in client.get_run(run_id).data.metrics
        )


def _record(step: int, count: int = 3) -> tl.StepRecord:
    scalars = [tl.ScalarEntry(f"weights/layer{i}.weight", "l2", float(step + i)) for i in range(count)]
    return tl.StepRecord(step, tl.ModeKeys.TRAIN, step, "worker_0", 1_700_000_000.0 + step, scalars=scalars)


def _open(tmp_path: Path, **options: Any) -> tuple[CountingClient, str, MLflowBackend]:
    client, run_id = _store(tmp_path)
    backend = MLflowBackend(
        client=client, run_id=run_id, prefix="tl", histogram_every=0, heatmaps=False, tracker_stats="all", **options
    )
    backend.open(tl.RunInfo("direct", str(tmp_path)))
    return client, run_id, backend


def test_flush_makes_held_metrics_visible(tmp_path: Path) -> None:
    client, run_id, backend = _open(tmp_path, send_interval=3600.0)
    for step in range(4):
        backend.write(_record(step))
    assert client.get_run(run_id).data.metrics == {}  # held
    backend.flush()
    assert _history(client, run_id, "tl-weights/layer1.weight/l2") == [
        (step, 1_700_000_000_000 + 1000 * step, float(step + 1)) for step in range(4)
    ]
    assert client.metric_requests == [4 * 3]
    backend.flush()  # nothing held: no request
    assert client.metric_requests == [4 * 3]
    backend.close()


def test_held_metrics_go_when_old_enough_or_a_full_batch(tmp_path: Path) -> None:
    client, run_id, backend = _open(tmp_path, send_interval=0.2)
    backend.write(_record(0))
    backend.write(_record(1))
    assert client.metric_requests == []
    time.sleep(0.25)
    backend.write(_record(2))  # the oldest held is older than send_interval: all three go
    assert client.metric_requests == [9]
    assert [s for s, _, _ in _history(client, run_id, "tl-weights/layer0.weight/l2")] == [0, 1, 2]

    client, run_id, backend = _open(tmp_path / "full", send_interval=3600.0)
    big = MAX_METRICS_PER_BATCH // 2 + 1
    backend.write(_record(0, big))
    backend.write(_record(1, big))  # over a batch: sent in requests MLflow takes
    assert client.metric_requests == [MAX_METRICS_PER_BATCH, 2 * big - MAX_METRICS_PER_BATCH]
    assert len(client.get_run(run_id).data.metrics) == big
    backend.close()


def test_a_finding_sends_the_held_metrics_with_it(tmp_path: Path) -> None:
    client, run_id, backend = _open(tmp_path, send_interval=3600.0)
    backend.write(_record(5))
    backend.write_finding(Finding("LossSpike", 5, "train", None, "loss jumped"))
    assert client.metric_requests == [3 + 1]  # one request: the held metrics, then the finding's count
    assert [s for s, _, _ in _history(client, run_id, "tl-weights/layer2.weight/l2")] == [5]
    assert _history(client, run_id, "tl/rules/LossSpike")[0][0::2] == (5, 1.0)
    assert client.get_run(run_id).data.tags["tensorlens.rules.LossSpike"].startswith("[LossSpike]")
    backend.close()


@pytest.mark.parametrize("bad", [-1, True, "5", float("inf"), float("nan")])
def test_a_bad_send_interval_fails_at_construction(bad: Any) -> None:
    with pytest.raises(ValueError, match="Expected `send_interval` to be"):
        MLflowBackend(run_id="r", send_interval=bad)
