"""One sync of a run to a destination at a time: an OS file lock held for the whole sync.

Two syncs of one run to one destination at once (an overlapping cron job) would both read the
same progress and both send every step. Each takes an exclusive, non-blocking lock on
``<state folder>/<hash of the destination>.lock`` first; the second fails at once with
:class:`SyncBusyError` (the first one sends everything; the next scheduled sync continues after
it). The OS releases the lock when the process ends, however it ends (``kill -9`` included),
so a lock is never left behind. The file stays (removing it would let a third sync lock a new
file while the second still holds the old one); it holds the pid of its last holder, for the
message.
"""

from __future__ import annotations

import errno
import hashlib
import os
import time

from tensorlens.sync.errors import SyncBusyError


class SyncLock:
    """``with SyncLock(folder, key, what): ...``: raises :class:`SyncBusyError` when held elsewhere.

    >>> with SyncLock("runs/exp1/sync", "state.sqlite\\0tensorboard:/tmp/tb", "runs/exp1 to tensorboard:/tmp/tb"):  # doctest: +SKIP
    ...     pass
    """

    def __init__(self, folder: str, key: str, what: str) -> None:
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:24]
        self.path = os.path.join(folder, f"{digest}.lock")
        self.what = what
        self._fd: int | None = None

    def __enter__(self) -> SyncLock:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags, 0o666)
        except OSError as err:
            raise PermissionError(f"tensorlens sync cannot create its lock file {self.path} ({err.strerror or err})") from None
        try:
            if not _try_lock(fd):
                holder = _read(fd)
                raise SyncBusyError(
                    f"another tensorlens sync of {self.what} is running{f' ({holder})' if holder else ''}; "
                    "run this one again after it ends (it continues from there)"
                )
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


def _try_lock(fd: int) -> bool:
    try:
        import fcntl
    except ImportError:  # Windows: a lock on the first byte, also released when the process ends
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)  # type: ignore[attr-defined]
            return True
        except OSError:
            return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def _read(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, 200).decode("utf-8", "replace").strip()
    except OSError:
        return ""
