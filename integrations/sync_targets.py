"""The trackers ``tensorlens sync`` replays into: a W&B run, an MLflow run, a TensorBoard folder.

Each target opens (or continues) one tracker run and hands back the backend a live run uses,
so a synced run holds what a live run of the same steps holds, key for key:

- ``wandb``: ``wandb.init(project, entity, id=..., resume="allow")`` and a
  :class:`~tensorlens.integrations.wandb.WandbBackend` on that run. Offline (``WANDB_MODE=offline``
  or ``offline=True``) each sync session writes an offline run folder that ``wandb sync``
  uploads; a later session of the same run writes another folder with the same run id, and
  ``wandb sync --id <id>`` uploads them in order.
- ``mlflow``: a run created in the experiment (``Default`` unless named), then an
  :class:`~tensorlens.integrations.mlflow.MLflowBackend` on it; marked ``FINISHED`` at the end
  of each session.
- ``tensorboard``: event files in ``<logdir>/<run name>`` written by a
  :class:`~tensorlens.integrations.tensorboard.TensorBoardBackend`.
"""

from __future__ import annotations

import os
import shlex
from typing import Any, ClassVar

from tensorlens._checks import expected
from tensorlens.backends.base import Backend
from tensorlens.backends.optional import import_optional
from tensorlens.store.runs import folder_name
from tensorlens.sync.target import SyncTarget

#: MLflow's HTTP client while a sync runs (unless the user set them): MLflow's defaults retry a
#: lost server for about four minutes per request (7 retries, backoff factor 2) and wait 120 s for
#: an answer, so a server killed mid-sync kept the sync going for 4 to 8.5 minutes (one request in
#: flight, then ending the run). Two retries a second apart and 20 s without an answer: a sync
#: fails within seconds of the server going away, and the next sync continues from its progress.
MLFLOW_SYNC_ENVIRONMENT = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}

#: The W&B project of a synced run unless ``--project`` or ``WANDB_PROJECT`` says otherwise.
DEFAULT_WANDB_PROJECT = "tensorlens"
DEFAULT_MLFLOW_EXPERIMENT = "Default"


