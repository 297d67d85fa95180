"""The dispatcher: moves finished steps off the training thread and fans them out to backends.

Training thread --(bounded queue)--> dispatcher thread (builds the step's one record)
--> one bounded queue and thread per backend, all given the same immutable record. A backend that
raises or falls behind is isolated: one warning naming it, a counter of failed or dropped
records, and nothing else is affected. The local store is *critical*: it is never dropped, the
dispatcher waits for it instead.

Rule findings travel the same way: a backend that produces them (the rule runner, itself one
of the backends, so a rule that fails is isolated like a failing backend) hands each to
:meth:`Dispatcher.submit_finding`, which queues it for every other backend's ``write_finding``.
Findings are not records: the counters below do not count them.

Waiting is bounded. ``flush(timeout)`` and ``close(timeout)`` share one deadline for all backends,
and stop waiting for a tracker (a backend that is not critical) as soon as one of its calls has
been running for ``stall_timeout`` seconds (default 10): a tracker whose server died or hangs
costs at most that, not the whole timeout. Its own ``close()`` (where MLflow draws heatmaps) is
waited for until the deadline. What a backend never got to is counted: for every backend
``written + failed + dropped + abandoned == produced`` once the dispatcher is closed.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from tensorlens.backends.base import Backend, RunInfo
from tensorlens.findings import Finding
from tensorlens.records import StepRecord

__all__ = ["CLOSE_TIMEOUT_S", "STALL_TIMEOUT_S", "BackendStats", "Dispatcher"]

_STOP = object()
#: Default bound on ``flush()`` and ``close()``, for all backends together.
CLOSE_TIMEOUT_S = 60.0
#: A tracker whose write, flush or open has run this long is stalled: flush and close stop
#: waiting for it (its thread is left behind, a daemon, and what it still held is ``abandoned``).
STALL_TIMEOUT_S = 10.0
_POLL_S = 0.05  # how often a waiting flush/close looks at the clock and the backend's call


@dataclasses.dataclass
class BackendStats:
    """What happened to the records produced for one backend.

    Every record ends in exactly one of ``written`` (the backend's ``write()`` returned),
    ``failed`` (it raised, or the backend could not open), ``dropped`` (its queue was full: the
    backend fell behind) and ``abandoned`` (still queued or being written when ``close()`` gave
    up on a stalled backend, or never handed over because the dispatcher itself was stuck), so
    once the hook is closed ``written + failed + dropped + abandoned == produced``.
    """

    written: int = 0
    failed: int = 0
    dropped: int = 0
    abandoned: int = 0
    produced: int = 0


class _Channel:
    """One backend behind its own queue and thread."""

    def __init__(self, backend: Backend, run: RunInfo, max_pending: int, stall_timeout: float) -> None:
        self.backend = backend
        self.stats = BackendStats()
        self._run = run
        self._stall_timeout = stall_timeout
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_pending)
        self._lock = threading.Lock()  # stats, and giving up, against the backend's thread
        self._warned: set[str] = set()
        self._opened = False
        self._open_failed = False
        self._busy: tuple[str, float] | None = None  # (call, monotonic start) while the backend runs
        self._given_up = False
        self._accepting = True  # False once stopped: a record arriving later is abandoned
        self._thread = threading.Thread(target=self._loop, name=f"tensorlens-{backend.name}", daemon=True)
        self._thread.start()

    @property
    def label(self) -> str:
        return f"{type(self.backend).__name__} ({self.backend.name!r})"

    def _warn(self, kind: str, message: str) -> None:
        """One warning per kind of trouble (a drop warning must not hide why writes then fail)."""
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"tensorlens: backend {self.label} {message}; training continues, "
                          "other backends are unaffected (this warning is shown once)", stacklevel=2)

    def _blocked(self) -> str | None:
        """``"write() for 12 s"`` while one backend call has run longer than the stall timeout."""
        busy = self._busy
        if busy is None:
            return None
        elapsed = time.monotonic() - busy[1]
        return f"{busy[0]} for {elapsed:.0f} s" if elapsed > self._stall_timeout else None

    def stalled(self) -> bool:
        """A tracker stuck in a write, flush or open for longer than the stall timeout."""
        busy = self._busy
        return not self.backend.critical and busy is not None and busy[0] != "close()" and self._blocked() is not None

    def submit(self, record: StepRecord) -> None:
        with self._lock:
            self.stats.produced += 1
            if not self._accepting:
                self.stats.abandoned += 1
                return
        if self.backend.critical:
            self._queue.put(record)
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            with self._lock:
                self.stats.dropped += 1
            blocked = self._blocked()
            if blocked is not None:
                self._warn("drop", f"has been blocked in {blocked} (is its destination reachable?) and records are "
                                   "being dropped")
            else:
                self._warn("drop", "is falling behind and records are being dropped")

    def submit_finding(self, finding: Finding) -> None:
        if not self._accepting:
            return
        if self.backend.critical:
            self._queue.put(finding)
            return
        try:
            self._queue.put_nowait(finding)
        except queue.Full:
            self._warn("drop", "is falling behind and rule findings are being dropped")

    def _call(self, fn: Callable[[], None], what: str) -> bool:
        self._busy = (what, time.monotonic())
        try:
            fn()
            return True
        except Exception as err:  # isolate any backend failure
            self._warn("fail", f"failed in {what}: {type(err).__name__}: {err}")
            return False
        finally:
            self._busy = None

    def _count(self, ok: bool) -> bool:
        """Count one record; ``False`` once close() gave up on this backend (its thread then ends)."""
        with self._lock:
            if self._given_up:
                return False
            if ok:
                self.stats.written += 1
            else:
                self.stats.failed += 1
            return True

    def _loop(self) -> None:
        while not self._given_up:
            item = self._queue.get()
            if item is _STOP:
                self._call(self.backend.close, "close()")
                return
            if isinstance(item, threading.Event):  # a flush marker
                if self._opened and not self._open_failed:
                    self._call(self.backend.flush, "flush()")
                item.set()
                continue
            assert isinstance(item, (StepRecord, Finding))
            if not self._opened:
                self._opened = True
                self._open_failed = not self._call(lambda: self.backend.open(self._run), "open()")
                if not self._open_failed and self._run.metadata:  # once, before the first record
                    self._call(lambda: self.backend.write_metadata(dict(self._run.metadata)), "write_metadata()")
            if isinstance(item, Finding):
                if not self._open_failed:
                    self._call(lambda item=item: self.backend.write_finding(item), "write_finding()")
                continue
            if self._open_failed:  # every record of a backend that could not open is a failure
                if not self._count(False):
                    return
                continue
            record = item.without(histograms=not self.backend.supports_histograms, tensors=not self.backend.supports_tensors)
            if not self._count(self._call(lambda record=record: self.backend.write(record), "write()")):
                return

    # -- waiting, bounded by a deadline and, for trackers, by the stall timeout

    def _put(self, item: object, deadline: float) -> bool:
        while True:
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                if self.stalled() or time.monotonic() >= deadline:
                    return False

    def _wait(self, done: Callable[[], bool], deadline: float) -> bool:
        while not done():
            if self.stalled() or time.monotonic() >= deadline:
                return False
        return True

    def flush(self, deadline: float) -> threading.Event | None:
        """Queue a flush marker (``None`` when it could not be queued in time)."""
        if self._given_up:
            return None
        marker = threading.Event()
        return marker if self._put(marker, deadline) else None

    def wait_flushed(self, marker: threading.Event | None, deadline: float) -> bool:
        return marker is not None and self._wait(lambda: marker.wait(_POLL_S), deadline)

    def stop(self, deadline: float) -> bool:
        """Queue the stop marker (the backend's ``close()`` follows what is queued)."""
        with self._lock:
            self._accepting = False
        return not self._given_up and self._put(_STOP, deadline)

    def wait_closed(self, stopped: bool, deadline: float) -> None:
        """Wait for the backend to finish; give up on it at the deadline or when it stalled."""
        if stopped and self._wait(self._finished, deadline):
            return
        self.give_up()

    def _finished(self) -> bool:
        self._thread.join(_POLL_S)
        return not self._thread.is_alive()

    def count_abandoned(self, records: int) -> None:
        with self._lock:
            self.stats.produced += records
            self.stats.abandoned += records

    def give_up(self) -> None:
        with self._lock:
            if self._given_up:
                return
            self._given_up, self._accepting = True, False
            s = self.stats
            s.abandoned += s.produced - s.written - s.failed - s.dropped - s.abandoned
            abandoned = s.abandoned
        blocked = self._blocked()
        why = f"was blocked in {blocked} (is its destination reachable?)" if blocked else "did not finish in time"
        self._warn("close", f"{why} when the hook closed: {abandoned} record(s) abandoned, see hook.backend_stats()")


class Dispatcher:
    """Turns pending steps into records on a background thread and hands them to every backend.

    ``submit(item)`` takes a :class:`StepRecord`, or anything ``build`` turns into one (the
    engine's pending step: its record is built here, off the training thread, once for all
    backends). ``stall_timeout`` bounds how long :meth:`flush` and :meth:`close` wait for a
    tracker stuck in one call (see the module docstring).

    >>> dispatcher = Dispatcher([MemoryBackend()], RunInfo("run", "/tmp/run"))  # doctest: +SKIP
    >>> dispatcher.submit(record); dispatcher.close()                          # doctest: +SKIP
    """

    def __init__(
        self, backends: Sequence[Backend], run: RunInfo, max_pending: int = 64,
        build: Callable[[Any], StepRecord | None] | None = None, stall_timeout: float = STALL_TIMEOUT_S,
    ) -> None:
        self._build = build
        self._channels = [_Channel(b, run, max_pending, stall_timeout) for b in backends]
        for backend in backends:
            backend.bind_findings(functools.partial(self.submit_finding, source=backend))
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

    def submit_finding(self, finding: Finding, source: Backend | None = None) -> None:
        """Queue a rule finding for every backend but the one it came from (called on that
        backend's thread: findings skip the build queue, their records have passed it already)."""
        if not isinstance(finding, Finding):
            raise TypeError(f"Expected `finding` to be a tensorlens Finding, but got {finding!r}")
        for channel in self._channels:
            if channel.backend is not source:
                channel.submit_finding(finding)

    def _stages(self) -> list[list[_Channel]]:
        """The channels that produce findings, then the others: whatever the first find while
        flushing or closing must still reach the others."""
        producers = [c for c in self._channels if c.backend.produces_findings]
        return [stage for stage in (producers, [c for c in self._channels if c not in producers]) if stage]

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                record = item if isinstance(item, StepRecord) or self._build is None else self._build(item)
            except Exception as err:  # a bug of ours must not take training down
                warnings.warn(f"tensorlens: could not build a record: {type(err).__name__}: {err}", stacklevel=2)
                continue
            if record is None:  # nothing to record (an epoch that saved no step)
                continue
            for channel in self._channels:
                channel.submit(record)

    def _drained(self, deadline: float) -> bool:
        """Wait until the dispatcher thread handed over everything submitted before."""
        marker = threading.Event()
        while True:
            try:
                self._queue.put(marker, timeout=_POLL_S)
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    return False
        while not marker.wait(_POLL_S):
            if time.monotonic() >= deadline:
                return False
        return True

    def flush(self, timeout: float | None = CLOSE_TIMEOUT_S) -> bool:
        """Wait until every submitted step reached every backend and was flushed there; ``False``
        when that did not happen within ``timeout`` seconds or a tracker stalled."""
        if self._closed:
            return True
        return self._flush(_deadline(timeout))

    def _flush(self, deadline: float) -> bool:
        if not self._drained(deadline):
            return False
        flushed = True
        for stage in self._stages():
            markers = [c.flush(deadline) for c in stage]  # all queued first: one deadline for all
            flushed = all([c.wait_flushed(m, deadline) for c, m in zip(stage, markers, strict=True)]) and flushed
        return flushed

    def close(self, timeout: float | None = CLOSE_TIMEOUT_S) -> None:
        """Flush, then close every backend, within ``timeout`` seconds in all."""
        if self._closed:
            return
        deadline = _deadline(timeout)
        self._flush(deadline)
        self._closed = True
        if not self._drained(deadline):
            self._abandon_pending()
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:  # refilled by a racing submit(); the thread is a daemon and stuck anyway
            pass
        for stage in self._stages():
            stopped = [c.stop(deadline) for c in stage]
            for channel, ok in zip(stage, stopped, strict=True):
                channel.wait_closed(ok, deadline)

    def _abandon_pending(self) -> None:
        """The dispatcher thread is stuck (on a critical backend): steps it never took reach no
        backend; each counts them as produced and abandoned."""
        pending = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            pending += item is not _STOP and not isinstance(item, threading.Event)
        for channel in self._channels:
            channel.count_abandoned(pending)


def _deadline(timeout: float | None) -> float:
    return time.monotonic() + (timeout if timeout is not None else float("inf"))
