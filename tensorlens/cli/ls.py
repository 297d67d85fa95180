"""``tensorlens ls [RUNS_DIR]``: the runs in a folder, one line each."""

from __future__ import annotations

import datetime
import os

import click

from tensorlens.cli.group import echo_lines
from tensorlens.cli.table import format_table
from tensorlens.store.schema import store_files


def _size(path: str) -> int:
    total = 0
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name.startswith("tensorlens") and os.path.isfile(full):
            total += os.path.getsize(full)  # the SQLite files with their -wal and -shm
    return total


def _human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"


def _last_write(path: str) -> float:
    times = [os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path) if n.startswith("tensorlens")]
    return max(times, default=os.path.getmtime(path))


def run_folders(runs_dir: str) -> list[str]:
    """``runs_dir`` itself when it is a run, else its sub-folders that hold a run store."""
    if store_files(runs_dir):
        return [runs_dir]
    out = []
    for name in sorted(os.listdir(runs_dir)):
        path = os.path.join(runs_dir, name)
        if os.path.isdir(path) and not os.path.islink(path) and store_files(path):
            out.append(path)
    return out


def describe(path: str) -> list[object]:
    from tensorlens.store.reader import open_run

    name = os.path.basename(os.path.normpath(path))
    when = datetime.datetime.fromtimestamp(_last_write(path)).strftime("%Y-%m-%d %H:%M")
    try:
        with open_run(path) as run:
            modes = [str(m) for m in run.modes()]
            steps = run.steps() or (run.steps(modes[0]) if modes else [])
            workers = run.workers()
            span = f"{steps[0]}..{steps[-1]}" if steps else "-"
            return [name, len(steps), span, ",".join(modes) or "-", len(workers), _human(_size(path)), when]
    except Exception as err:  # one damaged run must not hide the others
        return [name, None, f"unreadable: {err}", "-", None, _human(_size(path)), when]


@click.command("ls")
@click.argument("runs_dir", default="tensorlens_runs", required=False, type=click.Path(file_okay=False))
@click.option("-t", "--time", "by_time", is_flag=True, help="Newest first (default: by name).")
def command(runs_dir: str, by_time: bool) -> None:
    """List the runs in RUNS_DIR (default: ./tensorlens_runs): saved steps (train), their range,
    modes, workers, size on disk and last write."""
    if not os.path.isdir(runs_dir):
        raise click.ClickException(f"no folder {runs_dir!r} (tensorlens writes runs to ./tensorlens_runs by default)")
    folders = run_folders(runs_dir)
    if not folders:
        raise click.ClickException(f"no tensorlens run in {runs_dir!r}")
    if by_time:
        folders.sort(key=_last_write, reverse=True)
    rows = [describe(p) for p in folders]
    echo_lines(format_table(["run", "steps", "range", "modes", "workers", "size", "last write"], rows))
