"""``tensorlens sync --to mlflow`` against a real MLflow server on loopback: the synced run equals
the run recorded live (metrics with their steps, values and timestamps, params, histogram
artifacts), and a second sync asks MLflow to store only the new steps (counted at the client:
MLflow silently drops exact duplicate points, so the server alone could not show a resend)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

import tensorlens as tl
from tensorlens.engine.metadata import flatten
from tensorlens.sync import sync_run

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")

from mlflow import MlflowClient  # noqa: E402

from tensorlens.integrations._mlflow_metadata import SUMMARY_PARAMS  # noqa: E402
from tensorlens.integrations.mlflow import MLflowBackend  # noqa: E402
from tensorlens.integrations.sync_targets import MLflowTarget  # noqa: E402

try:  # tests/integrations may or may not be a package
    from . import test_mlflow as mlflow_tests
    from .test_mlflow import _new_run, mlflow_server  # noqa: F401 - the fixture is used by name
    from .test_sync import train
    from .test_sync_safety import cli, one_error_line
except ImportError:
    import test_mlflow as mlflow_tests
    from test_mlflow import _new_run, mlflow_server  # noqa: F401
    from test_sync import train
    from test_sync_safety import cli, one_error_line


def metrics(client: MlflowClient, run_id: str, timestamps: bool = False) -> dict[str, list[tuple[Any, ...]]]:
    """Every metric of the run: key -> sorted [(step, value)] (or [(step, value, timestamp)]).

    Timestamps are the records' wall times, except that the backend keeps each record's after the
    previous one's: an eval record and a train record of one step written in one millisecond
    may get them one apart in another order (a replay sends records in ``Run.records()`` order)."""
    keys = client.get_run(run_id).data.metrics.keys()
    return {
        key: sorted((m.step, m.value, m.timestamp)[: 3 if timestamps else 2] for m in client.get_metric_history(run_id, key))
        for key in keys
    }


def artifacts(client: MlflowClient, run_id: str, path: str = "") -> list[str]:
    """Every artifact path; a logged image's without the random id MLflow puts in its name."""
    out = []
    for info in client.list_artifacts(run_id, path):
        out += artifacts(client, run_id, info.path) if info.is_dir else [info.path]
    return sorted(re.sub(r"\+[0-9a-f]{8}-[0-9a-f-]{27}", "", p) for p in out)


def histogram_files(client: MlflowClient, run_id: str, tmp: Path) -> dict[str, Any]:
    out = {}
    for path in artifacts(client, run_id, "tensorlens/histograms"):
        local = client.download_artifacts(run_id, path, str(tmp))
        with open(local, encoding="utf-8") as f:
            out[path] = json.load(f)
    return out


class CountingClient(MlflowClient):
    """A real client that counts the metric points it is asked to log."""

    points = 0

    def log_batch(self, run_id: str, metrics: Any = (), *args: Any, **kwargs: Any) -> Any:
        CountingClient.points += len(metrics)
        return super().log_batch(run_id, metrics, *args, **kwargs)


class CountingTarget(MLflowTarget):
    def start(self, run_name: str, run_id: str | None) -> tuple[Any, str]:
        backend, run_id = super().start(run_name, run_id)
        return MLflowBackend(client=CountingClient(self.tracking_uri), run_id=run_id), run_id


