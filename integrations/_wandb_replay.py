"""How :class:`~tensorlens.integrations.wandb.WandbBackend` replays a stored run (``tensorlens sync
--to wandb``): ``wandb.init(project, entity, id=..., resume="allow")`` and the backend on that run.

Offline (``WANDB_MODE=offline`` or ``offline=True``) each sync session writes an offline run folder
that ``wandb sync`` uploads; a later session of the same run writes another folder with the same
run id (kept in the sync state's ``info``), and ``wandb sync --id <id>`` uploads them in order.
The functions here are the backend's ``replay_*`` class methods (bound in its class body); they
live apart because they open and end a W&B run, which translating records never does.
"""

from __future__ import annotations

import os
import shlex
from typing import Any

from tensorlens._checks import expected
from tensorlens.backends.base import Backend, ReplayRun, run_id_problem
from tensorlens.backends.optional import import_optional

OPTIONS = ("project", "entity", "wandb_dir", "offline")
#: The W&B project of a synced run unless ``--project`` or ``WANDB_PROJECT`` says otherwise.
DEFAULT_PROJECT = "tensorlens"


def settings(cls: type[Backend], options: dict[str, Any]) -> dict[str, Any]:
    project, entity, wandb_dir, offline = (options.get(k) for k in OPTIONS)
    for name, value in (("project", project), ("entity", entity)):
        if value is not None and (not isinstance(value, str) or not value):
            raise expected(name, "None or a non-empty string", value)
    if wandb_dir is not None and not isinstance(wandb_dir, (str, os.PathLike)):
        raise expected("wandb_dir", "None or a folder", wandb_dir)
    if offline is not None and not isinstance(offline, bool):
        raise expected("offline", "None or a bool", offline)
    import_optional("wandb", "wandb", "tensorlens sync --to wandb")
    return {
        "project": project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
        "entity": entity or os.environ.get("WANDB_ENTITY") or None,
        "wandb_dir": os.fspath(wandb_dir) if wandb_dir is not None else None,
        "offline": offline,
    }


def destination(cls: type[Backend], replay: ReplayRun) -> str:
    return f"wandb:{replay.options['entity'] or ''}/{replay.options['project']}"


def open_for_replay(cls: type[Backend], replay: ReplayRun, run_name: str) -> tuple[Backend, str]:
    wandb = import_optional("wandb", "wandb", "tensorlens sync --to wandb")
    options = replay.options
    if options["wandb_dir"] is not None:
        os.makedirs(options["wandb_dir"], exist_ok=True)
    kwargs: dict[str, Any] = {"project": options["project"], "entity": options["entity"], "dir": options["wandb_dir"]}
    if options["offline"]:
        kwargs["mode"] = "offline"
    if replay.run_id is None:
        kwargs["name"] = run_name
    else:
        kwargs.update(id=replay.run_id, resume="allow")
    try:  # a run of its own, next to any run the calling script has open (wandb >= 0.19.10)
        run = wandb.init(reinit="create_new", **kwargs)
    except (TypeError, ValueError):
        run = wandb.init(reinit=True, **kwargs)
    replay.tracker = run
    if getattr(run, "offline", False):
        folder = getattr(run.settings, "sync_dir", None) or os.path.dirname(run.dir)
        replay.info["offline_dirs"] = [*replay.info.get("offline_dirs", []), os.path.abspath(folder)]
    return cls(run=run), run.id  # type: ignore[call-arg]


def finish(cls: type[Backend], replay: ReplayRun) -> None:
    if replay.tracker is not None:
        replay.tracker.finish()


def check_state(cls: type[Backend], replay: ReplayRun) -> str | None:
    folders = replay.info.get("offline_dirs", [])
    if not isinstance(folders, list) or not all(isinstance(f, str) and os.path.isabs(f) for f in folders):
        return "its W&B offline folders are not a list of folders"
    return run_id_problem(replay.run_id)


def describe(cls: type[Backend], replay: ReplayRun) -> list[str]:
    folders = replay.info.get("offline_dirs", [])
    project, entity, run = replay.options["project"], replay.options["entity"], replay.tracker
    if run is not None and not getattr(run, "offline", False):
        return [f"W&B run: {getattr(run, 'url', None) or run.id}"]
    if not folders:
        return [f"W&B run {replay.run_id} (project {project!r})"] if replay.run_id else []
    command = ["wandb", "sync"]
    if len(folders) > 1:  # later sessions of one run: same id, uploaded in order
        command += ["--id", str(replay.run_id), "-p", project] + (["-e", entity] if entity else [])
    return [
        f"W&B offline run {replay.run_id} (project {project!r}) written to {folders[-1]}",
        "upload it with:" if len(folders) == 1 else "upload its folders, in order, with:",
        "  " + shlex.join(command + folders),
    ]
