"""``tensorlens sync RUN --to wandb|mlflow|tensorboard``: replay a stored run into a tracker.

Again later: only the steps recorded since are sent (what was sent is kept beside the run store,
which sync only reads; see :mod:`tensorlens.sync`). W&B offline (``WANDB_MODE=offline`` or
``--offline``) writes an offline run folder, and the command prints the ``wandb sync`` line that
uploads it. Exit codes as every command's (1 an error, one ``Error: ...`` line, also for a sync
that stopped midway or found another sync of the run to the destination running; 130 Ctrl-C),
and 143 for SIGTERM (128 + 15), after the progress is saved.
"""

from __future__ import annotations

import os

import click

from tensorlens.cli.group import echo_lines
from tensorlens.sync import SyncError, SyncResult, SyncTerminated, sync_run

#: The exit code after SIGTERM: 128 + the signal, as 130 is for Ctrl-C (SIGINT).
EXIT_TERMINATED = 143


@click.command("sync")
@click.argument("run", type=click.Path(exists=True, file_okay=True, dir_okay=True))
@click.option("--to", "to", required=True, type=click.Choice(["wandb", "mlflow", "tensorboard"]), help="the tracker")
@click.option("--project", default=None, help="W&B project (default: WANDB_PROJECT or 'tensorlens')")
@click.option("--entity", default=None, help="W&B entity")
@click.option("--offline", is_flag=True, default=None, help="W&B offline: an offline run folder that `wandb sync` uploads")
@click.option("--wandb-dir", default=None, type=click.Path(file_okay=False), help="the folder W&B writes wandb/ in")
@click.option("--tracking-uri", default=None, help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
@click.option("--experiment", default=None, help="MLflow experiment name (default: Default; created if missing)")
@click.option("--artifact-location", default=None, help="MLflow: where a new experiment keeps its artifacts")
@click.option("--logdir", default=None, type=click.Path(file_okay=False), help="TensorBoard folder; events go to LOGDIR/<run>")
@click.option("--new-run", is_flag=True, help="forget an earlier sync to this destination and start a new tracker run")
@click.option("--progress/--no-progress", default=True, help="a progress bar on a terminal")
def command(run: str, to: str, project: str | None, entity: str | None, offline: bool | None, wandb_dir: str | None,
            tracking_uri: str | None, experiment: str | None, artifact_location: str | None, logdir: str | None,
            new_run: bool, progress: bool) -> None:
    """Replay the stored run RUN into W&B, MLflow or TensorBoard; again later, only new steps."""
    # errors (a folder with no run, an option the target does not take, a tracker missing) become
    # one "Error: ..." line in the group; a SyncError (a tracker unreachable, a sync that stopped
    # midway, another sync running) is not one of the group's user errors, so it is made one here
    try:
        result = sync_run(
            run, to, project=project, entity=entity, offline=offline or None, wandb_dir=wandb_dir,
            tracking_uri=tracking_uri, experiment=experiment, artifact_location=artifact_location, logdir=logdir,
            new_run=new_run, progress=progress,
        )
    except SyncError as err:
        if os.environ.get("TENSORLENS_DEBUG", "") not in ("", "0"):
            raise
        raise click.ClickException(str(err)) from None
    except SyncTerminated as err:
        click.echo(f"Terminated: {err}", err=True)
        raise click.exceptions.Exit(EXIT_TERMINATED) from None
    echo_lines(describe(run, result))


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