def _optional_text(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise expected(name, "None or a non-empty string", value)


class WandbTarget(SyncTarget):
    """A W&B run (offline or online) in ``project`` of ``entity``."""

    name: ClassVar[str] = "wandb"
    metadata_every_session: ClassVar[bool] = True  # each offline session is a run folder of its own
    options: ClassVar[tuple[str, ...]] = ("project", "entity", "wandb_dir", "offline")

    def __init__(
        self, project: str | None = None, entity: str | None = None, wandb_dir: str | None = None, offline: bool | None = None
    ) -> None:
        super().__init__()
        _optional_text("project", project)
        _optional_text("entity", entity)
        if wandb_dir is not None and not isinstance(wandb_dir, (str, os.PathLike)):
            raise expected("wandb_dir", "None or a folder", wandb_dir)
        if offline is not None and not isinstance(offline, bool):
            raise expected("offline", "None or a bool", offline)
        import_optional("wandb", "wandb", "tensorlens sync --to wandb")
        self.project = project or os.environ.get("WANDB_PROJECT") or DEFAULT_WANDB_PROJECT
        self.entity = entity or os.environ.get("WANDB_ENTITY") or None
        self.wandb_dir = os.fspath(wandb_dir) if wandb_dir is not None else None
        self.offline = offline
        self._run: Any = None

    @property
    def key(self) -> str:
        return f"wandb:{self.entity or ''}/{self.project}"

    def start(self, run_name: str, run_id: str | None) -> tuple[Backend, str]:
        wandb = import_optional("wandb", "wandb", "tensorlens sync --to wandb")
        from tensorlens.integrations.wandb import WandbBackend

        if self.wandb_dir is not None:
            os.makedirs(self.wandb_dir, exist_ok=True)
        kwargs: dict[str, Any] = {"project": self.project, "entity": self.entity, "dir": self.wandb_dir}
        if self.offline:
            kwargs["mode"] = "offline"
        if run_id is None:
            kwargs["name"] = run_name
        else:
            kwargs.update(id=run_id, resume="allow")
        try:  # a run of its own, next to any run the calling script has open (wandb >= 0.19.10)
            self._run = wandb.init(reinit="create_new", **kwargs)
        except (TypeError, ValueError):
            self._run = wandb.init(reinit=True, **kwargs)
        if getattr(self._run, "offline", False):
            folder = getattr(self._run.settings, "sync_dir", None) or os.path.dirname(self._run.dir)
            self.info["offline_dirs"] = [*self.info.get("offline_dirs", []), os.path.abspath(folder)]
        return WandbBackend(run=self._run), self._run.id

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()

    def check_state(self, run_id: str, info: dict[str, Any]) -> str | None:
        folders = info.get("offline_dirs", [])
        if not isinstance(folders, list) or not all(isinstance(f, str) and os.path.isabs(f) for f in folders):
            return "its W&B offline folders are not a list of folders"
        return super().check_state(run_id, info)

    def describe(self) -> list[str]:
        folders = self.info.get("offline_dirs", [])
        run = self._run
        if run is not None and not getattr(run, "offline", False):
            return [f"W&B run: {getattr(run, 'url', None) or run.id}"]
        if not folders:
            return [f"W&B run {self.run_id} (project {self.project!r})"] if self.run_id else []
        command = ["wandb", "sync"]
        if len(folders) > 1:  # later sessions of one run: same id, uploaded in order
            command += ["--id", str(self.run_id), "-p", self.project] + (["-e", self.entity] if self.entity else [])
        return [
            f"W&B offline run {self.run_id} (project {self.project!r}) written to {folders[-1]}",
            "upload it with:" if len(folders) == 1 else "upload its folders, in order, with:",
            "  " + shlex.join(command + folders),
        ]


class MLflowTarget(SyncTarget):
    """An MLflow run in ``experiment`` at ``tracking_uri``. An experiment that does not exist is
    created, with its artifacts in ``artifact_location`` (MLflow's default otherwise: ``./mlruns``
    for a local store, the server's artifact root for a server)."""

    name: ClassVar[str] = "mlflow"
    options: ClassVar[tuple[str, ...]] = ("tracking_uri", "experiment", "artifact_location")

    def __init__(
        self, tracking_uri: str | None = None, experiment: str | None = None, artifact_location: str | None = None
    ) -> None:
        super().__init__()
        _optional_text("tracking_uri", tracking_uri)
        _optional_text("experiment", experiment)
        _optional_text("artifact_location", artifact_location)
        self.artifact_location = artifact_location
        mlflow = import_optional("mlflow", "mlflow", "tensorlens sync --to mlflow")
        self.tracking_uri = tracking_uri or mlflow.get_tracking_uri()
        self.experiment = experiment or DEFAULT_MLFLOW_EXPERIMENT
        self._client: Any = None

    @property
    def key(self) -> str:
        return f"mlflow:{self.tracking_uri}#{self.experiment}"

    def environment(self) -> dict[str, str]:
        return dict(MLFLOW_SYNC_ENVIRONMENT)

    def start(self, run_name: str, run_id: str | None) -> tuple[Backend, str]:
        mlflow = import_optional("mlflow", "mlflow", "tensorlens sync --to mlflow")
        from tensorlens.integrations.mlflow import MLflowBackend, _probe

        _probe(self.tracking_uri)  # a server that is down: at once, not after MLflow's minutes of retries
        client = self._client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        if run_id is not None:
            found = client.get_run(run_id)  # MLflow's own error for a run that is gone
            if found.info.lifecycle_stage == "deleted":
                raise RuntimeError(
                    f"the MLflow run {run_id} that this run was synced into before is deleted; "
                    "restore it in MLflow, or pass --new-run to sync into a new run"
                )
            client.update_run(run_id, status="RUNNING")
        else:
            experiment = client.get_experiment_by_name(self.experiment)
            experiment_id = (
                experiment.experiment_id if experiment is not None
                else client.create_experiment(self.experiment, artifact_location=self.artifact_location)
            )
            run_id = client.create_run(experiment_id, run_name=run_name, tags={"tensorlens.source": "sync"}).info.run_id
        return MLflowBackend(client=client, run_id=run_id), run_id

    def finish(self) -> None:
        if self._client is not None and self.run_id is not None:
            from tensorlens.integrations.mlflow import _probe

            _probe(self.tracking_uri)  # a server gone mid-sync: at once, not after retries
            self._client.set_terminated(self.run_id, "FINISHED")

    def describe(self) -> list[str]:
        return [f"MLflow run {self.run_id} in experiment {self.experiment!r} at {self.tracking_uri}"] if self.run_id else []


class TensorBoardTarget(SyncTarget):
    """Event files in ``<logdir>/<run name>``: one TensorBoard run per stored run."""

    name: ClassVar[str] = "tensorboard"
    options: ClassVar[tuple[str, ...]] = ("logdir",)

    def __init__(self, logdir: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        if not isinstance(logdir, (str, os.PathLike)) or not os.fspath(logdir):
            raise expected("logdir", "the folder TensorBoard reads (--logdir)", logdir)
        import_optional("torch.utils.tensorboard", "tensorboard", "tensorlens sync --to tensorboard")
        self.logdir = os.path.abspath(os.fspath(logdir))

    @property
    def key(self) -> str:
        return f"tensorboard:{self.logdir}"

    def start(self, run_name: str, run_id: str | None) -> tuple[Backend, str]:
        from tensorlens.integrations.tensorboard import TensorBoardBackend

        if run_id is None:  # a new folder: never mix two stored runs of the same name
            run_id = base = folder_name(run_name)
            n = 1
            while os.path.exists(os.path.join(self.logdir, run_id)):
                n += 1
                run_id = f"{base}-{n}"
        folder = os.path.join(self.logdir, run_id)
        if os.path.dirname(os.path.normpath(folder)) != os.path.normpath(self.logdir):  # check_state's promise, kept here too
            raise ValueError(f"the TensorBoard run {run_id!r} would not be a folder of {self.logdir}")
        return TensorBoardBackend(log_dir=folder), run_id

    def describe(self) -> list[str]:
        if self.run_id is None:
            return []
        folder = os.path.join(self.logdir, self.run_id)
        return [f"TensorBoard events in {folder}", f"  tensorboard --logdir {shlex.quote(self.logdir)}"]
