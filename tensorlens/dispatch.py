"""The dispatcher: moves finished steps off the training thread and fans them out to backends.

Training thread --(bounded queue)--> dispatcher thread (builds the step's one record)
--> one bounded queue and thread per backend, all given the same immutable record. A backend that raises or falls behind is isolated:
one warning naming it, a counter of failed or dropped records, and nothing else is affected. The
local store is *critical*: it is never dropped, the dispatcher waits for it instead.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from tensorlens.backends.base import Backend, RunInfo
from tensorlens.records import StepRecord

_STOP = object()


@dataclasses.dataclass
class BackendStats:
    written: int = 0
    failed: int = 0
    dropped: int = 0


class _Channel:
    """One backend behind its own queue and thread."""

    def __init__(self, backend: Backend, run: RunInfo, max_pending: int) -> None:
        self.backend = backend
        self.stats = BackendStats()
        self._run = run
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_pending)
        self._warned = False
        self._opened = False
        self._open_failed = False
        self._stalled = False
        self._thread = threading.Thread(target=self._loop, name=f"tensorlens-{backend.name}", daemon=True)
        self._thread.start()

    @property
    def label(self) -> str:
        return f"{type(self.backend).__name__} ({self.backend.name!r})"

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"tensorlens: backend {self.label} {message}; training continues, "
                          "other backends are unaffected (this warning is shown once)", stacklevel=2)

    def submit(self, record: StepRecord) -> None:
        if self.backend.critical:
            self._queue.put(record)
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.stats.dropped += 1
            self._warn("is falling behind and records are being dropped")

    def _call(self, fn: Callable[[], None], what: str) -> bool:
        try:
            fn()
            return True
        except Exception as err:  # isolate any backend failure
            self._warn(f"failed in {what}: {type(err).__name__}: {err}")
            return False

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    self._call(self.backend.close, "close()")
                    return
                if isinstance(item, threading.Event):  # a flush marker
                    if self._opened:
                        self._call(self.backend.flush, "flush()")
                    item.set()
                    continue
                assert isinstance(item, StepRecord)
                if not self._opened:
                    self._opened = True
                    self._open_failed = not self._call(lambda: self.backend.open(self._run), "open()")
                if self._open_failed:  # every record of a backend that could not open is a failure
                    self.stats.failed += 1
                    continue
                record = item.without(histograms=not self.backend.supports_histograms, tensors=not self.backend.supports_tensors)
                if self._call(lambda record=record: self.backend.write(record), "write()"):
                    self.stats.written += 1
                else:
                    self.stats.failed += 1
            finally:
                self._queue.task_done()

    def flush(self, timeout: float | None) -> bool:
        done = threading.Event()
        try:  # a stalled backend's queue stays full: never wait on it longer than asked
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            self._stalled = True
            return False
        self._stalled = not done.wait(timeout)
        return not self._stalled

    def close(self, timeout: float | None) -> None:
        if self._stalled:  # it just failed to flush within the timeout: do not wait for it twice
            timeout = 0.0
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            return  # still stalled: leave its daemon thread behind rather than hang the caller
        self._thread.join(timeout)


class Dispatcher:
    """Turns pending steps into records on a background thread and hands them to every backend.

    ``submit(item)`` takes a :class:`StepRecord`, or anything ``build`` turns into one (the
    engine's pending step: its record is built here, off the training thread, once for all
    backends).
    """

    def __init__(
        self, backends: Sequence[Backend], run: RunInfo, max_pending: int = 64,
        build: Callable[[Any], StepRecord | None] | None = None,
    ) -> None:
        self._build = build
        self._channels = [_Channel(b, run, max_pending) for b in backends]
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_pending)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="tensorlens-dispatch", daemon=True)
        self._thread.start()

    @property
    def backends(self) -> list[Backend]:
        return [c.backend for c in self._channels]

    def stats(self) -> dict[str, BackendStats]:
        """Counters per backend, keyed by name (``name#2``, ... for a second backend of one name)."""
        out: dict[str, BackendStats] = {}
        for channel in self._channels:
            key, n = channel.backend.name, 1
            while key in out:
                n += 1
                key = f"{channel.backend.name}#{n}"
            out[key] = channel.stats
        return out

    def submit(self, item: Any) -> None:
        if self._closed:
            return
        self._queue.put(item)  # blocks only if records pile up faster than they are built

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if isinstance(item, threading.Event):
                    item.set()
                    continue
                try:
                    record = item if isinstance(item, StepRecord) or self._build is None else self._build(item)
                    if record is None:  # nothing to record (an epoch that saved no step)
                        continue
                    for channel in self._channels:
                        channel.submit(record)
                except Exception as err:  # a bug of ours must not take training down
                    warnings.warn(f"tensorlens: could not build a record: {type(err).__name__}: {err}", stacklevel=2)
                    continue
            finally:
                self._queue.task_done()

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Wait until every submitted step reached every backend and was flushed there."""
        if self._closed:
            return True
        done = threading.Event()
        self._queue.put(done)
        if not done.wait(timeout):
            return False
        # every channel gets its flush, even after one timed out (no short-circuit)
        return all([c.flush(timeout) for c in self._channels])

    def close(self, timeout: float | None = 60.0) -> None:
        if self._closed:
            return
        self.flush(timeout)
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)
        for channel in self._channels:
            channel.close(timeout)
