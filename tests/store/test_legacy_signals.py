"""A process killed while it reads a schema-3 run leaves no converted copy behind for long: a
``SIGTERM`` during the conversion removes it at once, and copies of processes killed otherwise
(``SIGKILL``, or ``SIGTERM`` once the run is open) are removed by the next conversion.

Real processes, real signals. To kill a child in the middle of its conversion deterministically,
the child's copying step first writes a marker file and waits; the parent signals it then.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import tensorlens as tl
from tensorlens.store import legacy

DATA = Path(__file__).parent / "data"

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals"),
]


@pytest.fixture
def old_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where converted copies go
    os.makedirs(tmp_path / "tmp")
    return Path(shutil.copytree(DATA / "schema3_run", tmp_path / "schema3_run"))


def copies(old_run: Path) -> list[str]:
    return sorted(n for n in os.listdir(old_run.parent / "tmp") if n.startswith(legacy.COPY_PREFIX))


_CHILD = """
import os, sys, time
from tensorlens.store import legacy
import tensorlens as tl
marker, mode = sys.argv[2], sys.argv[3]
if mode == "handler":  # the program's own SIGTERM handler
    import signal
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(3))
if mode in ("converting", "handler"):
    copy = legacy._copy
    def slow_copy(*args):
        open(marker, "w").close()
        time.sleep(60)
        return copy(*args)
    legacy._copy = slow_copy
run = tl.open_run(sys.argv[1])
print(len(run.steps()), flush=True)
open(marker, "w").close()
time.sleep(60)
"""


def _start(old_run: Path, mode: str) -> tuple[subprocess.Popen[str], Path]:
    marker = old_run.parent / f"marker-{mode}"
    env = {**os.environ, "TMPDIR": str(old_run.parent / "tmp")}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(old_run), str(marker), mode], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the child never reached the point to kill it at"
        time.sleep(0.01)
    return child, marker


def test_sigterm_during_the_conversion_removes_the_copy(old_run: Path) -> None:
    child, _ = _start(old_run, "converting")
    assert len(copies(old_run)) == 1  # the half-made copy
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == -signal.SIGTERM  # ended as SIGTERM ends a process
    assert copies(old_run) == []


def test_sigterm_during_the_conversion_leaves_the_programs_own_handler_in_charge(old_run: Path) -> None:
    child, _ = _start(old_run, "handler")
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 3  # the program's handler ran (sys.exit(3))
    assert copies(old_run) == []  # and the copy went on the way out


@pytest.mark.parametrize(("mode", "sig"), [("converting", signal.SIGKILL), ("open", signal.SIGKILL), ("open", signal.SIGTERM)])
def test_copies_of_killed_processes_are_removed_by_the_next_read(old_run: Path, mode: str, sig: int) -> None:
    child, _ = _start(old_run, mode)
    child.send_signal(sig)
    child.wait(timeout=60)
    left = copies(old_run)
    assert len(left) == 1 and f"{legacy.COPY_PREFIX}{child.pid}-" in left[0]  # killed: nothing could remove it
    with tl.open_run(str(old_run)) as run:
        assert len(run.steps()) == 3
        mine = copies(old_run)
        assert len(mine) == 1 and f"{legacy.COPY_PREFIX}{os.getpid()}-" in mine[0]  # the dead one's is gone
    assert copies(old_run) == []


def test_copies_of_live_processes_are_kept(old_run: Path) -> None:
    child, marker = _start(old_run, "open")
    try:
        with tl.open_run(str(old_run)) as run:
            run.steps()
            assert len(copies(old_run)) == 2  # the child's, still in use, and this process's
    finally:
        child.kill()
        child.wait(timeout=60)


def test_the_sigterm_handler_is_there_only_while_converting(old_run: Path) -> None:
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with tl.open_run(str(old_run)) as run:
        run.steps()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    # a reader in another thread converts too (it cannot set handlers; the sweep still works)
    found: list[object] = []
    thread = threading.Thread(target=lambda: found.append(len(tl.open_run(str(old_run)).steps())))
    thread.start()
    thread.join(timeout=120)
    assert found == [3]


def test_names_that_only_look_like_copies_are_left_alone(old_run: Path) -> None:
    """Anyone can create files in a shared TMPDIR: only names this module makes (an ASCII PID of a
    dead process) are swept; a PID past any PID is taken for alive; nothing breaks the sweep."""
    strange = [f"{legacy.COPY_PREFIX}{'9' * 200}-x.sqlite", f"{legacy.COPY_PREFIX}٩٩٩٩٩٩٩-x.sqlite", f"{legacy.COPY_PREFIX}1x.sqlite"]
    for name in strange:
        (old_run.parent / "tmp" / name).touch()
    with tl.open_run(str(old_run)) as run:
        assert len(run.steps()) == 3
    assert sorted(strange) == copies(old_run)
