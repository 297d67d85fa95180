"""``tensorlens sync RUN --to NAME``: replay a stored run into a tracker.

``NAME`` is any registered backend that replays: ``wandb``, ``mlflow``, ``tensorboard``, or one of
your own, registered (``tl.register_backend``) by a module that ``--backend-module MODULE`` or
``TENSORLENS_BACKENDS="MODULE ..."`` names. The tracker's options are its flags (``--project``,
``--logdir``, ...) or ``--option KEY=VALUE``; ``--tracker-stats`` chooses what the tracker receives of
each record, as ``tracker_stats=`` does live. Again later: only the steps recorded since are sent
(what was sent is kept beside the run store, which sync only reads; see :mod:`tensorlens.sync`).
W&B offline (``WANDB_MODE=offline`` or ``--offline``) writes an offline run folder, and the command
prints the ``wandb sync`` line that uploads it. Exit codes as every command's (1 an error, one
``Error: ...`` line, also for a sync that stopped midway or found another sync of the run to the
destination running; 130 Ctrl-C), and 143 for SIGTERM (128 + 15), after the progress is saved.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import Any

import click

from tensorlens.backends.base import replaying_backends
from tensorlens.cli.group import echo_lines
from tensorlens.sync import SyncError, SyncResult, SyncTerminated, sync_run

#: The exit code after SIGTERM: 128 + the signal, as 130 is for Ctrl-C (SIGINT).
EXIT_TERMINATED = 143
#: Modules (separated by spaces) imported before ``--to`` is read: they register backends.
BACKENDS_VARIABLE = "TENSORLENS_BACKENDS"


def import_backend_modules(modules: Sequence[str]) -> None:
    """Import each module (it calls ``tl.register_backend``); a failure is one error line."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as err:  # the user's module: whatever it raises, one line naming it
            raise ImportError(
                f"tensorlens sync could not import the backend module {module!r} (--backend-module or "
                f"{BACKENDS_VARIABLE}): {type(err).__name__}: {err}"
            ) from None


class ReplayingBackend(click.Choice):
    """``--to``: the registered backends that replay, looked up when the command runs (so one
    registered by a backend module counts), without importing a tracker's library."""

    def __init__(self) -> None:
        super().__init__(())

    @property  # type: ignore[override]
    def choices(self) -> tuple[str, ...]:
        import_backend_modules(os.environ.get(BACKENDS_VARIABLE, "").split())
        return tuple(replaying_backends())

    @choices.setter
    def choices(self, value: Any) -> None:  # click.Choice.__init__ assigns it; the registry decides
        pass


def _backend_modules(ctx: click.Context, param: click.Parameter, value: Sequence[str]) -> None:
    import_backend_modules(value)


