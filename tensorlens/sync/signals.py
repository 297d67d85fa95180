"""SIGTERM and Ctrl-C during a sync: stop between two records and keep what was sent.

By default SIGTERM ends the process at once, like ``kill -9``: the records sent since the last
checkpoint are not marked and the next sync sends them again; and Ctrl-C raises wherever the
program is, possibly half-way through a record a tracker has partly written (its points would
be sent again with the rest of it next time). While a sync runs in the main thread,
:func:`stop_on_signals` notes either signal instead (where the program has not set a handler of
its own); the replay calls :meth:`Termination.check` after each record, which raises there:
:class:`~tensorlens.sync.errors.SyncTerminated` for SIGTERM, ``KeyboardInterrupt`` for Ctrl-C.
The sync then saves its progress and closes the tracker run. A second Ctrl-C raises at once (a
tracker that does not answer); later SIGTERMs are ignored while it saves (bounded: see the
targets' network timeouts). A signal noted after the last record still ends the sync that way,
once it is complete. The handlers are restored afterwards.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from tensorlens.sync.errors import SyncTerminated


class Termination:
    """The signal that arrived, if any; :meth:`check` raises once one has."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def check(self, what: str) -> None:
        if self.signal == signal.SIGTERM:
            raise SyncTerminated(what)
        if self.signal == signal.SIGINT:
            raise KeyboardInterrupt


@contextlib.contextmanager
def stop_on_signals() -> Iterator[Termination]:
    termination = Termination()
    if threading.current_thread() is not threading.main_thread():
        yield termination  # signals reach the main thread only: nothing to note here
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if termination.signal is None:
            termination.signal = signum
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # saving the progress is not cut short

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if termination.signal is not None:
            raise KeyboardInterrupt  # the second Ctrl-C: at once
        termination.signal = signum

    # only where the program left the defaults: a handler of its own is its own business
    replaced = {}
    for signum, handler, default in ((signal.SIGTERM, on_sigterm, signal.SIG_DFL),
                                     (signal.SIGINT, on_sigint, signal.default_int_handler)):
        previous = signal.getsignal(signum)
        if previous is default:
            replaced[signum] = previous
            signal.signal(signum, handler)
    try:
        yield termination
        termination.check("tensorlens sync stopped by SIGTERM once it had sent everything; what was sent is recorded")
    finally:
        for signum, previous in replaced.items():
            signal.signal(signum, previous)
