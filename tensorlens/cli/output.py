"""The files the commands write (``export -o``, ``report -o``, ``explore -o``, ``tl.report(path=...)``):
the one place that decides where a page or a table may be written, and how.

Two rules, both about not destroying what the user has:

- **Never over a run.** A run store is the only copy of a training run's statistics; ``-o
  RUN/tensorlens.sqlite`` must not replace it. Refused: a path whose real location (symbolic links
  resolved) is a file of a run folder (a folder holding a tensorlens store: the store, its ``-wal``,
  ``-shm`` and ``-journal``, any other file there) or has a store file's name; a path that is the
  same file (device and inode) as a file of the runs being read, which catches a hard link; and an
  existing SQLite database or WAL file anywhere (a hard link to some other run's store).
- **Special files are written into, not replaced.** A regular file (or a new path) is written to a
  temporary file beside it and renamed over it, so a half-written page is never left behind. A
  FIFO (``-o >(gzip > x.gz)``) or a character device is opened and written like ``cat > path``
  would: renaming over it would turn the FIFO or the device node into a regular file. A write
  error there (``ENOSPC`` on a full device) is one ``Error:`` line.

Errors are ordinary exceptions (``PermissionError``, ``IsADirectoryError``, ``OSError``) with
one-line messages: the CLI prints them as ``Error: ...``; the Python API raises them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from typing import IO, Any

#: The first bytes of an SQLite database and of its write-ahead log (both byte orders of the magic).
_SQLITE_HEADER = b"SQLite format 3\x00"
_WAL_MAGICS = (b"\x37\x7f\x06\x82", b"\x37\x7f\x06\x83")
_STORE_SUFFIXES = ("", "-wal", "-shm", "-journal")


def _is_store_name(name: str) -> bool:
    from tensorlens.store.schema import FILE_PATTERN

    for suffix in _STORE_SUFFIXES:
        if name.endswith(suffix) and FILE_PATTERN.match(name[: len(name) - len(suffix)] if suffix else name):
            return True
    return False


def _is_run_folder(folder: str) -> bool:
    from tensorlens.store.schema import FILE_PATTERN

    try:
        return any(FILE_PATTERN.match(n) for n in os.listdir(folder))
    except OSError:
        return False


def _run_files(runs: Iterable[str]) -> dict[tuple[int, int], str]:
    """``(st_dev, st_ino) -> path`` of every file directly inside the run folders (or store files) read."""
    found: dict[tuple[int, int], str] = {}
    for run in runs:
        run = os.fspath(run)
        folder = run if os.path.isdir(run) else os.path.dirname(run) or "."
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError):
                info = os.stat(path)
                if stat.S_ISREG(info.st_mode):
                    found[(info.st_dev, info.st_ino)] = path
    return found


def _looks_like_sqlite(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(len(_SQLITE_HEADER))
    except OSError:
        return False
    return head == _SQLITE_HEADER or head[:4] in _WAL_MAGICS


def check_output(path: str | os.PathLike[str], runs: Iterable[str] = ()) -> str:
    """The real path an output file may be written to, or an exception saying why not (see the
    module's docstring). ``runs`` are the run folders (or store files) the command reads."""
    path = os.fspath(path)
    if path == "":
        raise ValueError("the output path is empty")
    real = os.path.realpath(path)
    try:
        info: os.stat_result | None = os.stat(real)
    except FileNotFoundError:
        info = None
    except OSError as err:  # a symbolic link loop, a name too long, a folder that cannot be searched
        raise OSError(f"cannot write {path!r}: {err.strerror or err}") from None
    folder, name = os.path.split(real)
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(f"{path!r} is a folder; give a file name")
    refuse = f"refusing to write over {path!r}"
    if _is_store_name(name):
        raise PermissionError(f"{refuse}: {'it is' if info else 'it has the name of'} a run store file; "
                              "choose another output")
    if info is not None and not stat.S_ISREG(info.st_mode):
        if stat.S_ISFIFO(info.st_mode) or stat.S_ISCHR(info.st_mode):
            return real  # written into as it is (see open_output)
        from tensorlens.store.schema import file_kind

        raise PermissionError(f"{refuse}: it is {file_kind(info.st_mode)}")
    if info is not None and _is_run_folder(folder):
        raise PermissionError(f"{refuse}: it is a file of the run folder {folder!r}; choose another output")
    if info is not None:
        same = _run_files(runs).get((info.st_dev, info.st_ino))
        if same is not None:
            raise PermissionError(f"{refuse}: it is the same file as {same!r} of a run being read (a hard link)")
        if _looks_like_sqlite(real):
            raise PermissionError(f"{refuse}: it is an SQLite database (a run store?); choose another output")
    return real


@contextlib.contextmanager
def open_output(path: str | os.PathLike[str], runs: Iterable[str] = (), binary: bool = False) -> Iterator[IO[Any]]:
    """``with open_output(path, runs) as f: f.write(...)``: a text (UTF-8, ``\\n`` line ends) or
    binary file object for ``path``, checked by :func:`check_output`. A regular file appears
    whole on success and is left untouched on failure; a FIFO or a character device is written
    into directly."""
    shown = os.fspath(path)
    real = check_output(path, runs)
    try:
        info: os.stat_result | None = os.stat(real)
    except FileNotFoundError:
        info = None
    special = info is not None and not stat.S_ISREG(info.st_mode)
    folder, name = os.path.split(real)
    if special:
        target = real
        # no O_CREAT: if the FIFO went away since the check, fail rather than create a regular file
        flags, mode = os.O_WRONLY, 0
    else:
        target = os.path.join(folder, f".{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        mode = stat.S_IMODE(info.st_mode) if info is not None else 0o666  # the umask applies to a new file
    try:
        fd = os.open(target, flags | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as err:
        raise OSError(f"cannot write {shown!r}: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8", "newline": ""})) as f:
            yield f
        if not special:
            os.replace(target, real)
    except OSError as err:
        if not special:
            with contextlib.suppress(OSError):
                os.remove(target)
        if err.errno is None:  # not the system's answer to a write: an error of the caller's own
            raise
        raise OSError(f"cannot write {shown!r}: {err.strerror or err}") from None
    except BaseException:
        if not special:
            with contextlib.suppress(OSError):
                os.remove(target)
        raise


def write_output(path: str | os.PathLike[str], text: str, runs: Iterable[str] = ()) -> str:
    """Write ``text`` to ``path`` through :func:`open_output`; returns ``path``."""
    with open_output(path, runs) as f:
        f.write(text)
    return os.fspath(path)
