"""How :class:`~tensorlens.integrations.mlflow.MLflowBackend` replays a stored run (``tensorlens sync
--to mlflow``): a run created in the experiment (``Default`` unless named; an experiment that does
not exist is created, with its artifacts in ``artifact_location``), or the run an earlier sync
created, set back to ``RUNNING``; the backend on it; ``FINISHED`` at the end of each session.

The functions here are the backend's ``replay_*`` class methods (bound in its class body); they
live apart because they create and end MLflow runs, which translating records never does.
"""

from __future__ import annotations

from typing import Any

from tensorlens._checks import expected
from tensorlens.backends.base import Backend, ReplayRun
from tensorlens.backends.optional import import_optional
from tensorlens.integrations._mlflow_probe import probe

OPTIONS = ("tracking_uri", "experiment", "artifact_location")
DEFAULT_EXPERIMENT = "Default"

#: MLflow's HTTP client while a sync runs (unless the user set them): MLflow's defaults retry a
#: lost server for about four minutes per request (7 retries, backoff factor 2) and wait 120 s for
#: an answer, so a server killed mid-sync kept the sync going for 4 to 8.5 minutes (one request in
#: flight, then ending the run). Two retries a second apart and 20 s without an answer: a sync
#: fails within seconds of the server going away, and the next sync continues from its progress.
SYNC_ENVIRONMENT = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}


def _mlflow() -> Any:
    return import_optional("mlflow", "mlflow", "tensorlens sync --to mlflow")


def settings(cls: type[Backend], options: dict[str, Any]) -> dict[str, Any]:
    for name in OPTIONS:
        value = options.get(name)
        if value is not None and (not isinstance(value, str) or not value):
            raise expected(name, "None or a non-empty string", value)
    mlflow = _mlflow()
    return {
        "tracking_uri": options.get("tracking_uri") or mlflow.get_tracking_uri(),
        "experiment": options.get("experiment") or DEFAULT_EXPERIMENT,
        "artifact_location": options.get("artifact_location"),
    }


def destination(cls: type[Backend], replay: ReplayRun) -> str:
    return f"mlflow:{replay.options['tracking_uri']}#{replay.options['experiment']}"


def environment(cls: type[Backend], replay: ReplayRun) -> dict[str, str]:
    return dict(SYNC_ENVIRONMENT)


def open_for_replay(cls: type[Backend], replay: ReplayRun, run_name: str) -> tuple[Backend, str]:
    uri, run_id = replay.options["tracking_uri"], replay.run_id
    probe(uri)  # a server that is down: at once, not after MLflow's minutes of retries
    client = replay.tracker = _mlflow().MlflowClient(tracking_uri=uri)
    if run_id is not None:
        found = client.get_run(run_id)  # MLflow's own error for a run that is gone
        if found.info.lifecycle_stage == "deleted":
            raise RuntimeError(
                f"the MLflow run {run_id} that this run was synced into before is deleted; "
                "restore it in MLflow, or pass --new-run to sync into a new run"
            )
        client.update_run(run_id, status="RUNNING")
    else:
        experiment = client.get_experiment_by_name(replay.options["experiment"])
        experiment_id = (
            experiment.experiment_id if experiment is not None
            else client.create_experiment(replay.options["experiment"], artifact_location=replay.options["artifact_location"])
        )
        run_id = client.create_run(experiment_id, run_name=run_name, tags={"tensorlens.source": "sync"}).info.run_id
    return cls(client=client, run_id=run_id), run_id  # type: ignore[call-arg]


def finish(cls: type[Backend], replay: ReplayRun) -> None:
    if replay.tracker is not None and replay.run_id is not None:
        probe(replay.options["tracking_uri"])  # a server gone mid-sync: at once, not after retries
        replay.tracker.set_terminated(replay.run_id, "FINISHED")


def describe(cls: type[Backend], replay: ReplayRun) -> list[str]:
    if replay.run_id is None:
        return []
    return [f"MLflow run {replay.run_id} in experiment {replay.options['experiment']!r} at {replay.options['tracking_uri']}"]
