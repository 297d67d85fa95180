"""Files the commands write (``-o``): never over a run's files, special files written into and not
replaced, a write error as one ``Error:`` line. Real files, links, a FIFO and a character device."""

from __future__ import annotations

import hashlib
import os
import stat
import threading

import pytest
from cli_runs import write_store

import tensorlens as tl
from tensorlens.cli import main


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def run_files(run: str) -> dict[str, str]:
    """The run folder's contents (a reader's -shm index and empty -wal aside: reading makes them)."""
    return {n: digest(os.path.join(run, n)) for n in sorted(os.listdir(run))
            if not n.endswith("-shm") and os.path.getsize(os.path.join(run, n))}


def one_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", ["export", "report", "explore"])
def test_output_onto_the_run_store_is_refused(small_run: str, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    before = run_files(small_run)
    store = os.path.join(small_run, "tensorlens.sqlite")
    assert main([command, small_run, "-o", store]) == 1
    assert "run store file" in one_error(capsys)
    assert run_files(small_run) == before
    with tl.open_run(small_run) as run:
        assert run.steps() == [0, 1, 2]


def test_every_way_to_reach_a_run_file_is_refused(small_run: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    before = run_files(small_run)
    store = os.path.join(small_run, "tensorlens.sqlite")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(store, elsewhere / "link.csv")  # a symbolic link to the store
    os.link(store, elsewhere / "hard.csv")  # a hard link to the store, outside the run folder
    os.symlink(small_run, elsewhere / "run-link")  # a link to the run folder
    with open(os.path.join(small_run, "notes.txt"), "w") as f:
        f.write("mine\n")
    before["notes.txt"] = digest(os.path.join(small_run, "notes.txt"))
    other = write_store(str(tmp_path / "other"), ["weights/x"], ("l2",))
    os.link(os.path.join(other, "tensorlens.sqlite"), elsewhere / "other-store.html")  # another run's store
    cases = {
        str(elsewhere / "link.csv"): "run store file",
        str(elsewhere / "hard.csv"): "same file as",
        str(elsewhere / "run-link" / "tensorlens.sqlite"): "run store file",
        os.path.join(small_run, "tensorlens.sqlite-wal"): "run store file",
        os.path.join(small_run, "tensorlens-1.sqlite"): "name of a run store file",  # not there yet: still refused
        os.path.join(small_run, "notes.txt"): "a file of the run folder",
        str(elsewhere / "other-store.html"): "SQLite database",
        small_run: "is a folder",
    }
    for target, why in cases.items():
        for command in ("export", "report"):
            assert main([command, small_run, "-o", target]) == 1, (command, target)
            assert why in one_error(capsys), (command, target)
    assert run_files(small_run) == before
    assert not os.path.exists(os.path.join(small_run, "tensorlens-1.sqlite"))
    # a new file next to the store is fine, and the API refuses what the CLI refuses
    assert main(["export", small_run, "-o", os.path.join(small_run, "small.csv")]) == 0
    with pytest.raises(PermissionError, match="run store file"):
        tl.report(small_run, path=os.path.join(small_run, "tensorlens.sqlite"))
    with pytest.raises(PermissionError, match="same file as|SQLite"):
        tl.explore(small_run, path=str(elsewhere / "hard.csv"))


def test_a_regular_file_is_replaced_whole(small_run: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out" / "small.csv"
    out.parent.mkdir()
    out.write_text("old\n")
    os.chmod(out, 0o640)
    link = tmp_path / "out" / "latest.csv"
    os.symlink(out, link)
    assert main(["export", small_run, "-o", str(link)]) == 0
    assert os.path.islink(link) and out.read_text().startswith("step,mode,mode_step")  # written through the link
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o640  # its permissions kept
    assert sorted(os.listdir(out.parent)) == ["latest.csv", "small.csv"]  # no temporary file left


def _drain(path: str, into: list[bytes]) -> threading.Thread:
    def read() -> None:
        with open(path, "rb") as f:
            into.append(f.read())

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("command", ["export", "report", "explore"])
def test_a_fifo_is_written_into_and_stays_a_fifo(small_run: str, tmp_path, command: str) -> None:
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = _drain(fifo, got)
    assert main([command, small_run, "-o", fifo]) == 0
    reader.join(timeout=60)
    assert not reader.is_alive() and stat.S_ISFIFO(os.stat(fifo).st_mode)
    text = got[0].decode("utf-8")
    assert text.startswith("step,mode,mode_step,worker") if command == "export" else text.startswith("<!DOCTYPE html>")
    assert sorted(os.listdir(tmp_path)) == ["pipe", "runs"]


def test_parquet_into_a_fifo(small_run: str, tmp_path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    import io

    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = _drain(fifo, got)
    assert main(["export", small_run, "--format", "parquet", "-o", fifo]) == 0
    reader.join(timeout=60)
    assert pq.read_table(io.BytesIO(got[0])).num_rows == 3 * (2 * 7 + 1)


@pytest.fixture
def full_device(tmp_path) -> str:
    """A character device with /dev/full's numbers (writes fail with ENOSPC), made in tmp: never a
    test output under /dev (FACTS.md)."""
    path = str(tmp_path / "full")
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 7))
        with open(path, "wb") as f:
            f.write(b"x")
            f.flush()
    except PermissionError:
        pytest.skip("making a device node needs root (CAP_MKNOD)")
    except OSError as err:
        if err.errno != 28:  # ENOSPC is the point; anything else: devices are not usable here (nodev mount)
            pytest.skip(f"this device node cannot be opened here: {err}")
    return path


@pytest.mark.parametrize("command", ["export", "report"])
def test_a_full_device_is_one_error_and_stays_a_device(small_run: str, full_device: str, command: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, small_run, "-o", full_device]) == 1
    assert "No space left on device" in one_error(capsys)
    info = os.stat(full_device)
    assert stat.S_ISCHR(info.st_mode) and info.st_rdev == os.makedev(1, 7)
    assert sorted(os.listdir(os.path.dirname(full_device))) == ["full", "runs"]  # no temporary file left


def test_paths_that_cannot_be_written_are_one_error(small_run: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    os.symlink(tmp_path / "loop-b", tmp_path / "loop-a")
    os.symlink(tmp_path / "loop-a", tmp_path / "loop-b")
    assert main(["export", small_run, "-o", str(tmp_path / "loop-a")]) == 1
    assert "Too many levels of symbolic links" in one_error(capsys)
    assert main(["report", small_run, "-o", str(tmp_path / "missing" / "r.html")]) == 1
    assert "No such file or directory" in one_error(capsys)
    assert main(["export", small_run, "-o", ""]) == 1
    assert "empty" in one_error(capsys)


def test_a_socket_is_refused_and_left_alone(small_run: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    path = str(tmp_path / "sock")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        assert main(["export", small_run, "-o", path]) == 1
        assert "it is a socket" in one_error(capsys)
        assert stat.S_ISSOCK(os.stat(path).st_mode)
