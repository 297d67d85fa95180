"""``tensorlens ls [RUNS_DIR]``: the runs in a folder, one line each.

One entry that cannot be read (a dangling store link, a sub-folder that cannot be listed, a
damaged store) never hides the other runs: its row says ``unreadable``, and a line under the
table ``unreadable: <run>: <why>`` (a reason can be long; the table stays narrow). "Last write" is
when the run's data last changed: the store files and their write-ahead logs holding frames,
never the ``-shm`` index (a reader maps it and touches it), an empty ``-wal`` (a reader creates
one) nor the folder.
"""

from __future__ import annotations

import datetime
import os

import click

from tensorlens.cli.group import echo_lines
from tensorlens.cli.table import format_table
from tensorlens.store.schema import store_files

_SIZE_SUFFIXES = ("", "-wal", "-shm", "-journal")  # a store's files on disk
_DATA_SUFFIXES = ("", "-wal")  # the files a write changes (the -shm changes on reads too)


def _store_paths(path: str, suffixes: tuple[str, ...]) -> list[str]:
    return [f"{store}{suffix}" for store in store_files(path) for suffix in suffixes]


def _size(path: str) -> int:
    total = 0
    for file in _store_paths(path, _SIZE_SUFFIXES):
        try:
            total += os.stat(file).st_size
        except OSError:  # no -wal (yet), a dangling link: nothing on disk to count
            pass
    return total


def _human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"


def last_write(path: str) -> float:
    """When the run's data last changed: the newest modification time of its store files and
    of their ``-wal`` when it holds anything; 0.0 when none can be read."""
    times = []
    for file in _store_paths(path, _DATA_SUFFIXES):
        try:
            info = os.stat(file)
        except OSError:
            continue
        if info.st_size or not file.endswith("-wal"):
            times.append(info.st_mtime)
    return max(times, default=0.0)


def _sort_time(path: str) -> float:
    try:
        return last_write(path)
    except (OSError, ValueError):  # an entry that cannot be read sorts last
        return 0.0


def run_folders(runs_dir: str) -> list[str]:
    """``runs_dir`` itself when it is a run, else its sub-folders that hold a run store, and
    those that cannot be looked into (they are listed as unreadable, not silently skipped)."""
    if store_files(runs_dir):
        return [runs_dir]
    out = []
    for name in sorted(os.listdir(runs_dir)):
        path = os.path.join(runs_dir, name)
        if os.path.islink(path) or not os.path.isdir(path):
            continue  # links are not followed
        try:
            if store_files(path):
                out.append(path)
        except (OSError, ValueError):  # a folder that cannot be listed: maybe a run, say so
            out.append(path)
    return out


def describe(path: str) -> tuple[list[object], str | None]:
    """The run's row, and why it cannot be read (``None`` when it can)."""
    from tensorlens.store.reader import open_run

    name = os.path.basename(os.path.normpath(path))
    size = when = "-"
    try:
        size = _human(_size(path))
        written = last_write(path)
        when = datetime.datetime.fromtimestamp(written).strftime("%Y-%m-%d %H:%M") if written else "-"
        with open_run(path) as run:
            modes = [str(m) for m in run.modes()]
            steps = run.steps() or (run.steps(modes[0]) if modes else [])
            workers = run.workers()
            span = f"{steps[0]}..{steps[-1]}" if steps else "-"
            return [name, len(steps), span, ",".join(modes) or "-", len(workers), size, when], None
    except Exception as err:  # one damaged run must not hide the others
        why = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
        return [name, None, "unreadable", "-", None, size, when], f"unreadable: {name}: {why or type(err).__name__}"


@click.command("ls")
@click.argument("runs_dir", default="tensorlens_runs", required=False, type=click.Path(file_okay=False))
@click.option("-t", "--time", "by_time", is_flag=True, help="Newest first, by last write (default: by name).")
def command(runs_dir: str, by_time: bool) -> None:
    """List the runs in RUNS_DIR (default: ./tensorlens_runs): saved steps (train), their range,
    modes, workers, size on disk and last write (of the store, not of a read). A run that cannot
    be read says `unreadable` on its row and why under the table."""
    if not os.path.isdir(runs_dir):
        raise click.ClickException(f"no folder {runs_dir!r} (tensorlens writes runs to ./tensorlens_runs by default)")
    folders = run_folders(runs_dir)
    if not folders:
        raise click.ClickException(f"no tensorlens run in {runs_dir!r}")
    if by_time:
        folders.sort(key=_sort_time, reverse=True)
    described = [describe(p) for p in folders]
    table = format_table(["run", "steps", "range", "modes", "workers", "size", "last write"], [r for r, _ in described])
    echo_lines([*table, *(why for _, why in described if why)])

