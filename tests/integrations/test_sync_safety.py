"""``tensorlens sync`` when things go wrong around it, with real processes, signals, files and
users: two syncs of one run at once, SIGTERM mid-sync, a crafted sync state naming a folder
outside ``--logdir``, sources it must only read (an empty store, a symlinked store, a read-only
run folder, a run synced by the previous release), and the command's errors (one ``Error:``
line, exit 1). TensorBoard keeps every event it is given, so a resend shows as a duplicate."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
from unprivileged import NOBODY, can_run_as_nobody

import tensorlens as tl
from tensorlens.store.schema import with_checksum
from tensorlens.sync import sync_run
from tensorlens.sync.state import SYNC_SCHEMA, SyncState, locate

pytest.importorskip("tensorboard")
pytest.importorskip("click")

try:  # tests/integrations may or may not be a package
    from .test_sync import tb_events, the_one_folder, train
except ImportError:
    from test_sync import tb_events, the_one_folder, train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the real command, with TensorBoardBackend.write slowed down (and a marker file once some records
# are written) so that a test can act while the sync is surely in the middle
SLOW_SYNC = r"""
import os, sys, time
from tensorlens.integrations.tensorboard import TensorBoardBackend
write, count = TensorBoardBackend.write, 0
def slow_write(self, record):
    global count
    write(self, record)
    count += 1
    if count == int(os.environ["TL_TEST_MARK_AFTER"]):
        open(os.environ["TL_TEST_MARKER"], "w").close()
        release, deadline = os.environ.get("TL_TEST_RELEASE"), time.monotonic() + 300
        while release and not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)  # held mid-sync until the test has done what it must do meanwhile
    time.sleep(float(os.environ["TL_TEST_DELAY"]))
