"""Opening a store file for reading without any write access: a read-only mount, an unpacked
archive, a colleague's run folder.

A store is in WAL mode, and SQLite reading a WAL database wants its ``-shm`` index beside it,
which it must create when it is missing: in a folder the reader cannot write, ``mode=ro`` then
fails ("attempt to write a readonly database"; https://www.sqlite.org/wal.html, "Read-Only
Databases"). Which of SQLite's ways applies depends on the files the writer left:

- ``-wal`` and ``-shm`` both there (a run being written, or one whose writer crashed): ``mode=ro``
  works, ``-shm`` read-only included, and sees every committed step;
- neither (the writer closed: its last connection checkpointed the log into the store file and
  removed both): the store file alone holds everything, and ``immutable=1`` reads it without
  any ``-shm``;
- a ``-wal`` holding frames but no ``-shm`` (an archive that kept one and not the other): steps
  may live only in the log, which SQLite cannot read without creating ``-shm``, and
  ``immutable=1`` would silently read the store without them. That is refused with what to do.

``immutable=1`` tells SQLite the file never changes: it takes no locks and never looks at a log.
It is therefore used only as the last resort above, when the folder really is not writable and
no log holds frames. A writer that starts on the same file afterwards (one with write access,
resuming the run) is not seen by a reader opened so: it keeps reading the store as it was.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

__all__ = ["connect_readonly"]

#: A log no longer than its header holds no frame (https://www.sqlite.org/fileformat.html#wal_file_format).
_WAL_HEADER = 32
_SQLITE_READONLY, _SQLITE_CANTOPEN = 8, 14


def connect_readonly(path: str, timeout: float = 10) -> sqlite3.Connection:
    """A read-only connection to the SQLite file ``path``, opened and usable without write access
    to it or its folder. Raises :class:`PermissionError` when the file's steps cannot all be read
    without write access (see the module's docstring), and SQLite's own errors for a damaged file."""
    # a URI, percent-encoded: a path holding "?" or "#" must not end the file name early
    uri = Path(path).absolute().as_uri()
    db = sqlite3.connect(uri + "?mode=ro", uri=True, timeout=timeout, check_same_thread=False)
    try:
        db.execute("SELECT count(*) FROM sqlite_master").fetchall()  # SQLite opens the file and its log here
        return db
    except sqlite3.OperationalError as err:
        db.close()
        if not _needs_write_access(err) or os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
            raise
    wal = path + "-wal"
    if _holds_frames(wal):
        raise PermissionError(
            errno.EACCES,
            f"{wal!r} holds steps not yet in the store file, and SQLite reads them only where it may create "
            f"{os.path.basename(path)}-shm beside it; this folder is not writable. Copy the run folder "
            "(with its -wal file) somewhere writable and open the copy",
        )
    db = sqlite3.connect(uri + "?mode=ro&immutable=1", uri=True, timeout=timeout, check_same_thread=False)
    try:
        db.execute("SELECT count(*) FROM sqlite_master").fetchall()
    except BaseException:
        db.close()
        raise
    return db


def _needs_write_access(err: sqlite3.OperationalError) -> bool:
    """Whether SQLite failed for want of creating or writing ``-shm`` (or the log)."""
    code = getattr(err, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in (_SQLITE_READONLY, _SQLITE_CANTOPEN)
    message = str(err)
    return "readonly database" in message or "unable to open database file" in message


def _holds_frames(wal: str) -> bool:
    try:
        return os.stat(wal).st_size > _WAL_HEADER
    except FileNotFoundError:
        return False
    except OSError:  # there, but not even stat-able: do not guess that it is empty
        return True