def _options(ctx: click.Context, param: click.Parameter, value: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in value:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key.isidentifier():
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", ctx=ctx, param=param)
        if key in out:
            raise click.BadParameter(f"{key!r} given twice", ctx=ctx, param=param)
        out[key] = text
    return out


@click.command("sync")
@click.argument("run", type=click.Path(exists=True, file_okay=True, dir_okay=True))
@click.option("--to", "to", required=True, type=ReplayingBackend(), help="the tracker: a registered backend that replays")
@click.option("--project", default=None, help="W&B project (default: WANDB_PROJECT or 'tensorlens')")
@click.option("--entity", default=None, help="W&B entity")
@click.option("--offline", is_flag=True, default=None, help="W&B offline: an offline run folder that `wandb sync` uploads")
@click.option("--wandb-dir", default=None, type=click.Path(file_okay=False), help="the folder W&B writes wandb/ in")
@click.option("--tracking-uri", default=None, help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
@click.option("--experiment", default=None, help="MLflow experiment name (default: Default; created if missing)")
@click.option("--artifact-location", default=None, help="MLflow: where a new experiment keeps its artifacts")
@click.option("--logdir", default=None, type=click.Path(file_okay=False), help="TensorBoard folder; events go to LOGDIR/<run>")
@click.option("--option", "options", multiple=True, metavar="KEY=VALUE", callback=_options,
              help="an option of the backend (its replay_options; a string), repeatable")
@click.option("--backend-module", multiple=True, metavar="MODULE", is_eager=True, expose_value=False,
              callback=_backend_modules, help=f"import MODULE first: it registers a backend (also ${BACKENDS_VARIABLE})")
@click.option("--tracker-stats", default=None, metavar="CHOICE",
              help="what the tracker receives: default, all, or statistic names like l2,histogram "
                   "(default: $TENSORLENS_TRACKER_STATS, else default)")
@click.option("--tracker-histogram-interval", type=click.IntRange(min=1), default=None, metavar="STEPS",
              help="train steps between the records whose histograms are sent "
                   "(default: 100 with the default payload, every record otherwise)")
@click.option("--new-run", is_flag=True, help="forget an earlier sync to this destination and start a new tracker run")
@click.option("--progress/--no-progress", default=True, help="a progress bar on a terminal")
def command(run: str, to: str, project: str | None, entity: str | None, offline: bool | None, wandb_dir: str | None,
            tracking_uri: str | None, experiment: str | None, artifact_location: str | None, logdir: str | None,
            options: dict[str, str], tracker_stats: str | None, tracker_histogram_interval: int | None, new_run: bool,
            progress: bool) -> None:
    """Replay the stored run RUN into a tracker (W&B, MLflow, TensorBoard or a backend of your
    own); again later, only new steps."""
    flags = {
        "project": project, "entity": entity, "offline": offline or None, "wandb_dir": wandb_dir,
        "tracking_uri": tracking_uri, "experiment": experiment, "artifact_location": artifact_location, "logdir": logdir,
    }
    given = {k: v for k, v in flags.items() if v is not None}
    twice = sorted(given.keys() & options.keys())
    if twice:
        raise click.BadParameter(f"{twice[0]!r} is given by --{twice[0].replace('_', '-')} already", param_hint="'--option'")
    # errors (a folder with no run, an option the backend does not take, a tracker missing) become
    # one "Error: ..." line in the group; a SyncError (a tracker unreachable, a sync that stopped
    # midway, another sync running) is not one of the group's user errors, so it is made one here
    try:
        result = sync_run(run, to, options={**given, **options}, new_run=new_run, progress=progress,
                          tracker_stats=_tracker_stats(tracker_stats), tracker_histogram_interval=tracker_histogram_interval)
    except SyncError as err:
        if os.environ.get("TENSORLENS_DEBUG", "") not in ("", "0"):
            raise
        raise click.ClickException(str(err)) from None
    except SyncTerminated as err:
        click.echo(f"Terminated: {err}", err=True)
        raise click.exceptions.Exit(EXIT_TERMINATED) from None
    echo_lines(describe(run, result))


def _tracker_stats(value: str | None) -> str | list[str] | None:
    """``--tracker-stats``: ``default``, ``all``, or names separated by commas."""
    if value is None or value.strip() in ("default", "all"):
        return value.strip() if value else None
    names = [part.strip() for part in value.split(",") if part.strip()]
    if not names:
        raise click.BadParameter(f"{value!r} is not default, all or statistic names", param_hint="'--tracker-stats'")
    return names


def describe(run: str, result: SyncResult) -> list[str]:
    """What went where, and what to do next (``wandb sync ...`` for an offline W&B run).

    >>> describe("runs/exp1", result)[0]   # doctest: +SKIP
    'tensorlens sync: 40 new records of runs/exp1 sent to tensorboard:/abs/tb (created run exp1); 0 were there already'
    """
    what = f"{result.records_sent} new record{'s' if result.records_sent != 1 else ''}"
    if result.findings_sent:
        what += f" and {result.findings_sent} rule finding{'s' if result.findings_sent != 1 else ''}"
    verb = "created" if result.new_run else "continued"
    lines = [
        f"tensorlens sync: {what} of {os.path.normpath(run)} sent to {result.target} "
        f"({verb} run {result.run_id}); {result.already_sent} were there already"
    ]
    if result.sent:
        lines.append("  " + ", ".join(f"{mode}/{worker}: {n}" for (mode, worker), n in sorted(result.sent.items())))
    return lines + result.lines