def test_mlflow_sync_equals_the_live_run_and_sends_each_point_once(mlflow_server: str, tmp_path: Path) -> None:
    client = MlflowClient(mlflow_server)
    live = _new_run(client, tmp_path / "live-artifacts")
    # tracker_stats="all": every stored series, so each new record's series are counted below
    run_dir = train(str(tmp_path / "run"), [MLflowBackend(tracking_uri=mlflow_server, run_id=live, tracker_stats="all")], steps=9)

    result = sync_run(run_dir, CountingTarget(tracking_uri=mlflow_server, experiment="sync-tests"), progress=False,
                      tracker_stats="all")
    synced = result.run_id
    assert result.new_run and result.records_sent == 8 and result.metadata_sent
    first_points = CountingClient.points

    # metrics: the same keys, each with the same (step, value) points
    live_metrics, synced_metrics = metrics(client, live), metrics(client, synced)
    assert synced_metrics == live_metrics
    assert first_points == sum(len(points) for points in live_metrics.values())  # each point asked once
    # params: the summary of the run metadata, flattened under tensorlens.; all of it in metadata.json
    with tl.open_run(run_dir) as stored:
        metadata = stored.metadata()
    flat = flatten(metadata)
    expected = {f"tensorlens.{k}": str(flat[k]) for k in SUMMARY_PARAMS if k in flat}
    assert len(expected) >= 5
    params = client.get_run(synced).data.params
    assert {k: v for k, v in params.items() if k.startswith("tensorlens.")} == expected
    assert client.get_run(live).data.params == params
    for run_id in (synced, live):  # the whole metadata, nested as the store holds it
        path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="tensorlens/metadata.json",
                                                   dst_path=str(tmp_path / run_id), tracking_uri=client.tracking_uri)
        with open(path, encoding="utf-8") as f:
            written = json.load(f)
        assert written == json.loads(json.dumps(metadata)) if run_id == synced else written["config"] == metadata["config"]
    # artifacts: the same histogram files (same records, same chunks) and heatmaps
    assert artifacts(client, synced) == artifacts(client, live)
    assert histogram_files(client, synced, tmp_path / "a") == histogram_files(client, live, tmp_path / "b")
    run = client.get_run(synced)
    assert run.info.status == "FINISHED" and run.info.run_name == run.data.tags["tensorlens.run_name"]
    assert client.get_experiment(run.info.experiment_id).name == "sync-tests"

    # the run goes on; the next sync continues the same MLflow run and sends only the new steps
    train(run_dir, ["local"], steps=6, resume="allow", seed=2)
    again = sync_run(run_dir, CountingTarget(tracking_uri=mlflow_server, experiment="sync-tests"), progress=False,
                     tracker_stats="all")
    assert again.run_id == synced and not again.new_run and not again.metadata_sent
    assert again.already_sent == 8 and again.records_sent > 0
    with tl.open_run(run_dir) as stored:
        new_records = [r for r in stored.records() if (r.mode == tl.ModeKeys.TRAIN and r.step > 8)
                       or (r.mode == tl.ModeKeys.EVAL and r.mode_step > 4)]
        every = list(stored.records())
    assert again.records_sent == len(new_records)
    asked = CountingClient.points - first_points
    # one point per series of each new record (its quantiles are series of the record too), and
    # the payload's nonfinite_count
    assert asked == sum(len(set(r.scalar_names)) + 1 for r in new_records)
    after = metrics(client, synced, timestamps=True)
    for key, points in after.items():
        assert len({(s, t) for s, _, t in points}) == len(points), key  # no point twice
    gradient = "tensorlens-gradients/0.weight/l2"
    assert [s for s, _, _ in after[gradient]] == [r.step for r in every if r.mode == tl.ModeKeys.TRAIN]
    # the histogram files continue the first session's: one file per 10 records of a mode, each record once
    files = histogram_files(client, synced, tmp_path / "c")
    for mode in ("train", "eval"):
        stored_steps = [r.mode_step for r in every if str(r.mode) == mode and r.histograms]
        in_files = [(path, entry["mode_step"]) for path, doc in sorted(files.items()) if f"/{mode}/" in path
                    for entry in doc["records"]]
        assert [ms for _, ms in in_files] == stored_steps
        assert len({path for path, _ in in_files}) == (len(stored_steps) + 9) // 10
    assert sync_run(run_dir, "mlflow", tracking_uri=mlflow_server, experiment="sync-tests", progress=False).records_sent == 0


def test_mlflow_sync_into_a_local_store(tmp_path: Path) -> None:
    run_dir = train(str(tmp_path / "run"), ["local"], steps=3)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = sync_run(run_dir, "mlflow", tracking_uri=uri, experiment="local",
                      artifact_location=(tmp_path / "artifacts").as_uri(), progress=False)
    client = MlflowClient(uri)
    keys = client.get_run(result.run_id).data.metrics.keys()
    assert keys >= {"tensorlens/nonfinite_count", "tensorlens-losses/mseloss"}, keys
    assert os.path.isdir(tmp_path / "artifacts" / result.run_id / "artifacts" / "tensorlens" / "histograms")
    assert result.lines == [f"MLflow run {result.run_id} in experiment 'local' at {uri}"]


def test_an_unreachable_server_is_one_clear_error(tmp_path: Path) -> None:
    import socket

    from tensorlens.sync import SyncError

    run_dir = train(str(tmp_path / "run"), ["local"], steps=1)
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(SyncError, match="could not open the mlflow run .*unreachable"):
        sync_run(run_dir, "mlflow", tracking_uri=f"http://127.0.0.1:{port}", progress=False)
    from tensorlens.sync.state import SyncState, locate

    with SyncState(locate(os.path.join(run_dir, "tensorlens.sqlite")).path) as state:  # no tracker run was made: none recorded
        assert state.targets() == []


def test_an_unreachable_server_is_one_error_line_from_the_command(tmp_path: Path) -> None:
    import socket

    run_dir = train(str(tmp_path / "run"), ["local"], steps=1)
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = cli("sync", run_dir, "--to", "mlflow", "--tracking-uri", f"http://127.0.0.1:{port}", "--no-progress")
    assert "could not open the mlflow run" in one_error_line(done) and "unreachable" in done.stderr


