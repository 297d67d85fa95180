"""``tensorlens ls``: an entry that cannot be read is one unreadable row, never an empty listing;
"last write" and ``-t`` follow writes, not reads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from cli_runs import ENV, cli, write_store
from unprivileged import NOBODY, can_run_as_nobody

from tensorlens.cli import main


def rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:] if line and not line.startswith("unreadable:")}


def test_a_dangling_store_link_is_one_unreadable_row(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    write_store(str(runs / "good"), ["weights/a"], ("l2",))
    (runs / "dangling").mkdir()
    os.symlink(str(tmp_path / "gone.sqlite"), runs / "dangling" / "tensorlens.sqlite")
    assert main(["ls", str(runs)]) == 0
    out = capsys.readouterr().out
    listed = rows(out)
    assert listed["good"][:2] == ["3", "0..2"]
    assert listed["dangling"][:2] == ["-", "unreadable"]
    assert any(line.startswith("unreadable: dangling: ") for line in out.splitlines())
    assert main(["ls", "-t", str(runs)]) == 0  # sorting by time reads the same entries
    assert set(rows(capsys.readouterr().out)) == {"good", "dangling"}
    # the run folder itself, its store a dangling link: one row, exit 0, no traceback
    assert main(["ls", str(runs / "dangling")]) == 0
    assert "unreadable: dangling:" in capsys.readouterr().out


def test_a_folder_that_cannot_be_listed_does_not_hide_the_others(tmp_path) -> None:
    if not can_run_as_nobody():
        pytest.skip("runs the CLI as an unprivileged user (root reads every folder): needs root, setpriv and a checkout nobody can read")
    top = tempfile.mkdtemp(prefix="tensorlens-ls-")  # pytest's tmp folders are 0700: nobody could not enter them
    try:
        os.chmod(top, 0o755)
        write_store(os.path.join(top, "good"), ["weights/a"], ("l2",))
        locked = os.path.join(top, "locked")
        write_store(locked, ["weights/a"], ("l2",))
        for dirpath, _dirs, files in os.walk(top):
            os.chmod(dirpath, 0o755)
            for name in files:
                os.chmod(os.path.join(dirpath, name), 0o644)
        os.chmod(locked, 0o700)  # nobody cannot list it
        done = subprocess.run([*NOBODY, sys.executable, "-m", "tensorlens", "ls", top], capture_output=True, text=True,
                              env=ENV, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        listed = rows(done.stdout)
        assert listed["good"][:2] == ["3", "0..2"]
        assert listed["locked"][1] == "unreadable"
        assert any(line.startswith("unreadable: locked: ") for line in done.stdout.splitlines())
    finally:
        shutil.rmtree(top)


def test_last_write_is_the_stores_not_a_readers(tmp_path) -> None:
    runs = tmp_path / "runs"
    old = write_store(str(runs / "a-old"), ["weights/a"], ("l2",))
    new = write_store(str(runs / "b-new"), ["weights/a"], ("l2",))
    stamp_old, stamp_new = 1_000_000_000, 1_500_000_000  # 2001 and 2017
    for folder, stamp in ((old, stamp_old), (new, stamp_new)):
        for name in os.listdir(folder):
            os.utime(os.path.join(folder, name), (stamp, stamp))
        os.utime(folder, (stamp, stamp))
    # reading the old run maps its -shm (and may create one): that is not a write
    assert cli("show", old).returncode == 0
    assert cli("export", old, "-o", str(tmp_path / "x.csv")).returncode == 0
    done = cli("ls", "-t", str(runs))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:3]] == ["b-new", "a-old"]  # newest write first, not last read
    assert lines[2].endswith(__import__("datetime").datetime.fromtimestamp(stamp_old).strftime("%Y-%m-%d %H:%M"))
    # a write does move it (a checkpoint into the store file, now)
    os.utime(os.path.join(old, "tensorlens.sqlite"), None)
    done = cli("ls", "-t", str(runs))
    assert done.stdout.splitlines()[1].split()[0] == "a-old"
