"""Reading needs no write access: a run in a folder the reader cannot write (a read-only mount,
an unpacked archive, a colleague's run) opens, through ``tl.open_run`` and the CLI.

Root ignores file modes, so every read here runs in a child process as ``nobody`` (setpriv),
on a folder chmod 0555 holding files chmod 0444, under a temporary folder that ``nobody`` can
traverse.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from unprivileged import as_nobody, can_run_as_nobody

import tensorlens as tl
from tensorlens.store.writer import RunStoreWriter

DATA = Path(__file__).parent / "data"


pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _unprivileged() -> None:
    if not can_run_as_nobody():
        pytest.skip("needs root and setpriv to read as an unprivileged user")


@pytest.fixture
def place() -> Iterator[Path]:
    """A temporary folder ``nobody`` can traverse (pytest's own are 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="tl-readonly-", dir="/tmp"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        for root, dirs, _ in os.walk(folder):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o755)
        shutil.rmtree(folder)


def _record(step: int) -> tl.StepRecord:
    return tl.StepRecord(step, "train", step, "worker_0", 1.0 + step, scalars=[
        tl.ScalarEntry("scalars/x", None, 2.0 * step), tl.ScalarEntry("gradients/w", "l2", 1.0 + step),
    ])


def _write(folder: Path, steps: int) -> None:
    writer = RunStoreWriter(str(folder / "tensorlens.sqlite"))
    for step in range(steps):
        writer.write(_record(step))
    writer.close()


def _lock(folder: Path) -> None:
    for name in os.listdir(folder):
        os.chmod(folder / name, 0o444)
    folder.chmod(0o555)


_READ = """
import json, sys, tensorlens as tl
with tl.open_run(sys.argv[1]) as run:
    print(json.dumps({"steps": run.steps(), "x": run.tensor("scalars/x").values(), "ended": run.ended}))
"""


def _read_as_nobody(path: Path, place: Path, *argv: str, code: str = _READ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(place), "TMPDIR": str(place / "tmp"), "PYTHONDONTWRITEBYTECODE": "1"}
    os.makedirs(place / "tmp", exist_ok=True)
    os.chmod(place / "tmp", 0o777)
    args = [sys.executable, "-c", code, str(path)] if not argv else [sys.executable, "-m", "tensorlens", *argv]
    return subprocess.run(as_nobody(args), capture_output=True, text=True, env=env, cwd=str(place / "tmp"), timeout=240)


def test_a_closed_run_in_a_read_only_folder_reads(place: Path) -> None:
    run = place / "run"
    _write(run, 3)
    assert sorted(os.listdir(run)) == ["tensorlens.sqlite"]  # the writer checkpointed and removed its log
    _lock(run)
    for path in (run, run / "tensorlens.sqlite"):  # the folder, and the file itself
        done = _read_as_nobody(path, place)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"steps": [0, 1, 2], "x": {"0": 0.0, "1": 2.0, "2": 4.0}, "ended": True}
    assert sorted(os.listdir(run)) == ["tensorlens.sqlite"]  # nothing written beside it


def test_the_cli_reads_a_read_only_run(place: Path) -> None:
    run = place / "run"
    _write(run, 3)
    _lock(run)
    shown = _read_as_nobody(run, place, "show", str(run))
    assert shown.returncode == 0, shown.stderr
    assert "scalars/x" in shown.stdout
    exported = _read_as_nobody(run, place, "export", str(run), "-o", "-")
    assert exported.returncode == 0, exported.stderr
    assert "scalars/x" in exported.stdout and "4.0" in exported.stdout
    for argv in (["compare", str(run), str(run)], ["rules", str(run)], ["report", str(run), "-o", str(place / "tmp" / "r.html")]):
        done = _read_as_nobody(run, place, *argv)
        assert done.returncode == 0, (argv, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr, (argv, done.stderr)
    assert os.path.getsize(place / "tmp" / "r.html") > 0


_CRASH = """
import os, sys, tensorlens as tl
from tensorlens.store.writer import RunStoreWriter
writer = RunStoreWriter(sys.argv[1])
for step in range(4):
    writer.write(tl.StepRecord(step, "train", step, "worker_0", 1.0 + step, scalars=[tl.ScalarEntry("scalars/x", None, 2.0 * step)]))
os._exit(0)  # a crash: the log and its index stay, the steps only in the log
"""


def _crashed_run(place: Path) -> Path:
    run = place / "crashed"
    run.mkdir()
    subprocess.run([sys.executable, "-c", _CRASH, str(run / "tensorlens.sqlite")], check=True, timeout=120)
    assert os.path.getsize(run / "tensorlens.sqlite-wal") > 32
    return run


def test_a_crashed_run_in_a_read_only_folder_reads_its_log(place: Path) -> None:
    """The steps that live only in ``-wal`` are read (SQLite reads a read-only ``-shm``)."""
    run = _crashed_run(place)
    _lock(run)
    done = _read_as_nobody(run, place)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"steps": [0, 1, 2, 3], "x": {"0": 0.0, "1": 2.0, "2": 4.0, "3": 6.0}, "ended": False}


def test_a_log_without_its_index_in_a_read_only_folder_is_refused_with_what_to_do(place: Path) -> None:
    """``-wal`` with steps but no ``-shm``: reading the store file alone would miss those steps."""
    run = _crashed_run(place)
    os.remove(run / "tensorlens.sqlite-shm")
    _lock(run)
    done = _read_as_nobody(run, place)
    assert done.returncode != 0
    assert "PermissionError" in done.stderr and "Copy the run folder" in done.stderr, done.stderr
    shown = _read_as_nobody(run, place, "show", str(run))
    assert shown.returncode == 1, shown.stderr
    assert shown.stderr.startswith("Error: ") and "Traceback" not in shown.stderr, shown.stderr
    assert "tensorlens.sqlite-wal" in shown.stderr and "Copy the run folder" in shown.stderr
    # once copied somewhere writable, every step is there
    copy = place / "copy"
    shutil.copytree(run, copy)
    for name in os.listdir(copy):
        os.chmod(copy / name, 0o644)
    copy.chmod(0o755)
    with tl.open_run(str(copy)) as opened:
        assert opened.steps() == [0, 1, 2, 3]


def test_a_schema3_run_in_a_read_only_folder_reads(place: Path) -> None:
    run = Path(shutil.copytree(DATA / "schema3_run", place / "schema3_run"))
    _lock(run)
    code = "import sys, tensorlens as tl\nwith tl.open_run(sys.argv[1]) as run: print(len(run.steps()))"
    done = _read_as_nobody(run, place, code=code)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == len(json.loads((DATA / "schema3_expected.json").read_text())["steps"])
    assert os.listdir(place / "tmp") == []  # the converted copy is gone