class KillingClient(MlflowClient):
    """A real client that kills the server (SIGKILL to its process group) just before its
    ``kill_at``-th batch of metrics goes out: that request meets a server that went away after
    the backend's reachability probe, the case MLflow's own retries drew out for minutes."""

    def __init__(self, uri: str, server: Any, kill_at: int) -> None:
        super().__init__(uri)
        self.server, self.kill_at, self.batches = server, kill_at, 0

    def log_batch(self, run_id: str, metrics: Any = (), *args: Any, **kwargs: Any) -> Any:
        if metrics:
            self.batches += 1
            if self.batches == self.kill_at:
                import signal

                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait(timeout=30)
        return super().log_batch(run_id, metrics, *args, **kwargs)


@pytest.mark.timeout(400)  # the bound below is the test; this one only stops a sync that hangs for minutes
def test_a_server_killed_mid_sync_fails_in_seconds_and_the_next_sync_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from tensorlens.sync import SyncError

    root = tmp_path / "server"
    root.mkdir()
    server, uri = mlflow_tests._start_server(root)
    try:
        run_dir = train(str(tmp_path / "run"), ["local"], steps=16)
        with tl.open_run(run_dir) as stored:
            total = len(stored.step_keys())

        class KillingTarget(MLflowTarget):
            def start(self, run_name: str, run_id: str | None) -> tuple[Any, str]:
                _, run_id = super().start(run_name, run_id)
                # send_interval=0: one request per record, so the 9th request is the 9th record's
                return MLflowBackend(client=KillingClient(uri, server, kill_at=9), run_id=run_id, send_interval=0), run_id

        started = time.monotonic()
        with pytest.raises(SyncError, match="stopped after 8 new records"):
            sync_run(run_dir, KillingTarget(tracking_uri=uri, experiment="killed"), progress=False, checkpoint_every=4)
        assert time.monotonic() - started < 60  # MLflow's defaults: 4 to 8.5 minutes
        assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # set for the sync only

        # the same server again (same store, same port: the same destination)
        port = int(uri.rsplit(":", 1)[1])
        monkeypatch.setattr(mlflow_tests, "_free_port", lambda: port)
        server, again_uri = mlflow_tests._start_server(root)
        assert again_uri == uri
        again = sync_run(run_dir, CountingTarget(tracking_uri=uri, experiment="killed"), progress=False)
        assert not again.new_run and again.already_sent == 8 and again.records_sent == total - 8
        client = MlflowClient(uri)
        after = metrics(client, again.run_id, timestamps=True)
        for key, points in after.items():
            assert len({s for s, _, _ in points}) == len(points), key  # each step of a series once
        with tl.open_run(run_dir) as stored:
            train_steps = [r.step for r in stored.records() if r.mode == tl.ModeKeys.TRAIN]
        assert [s for s, _, _ in after["tensorlens/nonfinite_count"]] == train_steps
        assert client.get_run(again.run_id).info.status == "FINISHED"
    finally:
        mlflow_tests._stop(server)


def test_the_command_takes_the_payload_choice(tmp_path: Path) -> None:
    """``--tracker-stats``: the default view, every stored series, or named statistics; a bad
    choice is one error line."""
    run_dir = train(str(tmp_path / "run"), ["local"], steps=3)
    with tl.open_run(run_dir) as stored:
        stored_series = {(str(r.mode), t, s) for r in stored.records() for t, s in r.scalar_names}
    got = {}
    for choice in ("default", "all", "l2"):
        uri = f"sqlite:///{tmp_path / f'{choice}.db'}"
        done = cli("sync", run_dir, "--to", "mlflow", "--tracking-uri", uri, "--tracker-stats", choice, "--no-progress",
                   "--artifact-location", (tmp_path / f"artifacts-{choice}").as_uri(), "--experiment", choice)
        assert done.returncode == 0, done.stderr
        client = MlflowClient(uri)
        (run,) = client.search_runs([client.get_experiment_by_name(choice).experiment_id])
        got[choice] = set(run.data.metrics)
    assert "tensorlens-gradients/0.weight/l2" in got["all"] and "tensorlens-gradients/0.weight/l2" in got["l2"]
    assert not [k for k in got["default"] if k.startswith(("tensorlens-gradients/", "tensorlens-weights/"))]
    assert not [k for k in got["l2"] if k.endswith("/mean") and k.startswith("tensorlens-gradients/")]
    modes = {mode for mode, _, _ in stored_series}
    assert len(got["all"]) == len(stored_series) + len(modes)  # and each mode's nonfinite_count
    assert got["default"] < got["all"] and got["l2"] < got["all"]
    bad = cli("sync", run_dir, "--to", "mlflow", "--tracking-uri", f"sqlite:///{tmp_path / 'bad.db'}",
              "--tracker-stats", "l2/x", "--no-progress")
    assert "tracker_stats" in one_error_line(bad)
