"""SIGTERM during a sync: stop between two records and keep what was sent, as Ctrl-C does.

By default SIGTERM ends the process at once, like ``kill -9``: the records sent since the last
checkpoint are not marked and the next sync sends them again. While a sync runs in the main
thread (and nobody else has a SIGTERM handler), :func:`stop_on_sigterm` notes the signal instead;
the replay checks :meth:`Termination.check` after each record and raises
:class:`~tensorlens.sync.errors.SyncTerminated` there, never in the middle of a record a tracker
is half-way through. Later SIGTERMs are ignored while the sync saves its progress and closes the
tracker run (bounded: see the targets' network timeouts); the handler is restored afterwards.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from tensorlens.sync.errors import SyncTerminated


class Termination:
    """Whether SIGTERM arrived; :meth:`check` raises :class:`SyncTerminated` once it has."""

    def __init__(self) -> None:
        self.signalled = False

    def check(self, what: str) -> None:
        if self.signalled:
            raise SyncTerminated(what)


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[Termination]:
    termination = Termination()
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield termination  # a handler of the program's own (or no way to set one): left alone
        return

    def noted(signum: int, frame: FrameType | None) -> None:
        termination.signalled = True
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # saving the progress is not cut short

    signal.signal(signal.SIGTERM, noted)
    try:
        yield termination
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