TensorBoardBackend.write = slow_write
from tensorlens.cli import main
sys.exit(main(sys.argv[1:]))
"""


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": ROOT, **extra}


def start_slow_sync(run_dir: str, logdir: str, marker: str, mark_after: int, delay: float,
                    release: str = "") -> subprocess.Popen[str]:
    """The sync, slowed by ``delay`` per record; with ``release``, also held after ``mark_after``
    records until that file exists (so a busy machine cannot let it finish too early)."""
    command = [sys.executable, "-c", SLOW_SYNC, "sync", run_dir, "--to", "tensorboard", "--logdir", logdir, "--no-progress"]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env(TL_TEST_MARKER=marker, TL_TEST_MARK_AFTER=str(mark_after), TL_TEST_DELAY=str(delay), TL_TEST_RELEASE=release),
    )


def wait_for(marker: str, process: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(marker):
        if process.poll() is not None:
            out, err = process.communicate()
            pytest.fail(f"the sync ended (exit {process.returncode}) before the marker:\n{out}\n{err}")
        assert time.monotonic() < deadline, "the sync did not start in time"
        time.sleep(0.05)


def cli(*args: str, user: list[str] | None = None, cwd: str | None = None, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess[str]:
    """``python -m tensorlens ARGS`` in a process of its own (as ``user`` when given, in a
    working folder that user can enter)."""
    command = [*(user or []), sys.executable, "-m", "tensorlens", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env(**extra), cwd=cwd or os.getcwd())


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, done.stderr
    return errors[0]


def each_event_once(folder: str) -> int:
    """Every (tag, step) of the TensorBoard run once; returns how many scalar events it holds."""
    scalars, histograms, _ = tb_events(folder)
    assert all(len(v) == 1 for v in scalars.values()), [k for k, v in scalars.items() if len(v) > 1][:5]
    assert all(len(v) == 1 for v in histograms.values())
    return len(scalars)


def records_of(run_dir: str) -> int:
    with tl.open_run(run_dir) as stored:
        return len(stored.step_keys())


def fingerprint(path: str) -> tuple[str, int, int]:
    with open(path, "rb") as f:
        data = f.read()
    info = os.stat(path)
    return hashlib.sha256(data).hexdigest(), info.st_size, info.st_mtime_ns


@pytest.fixture
def shared_tmp() -> Iterator[str]:
    """A folder other users can reach (pytest's own is private to root)."""
    folder = tempfile.mkdtemp(prefix="tensorlens-sync-test-")
    os.chmod(folder, 0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def needs_nobody() -> None:
    if not can_run_as_nobody():
        pytest.skip("runs a command as an unprivileged user: needs root, setpriv and a checkout nobody can read")


# ---------------------------------------------------------------------------------------- two at once


def test_a_second_sync_of_the_run_to_the_destination_fails_at_once_and_nothing_is_sent_twice(tmp_path: Any) -> None:
    run_dir = train(str(tmp_path / "run"), ["local"], steps=16)
    logdir, marker = str(tmp_path / "tb"), str(tmp_path / "started")
    release = str(tmp_path / "release")
    first = start_slow_sync(run_dir, logdir, marker, mark_after=2, delay=0.05, release=release)
    try:
        wait_for(marker, first)
        started = time.monotonic()
        second = cli("sync", run_dir, "--to", "tensorboard", "--logdir", logdir, "--no-progress")
        line = one_error_line(second)
        assert "another tensorlens sync of" in line and f"tensorboard:{logdir}" in line and "pid " in line
        assert time.monotonic() - started < 60  # the time to start Python, no waiting
        # another destination of the same run is not held up
        other = cli("sync", run_dir, "--to", "tensorboard", "--logdir", str(tmp_path / "tb2"), "--no-progress")
        assert other.returncode == 0, other.stderr
        assert first.poll() is None  # still held in the middle: the refusal above was a real overlap
        open(release, "w").close()
        out, err = first.communicate(timeout=180)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    folder = the_one_folder(logdir)
    each_event_once(folder)
    again = sync_run(run_dir, "tensorboard", logdir=logdir, progress=False)  # the lock was let go
    assert again.records_sent == 0 and again.already_sent == records_of(run_dir)


# ---------------------------------------------------------------------------------------- SIGTERM


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_mid_sync_saves_progress_and_the_next_sync_sends_only_the_rest(tmp_path: Any, signum: int) -> None:
    run_dir = train(str(tmp_path / "run"), ["local"], steps=16)
    logdir, marker = str(tmp_path / "tb"), str(tmp_path / "started")
    child = start_slow_sync(run_dir, logdir, marker, mark_after=3, delay=0.4)
    try:
        wait_for(marker, child)
        child.send_signal(signum)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert "Traceback" not in err, err
    if signum == signal.SIGTERM:  # 128 + 15, as 130 is 128 + SIGINT
        assert child.returncode == 143, (child.returncode, err)
        assert "Terminated: tensorlens sync to tensorboard:" in err and "stopped by SIGTERM" in err
    else:
        assert child.returncode == 130 and err.strip() in ("Aborted.", "Interrupted."), (child.returncode, err)
    total = records_of(run_dir)
    rest = sync_run(run_dir, "tensorboard", logdir=logdir, progress=False)
    assert 3 <= rest.already_sent < total and rest.already_sent + rest.records_sent == total
    each_event_once(the_one_folder(logdir))


# ---------------------------------------------------------------------------------------- crafted state


def legacy_tables(store: str, rows: list[tuple[str, str, int, dict[str, Any]]], progress: list[tuple[Any, ...]] = ()) -> None:
    """Sync tables inside the store, as the previous release kept them (``(target, run_id,
    findings_sent, info)`` rows, ``(target, mode, worker, mode_step, step)`` progress)."""
    import json

    db = sqlite3.connect(store)
    with db:
        db.executescript(SYNC_SCHEMA.replace("CREATE TABLE IF NOT EXISTS sync_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);", ""))
        for target, run_id, findings, info in rows:
            db.execute("INSERT INTO sync_targets VALUES (?, ?, ?, ?, ?, ?)",
                       with_checksum(target, run_id, findings, json.dumps(info, sort_keys=True), 1.5))
        for row in progress:
            db.execute("INSERT INTO sync_progress VALUES (?, ?, ?, ?, ?, ?)", with_checksum(*row))
    db.close()


@pytest.mark.parametrize("where", ["state", "previous release"])
def test_a_run_id_from_the_state_never_names_a_folder_outside_the_logdir(tmp_path: Any, where: str) -> None:
    run_dir = train(str(tmp_path / "run"), ["local"], steps=3)
    logdir = tmp_path / "logs" / "tb"
    key = f"tensorboard:{logdir}"
    if where == "previous release":
        legacy_tables(os.path.join(run_dir, "tensorlens.sqlite"), [(key, "../escaped", 0, {})])
    else:
        sync_run(run_dir, "tensorboard", logdir=str(logdir), progress=False)
        train(run_dir, ["local"], steps=3, resume="allow", seed=1)
        db = sqlite3.connect(locate(os.path.join(run_dir, "tensorlens.sqlite")).path)
        with db:  # a row rewritten with a checksum that matches
            _, _, findings, info, created, _ = db.execute("SELECT * FROM sync_targets").fetchone()
            db.execute("DELETE FROM sync_targets")
            db.execute("INSERT INTO sync_targets VALUES (?, ?, ?, ?, ?, ?)",
                       with_checksum(key, "../escaped", findings, info, created))
        db.close()
    with pytest.raises(tl.CorruptRunError, match=r"tracker run id '\.\./escaped' is not one.*--new-run"):
        sync_run(run_dir, "tensorboard", logdir=str(logdir), progress=False)
    assert (sorted(os.listdir(tmp_path / "logs")) if os.path.exists(tmp_path / "logs") else []) == (
        ["tb"] if where == "state" else []
    )
    # the command says so in one line; --new-run starts over inside the logdir
    done = cli("sync", run_dir, "--to", "tensorboard", "--logdir", str(logdir), "--no-progress")
    assert "tracker run id '../escaped'" in one_error_line(done)
    assert cli("sync", run_dir, "--to", "tensorboard", "--logdir", str(logdir), "--new-run").returncode == 0
    assert os.listdir(tmp_path / "logs") == ["tb"]


# ---------------------------------------------------------------------------------------- read-only sources


def test_an_empty_store_is_one_clear_error_and_stays_empty(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from tensorlens.cli import main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "tensorlens.sqlite").write_bytes(b"")
    assert main(["sync", str(run_dir), "--to", "tensorboard", "--logdir", str(tmp_path / "tb"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Error: no tensorlens run recorded at") and "an empty file" in err and err.count("\n") == 1
    assert os.path.getsize(run_dir / "tensorlens.sqlite") == 0
    assert os.listdir(run_dir) == ["tensorlens.sqlite"] and not os.path.exists(tmp_path / "tb")


def test_a_symlinked_store_is_read_and_its_target_is_never_written(tmp_path: Any) -> None:
    other = train(str(tmp_path / "other"), ["local"], steps=4)
    target = os.path.join(other, "tensorlens.sqlite")
    before, listing = fingerprint(target), sorted(os.listdir(other))
    run_dir = tmp_path / "linked"
    run_dir.mkdir()
    os.symlink(target, run_dir / "tensorlens.sqlite")
    result = sync_run(str(run_dir), "tensorboard", logdir=str(tmp_path / "tb"), progress=False)
    assert result.records_sent == records_of(other)
    assert sync_run(str(run_dir), "tensorboard", logdir=str(tmp_path / "tb"), progress=False).records_sent == 0
    assert fingerprint(target) == before  # byte for byte, and not even touched
    # no state beside the link's target (SQLite's own -wal/-shm of a WAL reader are the reader's)
    assert sorted(n for n in os.listdir(other) if not n.endswith(("-wal", "-shm"))) == listing
    assert os.path.isfile(run_dir / "sync" / "state.sqlite")


def test_a_run_synced_by_the_previous_release_continues(tmp_path: Any) -> None:
    run_dir = train(str(tmp_path / "run"), ["local"], steps=6)
    logdir = str(tmp_path / "tb")
    first = sync_run(run_dir, "tensorboard", logdir=logdir, progress=False)
    state = locate(os.path.join(run_dir, "tensorlens.sqlite")).path
    with SyncState(state) as s:  # what the previous release kept in the store itself
        known = s.target(first.target)
        progress = s.progress(first.target)
    shutil.rmtree(os.path.dirname(state))
    train(run_dir, ["local"], steps=4, resume="allow", seed=1)
    store = os.path.join(run_dir, "tensorlens.sqlite")
    legacy_tables(store, [(known.target, known.run_id, known.findings_sent, known.info)],
                  [(first.target, mode, worker, ms, step) for (mode, worker), (ms, step) in progress.items()])
    before = fingerprint(store)
    again = sync_run(run_dir, "tensorboard", logdir=logdir, progress=False)
    assert again.run_id == first.run_id and not again.new_run and again.already_sent == first.records_sent
    assert again.records_sent == records_of(run_dir) - first.records_sent
    each_event_once(the_one_folder(logdir))
    assert fingerprint(store) == before  # read, never changed: the old tables stay as they were
    with SyncState(state) as s:
        assert s.progress(first.target) != progress  # the state file goes on from them


def test_a_read_only_run_folder_syncs_with_its_state_in_the_users_folder(shared_tmp: str) -> None:
    needs_nobody()
    run_dir = train(os.path.join(shared_tmp, "runs"), ["local"], steps=4)  # root's, 0755: others only read it
    logdir, home = os.path.join(shared_tmp, "tb"), os.path.join(shared_tmp, "home")
    for folder in (logdir, home):
        os.mkdir(folder)
        os.chmod(folder, 0o777)
    store = os.path.join(run_dir, "tensorlens.sqlite")
    total = records_of(run_dir)  # (root's reader may leave SQLite's -wal/-shm: before the listing)
    before, listing = fingerprint(store), sorted(os.listdir(run_dir))
    done = cli("sync", run_dir, "--to", "tensorboard", "--logdir", logdir, "--no-progress", user=NOBODY,
               cwd=shared_tmp, XDG_STATE_HOME=home, HOME=home)
    if done.returncode != 0 and "corrupt run store" in done.stderr and "readonly database" in done.stderr:  # the reader's
        pytest.xfail(f"the reader cannot open a WAL store in a folder it cannot write yet: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert f"{total} new records" in done.stdout
    assert fingerprint(store) == before and sorted(os.listdir(run_dir)) == listing
    states = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(home, "tensorlens", "sync")) for f in files if f.endswith(".sqlite")]
    assert len(states) == 1 and os.stat(states[0]).st_uid == 65534
    again = cli("sync", run_dir, "--to", "tensorboard", "--logdir", logdir, "--no-progress", user=NOBODY,
                cwd=shared_tmp, XDG_STATE_HOME=home, HOME=home)
    assert again.returncode == 0 and "0 new records" in again.stdout, again.stderr
    each_event_once(the_one_folder(logdir))


# ---------------------------------------------------------------------------------------- the command's errors


def test_a_read_only_logdir_is_one_error_line(shared_tmp: str) -> None:
    needs_nobody()
    run_dir = train(os.path.join(shared_tmp, "runs"), ["local"], steps=2)
    os.chmod(run_dir, 0o777)  # the run folder is the user's: only the logdir is read-only
    os.chmod(os.path.join(run_dir, "tensorlens.sqlite"), 0o666)
    logdir = os.path.join(shared_tmp, "tb")
    os.mkdir(logdir)  # root's, 0755
    done = cli("sync", run_dir, "--to", "tensorboard", "--logdir", logdir, "--no-progress", user=NOBODY,
               cwd=shared_tmp, HOME=shared_tmp)
    line = one_error_line(done)
    assert "tensorlens sync" in line and "Permission denied" in line
    assert os.listdir(logdir) == []


def test_a_store_damaged_midway_is_one_error_line_and_what_was_sent_stays_sent(tmp_path: Any) -> None:
    run_dir = train(str(tmp_path / "run"), ["local"], steps=16)
    db = sqlite3.connect(os.path.join(run_dir, "tensorlens.sqlite"))
    with db:  # the last train step's scalars row damaged (a flipped bit the checksum catches)
        db.execute("UPDATE scalars SET crc = crc + 1 WHERE mode = 'train' AND mode_step = (SELECT max(mode_step) "
                   "FROM scalars WHERE mode = 'train')")
    db.close()
    done = cli("sync", run_dir, "--to", "tensorboard", "--logdir", str(tmp_path / "tb"), "--no-progress")
    line = one_error_line(done)
    assert "stopped after" in line and "corrupt run store" in line and "run the same sync again" in line
    with SyncState(locate(os.path.join(run_dir, "tensorlens.sqlite")).path) as state:
        (target,) = state.targets()
        assert state.progress(target.target)  # the records before the damage are marked as sent


def test_another_users_sync_continues_from_the_state_in_the_run_folder(shared_tmp: str) -> None:
    """Root synced the run (its state in RUN/sync, which others may only read); another user's
    sync of the run to the same destination continues from there, its state in its own folder."""
    needs_nobody()
    run_dir = train(os.path.join(shared_tmp, "runs"), ["local"], steps=4)
    logdir, home = os.path.join(shared_tmp, "tb"), os.path.join(shared_tmp, "home")
    first = sync_run(run_dir, "tensorboard", logdir=logdir, progress=False)
    train(run_dir, ["local"], steps=4, resume="allow", seed=1)
    total = records_of(run_dir)
    os.mkdir(home)
    for folder in (home, logdir, os.path.join(logdir, first.run_id)):
        os.chmod(folder, 0o777)
    for name in os.listdir(os.path.join(logdir, first.run_id)):
        os.chmod(os.path.join(logdir, first.run_id, name), 0o666)
    mine = locate(os.path.join(run_dir, "tensorlens.sqlite")).path
    before = fingerprint(mine)
    done = cli("sync", run_dir, "--to", "tensorboard", "--logdir", logdir, "--no-progress", user=NOBODY,
               cwd=shared_tmp, XDG_STATE_HOME=home, HOME=home)
    assert done.returncode == 0, done.stderr
    assert f"{total - first.records_sent} new records" in done.stdout and f"continued run {first.run_id}" in done.stdout
    assert fingerprint(mine) == before  # root's state is only read
    each_event_once(the_one_folder(logdir))
