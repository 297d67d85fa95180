"""Replaying a stored run into a tracker: ``tensorlens sync RUN --to NAME`` (any registered backend
that replays: ``wandb``, ``mlflow``, ``tensorboard``, your own).

Every stored record (all modes, all workers: a run folder may hold a file per worker; scalars,
histograms, what the custom charts are built from), the rule findings,
and the run metadata go through the backend a live run uses, in the backend's own order:
``open``, ``write_metadata``, ``write`` for each record (``Run.records()`` order), ``flush``,
``close``. So the synced tracker run holds what a live run of the same steps would hold.

The backend is called here directly, not through the :class:`~tensorlens.dispatch.Dispatcher`:
the dispatcher is built for training, where nothing may wait for a tracker, so it drops a
tracker's records when the tracker falls behind and turns its errors into one warning. A replay
needs the opposite: wait for the tracker, know exactly which records it accepted (those are
marked as sent), and stop at the first error so the next sync continues from there.

Idempotent and resumable: what reached the tracker is recorded in the sync state beside the
run store (:mod:`tensorlens.sync.state`; the store itself is only read, through the reader) at
checkpoints (every ``checkpoint_every`` records: the backend is flushed, then the progress
committed), at the end, and when the sync stops on an error, Ctrl-C or SIGTERM
(:mod:`tensorlens.sync.signals`: between two records). A second sync sends only the records after the last ones
marked; only a hard kill (``kill -9``) leaves the records written since the last checkpoint
unmarked, to be sent again. Records already sent are given to :meth:`Backend.restore` instead,
so charts built across steps continue where the earlier session stopped. One sync of a run to a
destination runs at a time (:mod:`tensorlens.sync.lock`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from tensorlens._checks import expected
from tensorlens.backends.base import Backend, RunInfo
from tensorlens.backends.payload import check_histogram_interval, check_tracker_stats
from tensorlens.findings import Finding
from tensorlens.store.errors import CorruptRunError
from tensorlens.store.reader import Run, open_run
from tensorlens.store.schema import store_files
from tensorlens.sync.errors import SyncBusyError, SyncError, SyncTerminated
from tensorlens.sync.lock import SyncLock
from tensorlens.sync.signals import Termination, stop_on_signals
from tensorlens.sync.state import Progress, SyncState, TargetState, locate, make_folder
from tensorlens.sync.target import SyncTarget, create_target

__all__ = ["SyncBusyError", "SyncError", "SyncResult", "SyncTerminated", "sync_run"]


@dataclasses.dataclass
class SyncResult:
    """What one sync session did."""

    target: str  # the destination's key, e.g. "wandb:/tensorlens"
    run_id: str  # the tracker run
    new_run: bool  # the tracker run was created by this session
    sent: dict[tuple[str, str], int]  # (mode, worker) -> records sent in this session
    already_sent: int  # records an earlier session had sent
    findings_sent: int  # rule findings sent in this session
    metadata_sent: bool
    lines: list[str]  # where it went and what to do next, for the user

    @property
    def records_sent(self) -> int:
        return sum(self.sent.values())


def sync_run(
    run: str | os.PathLike[str],
    to: str | type[Backend] | SyncTarget,
    *,
    options: Mapping[str, Any] | None = None,
    new_run: bool = False,
    progress: bool = True,
    checkpoint_every: int = 100,
    tracker_stats: str | Sequence[str] | None = None,
    tracker_histogram_interval: int | None = None,
    **backend_options: Any,
) -> SyncResult:
    """Replay the stored run at ``run`` into a tracker; continue where an earlier sync stopped.

    Args:
        run: a run folder (or one of its ``tensorlens*.sqlite`` files).
        to: the name of a registered backend that replays (``"wandb"``, ``"mlflow"``,
            ``"tensorboard"``, or your own: ``tl.register_backend``), a Backend class, or a
            :class:`SyncTarget`.
        options, **backend_options: the backend's options (its ``replay_options``; ``None``
            values count as not given), as a dict or as keywords:

            - ``wandb``: ``project`` (default ``WANDB_PROJECT`` or ``"tensorlens"``), ``entity``,
              ``wandb_dir`` (the folder ``wandb/`` goes in), ``offline`` (default: ``WANDB_MODE``);
            - ``mlflow``: ``tracking_uri`` (default ``mlflow.get_tracking_uri()``), ``experiment``
              (default ``Default``), ``artifact_location`` (for an experiment that does not exist
              yet and is created: where its artifacts go);
            - ``tensorboard``: ``logdir`` (required); the events go to ``<logdir>/<run name>``.
        new_run: forget an earlier sync to this destination and start a new tracker run.
        progress: show a progress bar (tqdm, when installed, on a terminal).
        checkpoint_every: records between two checkpoints (flush, then mark as sent).
        tracker_stats: what the tracker receives of each record, as in a live run
            (:mod:`tensorlens.backends.payload`: ``"default"``, ``"all"`` or statistic names);
            ``None``: ``$TENSORLENS_TRACKER_STATS``, else ``"default"``. It applies to the records
            sent from now on: a tracker run synced before keeps what it holds (``new_run=True``
            sends everything again with the new choice).
        tracker_histogram_interval: train steps between the records whose histograms are sent, as
            in a live run (``None``: 100 with the ``"default"`` payload, every record otherwise).

    >>> result = sync_run("tensorlens_runs/exp1", "mlflow", tracking_uri="sqlite:///mlflow.db")  # doctest: +SKIP
    >>> result.records_sent, result.run_id                                                        # doctest: +SKIP
    (120, '3f2a...')
    """
    if options is not None and not (isinstance(options, Mapping) and all(isinstance(k, str) for k in options)):
        raise expected("options", "None or a dict of option names to values", options)
    both = sorted(set(options or {}) & set(backend_options))
    if both:
        raise expected(both[0], "given once (it is both in `options` and a keyword)", backend_options[both[0]])
    if not isinstance(new_run, bool):
        raise expected("new_run", "a bool", new_run)
    if not isinstance(progress, bool):
        raise expected("progress", "a bool", progress)
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1:
        raise expected("checkpoint_every", "an integer >= 1", checkpoint_every)
    tracker_stats = check_tracker_stats("tracker_stats", tracker_stats)
    histogram_interval = check_histogram_interval("tracker_histogram_interval", tracker_histogram_interval)
    if not isinstance(run, (str, os.PathLike)):
        raise expected("run", "a run folder", run)
    path = os.fspath(run)
    files = store_files(path) if os.path.exists(path) else []
    if not files:
        raise FileNotFoundError(f"no tensorlens run at {path!r} (a run folder holds tensorlens.sqlite)")
    target = create_target(to, **{**(options or {}), **backend_options})
    # the source is only read, through the reader; what was sent is kept in a state of its own
    with open_run(path) as stored:
        if not stored.meta:
            raise FileNotFoundError(
                f"no tensorlens run recorded at {path!r} yet: {files[0]} holds no store "
                f"({'an empty file' if os.path.getsize(files[0]) == 0 else 'no tables'}; a run being created, or not a run)"
            )
        location = locate(files[0])
        make_folder(location, path)
        what = f"{os.path.normpath(path)} to {target.key}"
        with (
            SyncLock(location.folder, f"{location.name}\0{target.key}", what), _environment(target.environment()),
            stop_on_signals() as termination, SyncState(location.path, location.seeds) as state,
        ):
            return _Replay(stored, state, target, path, checkpoint_every, progress, termination, tracker_stats,
                           histogram_interval).run(new_run)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the block, but those the user has set."""
    added = [k for k in values if k not in os.environ]
    os.environ.update({k: values[k] for k in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


class _Replay:
    """One sync session: the stored run, its sync state, the target and its backend."""

    def __init__(
        self, stored: Run, state: SyncState, target: SyncTarget, path: str, checkpoint_every: int, progress: bool,
        termination: Termination, tracker_stats: str | Sequence[str] | None = None,
        histogram_interval: int | None = None,
    ) -> None:
        self.stored = stored
        self.state = state
        self.target = target
        self.path = path
        self.checkpoint_every = checkpoint_every
        self.show_progress = progress
        self.termination = termination
        self.tracker_stats = tracker_stats
        self.histogram_interval = histogram_interval

    def run(self, new_run: bool) -> SyncResult:
        key = self.target.key
        if new_run:
            self.state.forget(key)
        known = self.state.target(key)
        if known is not None:
            problem = self.target.check_state(known.run_id, known.info)
            if problem:  # read from a file: never a folder outside the destination, never a guess
                raise CorruptRunError(
                    self.state.path, f"{problem}; sync with --new-run to start {key} over", "sync_targets",
                )
        meta = self.stored.meta
        run_name = meta.get("run_name") or os.path.basename(os.path.abspath(self.path))
        self.target.info = dict(known.info) if known is not None else {}
        if known is not None and not self._anything_new(known):
            # nothing to send: no tracker run is opened (no empty W&B offline folder)
            self.target.run_id = known.run_id
            return SyncResult(key, known.run_id, False, {}, len(self.stored.step_keys()), 0, False, self.target.describe())
        try:
            backend, run_id = self.target.start(run_name, known.run_id if known is not None else None)
        except Exception as err:  # a server that is down, a run that is gone: one line for the user
            raise SyncError(f"tensorlens sync could not open the {self.target.name} run ({type(err).__name__}: {err})") from err
        self.target.run_id = run_id
        target_state = TargetState(key, run_id, known.findings_sent if known is not None else 0, self.target.info)
        self.state.save_target(target_state)  # the tracker run exists now: a crash from here continues it
        metadata = self.stored.metadata() if known is None or self.target.metadata_every_session else {}
        info = RunInfo(
            run_name, os.path.abspath(self.path), config=_config(self.stored), metadata=metadata,
            tracker_stats=self.tracker_stats, tracker_histogram_interval=self.histogram_interval,
        )
        session = _Session(backend, self.state, target_state, self.state.progress(key))
        try:
            backend.open(info)
            session.opened = True
            if metadata:
                backend.write_metadata(metadata)
            self._replay(session)
        except BaseException as err:
            session.stop()
            try:
                self.target.finish()
            except Exception:  # the error that stopped the sync is the one to report
                pass
            if isinstance(err, SyncTerminated):
                raise SyncTerminated(
                    f"tensorlens sync to {key} stopped by SIGTERM after {session.sent_total} new records; "
                    "what was sent is recorded: run the same sync again to continue"
                ) from None
            if isinstance(err, Exception):
                raise SyncError(
                    f"tensorlens sync to {key} stopped after {session.sent_total} new records "
                    f"({type(err).__name__}: {err}); what was sent is recorded: run the same sync again to continue"
                ) from err
            raise
        if self.show_progress and sys.stderr.isatty():  # closing can take seconds (MLflow draws its images)
            print(f"tensorlens sync: finishing the {self.target.name} run", file=sys.stderr, flush=True)
        session.close()
        self.target.finish()
        return SyncResult(
            key, run_id, known is None, dict(session.sent), session.already_sent, session.findings_sent,
            bool(metadata), self.target.describe(),
        )

    def _anything_new(self, known: TargetState) -> bool:
        done = self.state.progress(known.target)
        if any(k.mode_step > done.get((str(k.mode), k.worker), (-1, -1))[0] for k in self.stored.step_keys()):
            return True
        return len(self.stored.findings()) > known.findings_sent

    def _replay(self, session: _Session) -> None:
        keys = self.stored.step_keys()
        done = session.progress
        pending = [k.step for k in keys if k.mode_step > done.get((str(k.mode), k.worker), (-1, -1))[0]]
        session.already_sent = len(keys) - len(pending)
        # a backend without restore() needs no record it has already: start at the first step to send
        needs_old = type(session.backend).restore is not Backend.restore
        start = None if needs_old or not pending else min(pending)
        findings = list(self.stored.findings())  # in the order they were found: those sent already first
        if needs_old:  # what the tracker run holds already counts in what it builds (rule counts, alerts)
            for finding in findings[: session.target_state.findings_sent]:
                session.backend.restore(finding)
        findings = findings[session.target_state.findings_sent:]
        check = self.termination.check
        check("")
        with _progress_bar(len(pending) if self.show_progress else None) as advance:
            for record in self.stored.records(start_step=start):
                last = done.get((str(record.mode), record.worker))
                if last is not None and record.mode_step <= last[0]:
                    session.backend.restore(record)
                    continue
                # in a live run a finding follows the record of its step, before the next step's
                while findings and findings[0].step < record.step:
                    session.write_finding(findings.pop(0))
                    check("")
                session.write(record)
                advance()
                check("")  # SIGTERM, Ctrl-C: between two records, never inside one
                if session.since_checkpoint >= self.checkpoint_every:
                    session.checkpoint()
            while findings:
                session.write_finding(findings.pop(0))
                check("")
        session.checkpoint()


class _Session:
    """The backend of one sync session and what it has sent; checkpoints mark it in the store."""

    def __init__(self, backend: Backend, state: SyncState, target_state: TargetState, progress: Progress) -> None:
        self.backend = backend
        self.state = state
        self.target_state = target_state
        self.progress = progress
        self.opened = False
        self.sent: Counter[tuple[str, str]] = Counter()
        self.already_sent = 0
        self.findings_sent = 0
        self.since_checkpoint = 0

    @property
    def sent_total(self) -> int:
        return sum(self.sent.values())

    def write(self, record: Any) -> None:
        backend = self.backend
        # what the dispatcher does for a live backend: the same record, less what it does not take
        backend.write(record.without(histograms=not backend.supports_histograms, tensors=not backend.supports_tensors))
        where = (str(record.mode), record.worker)
        self.progress[where] = (record.mode_step, record.step)
        self.sent[where] += 1
        self.since_checkpoint += 1

    def write_finding(self, finding: Finding) -> None:
        self.backend.write_finding(finding)
        self.target_state.findings_sent += 1
        self.findings_sent += 1
        self.since_checkpoint += 1

    def checkpoint(self) -> None:
        """Flush, then mark as sent: only what the tracker has is ever marked."""
        self.backend.flush()
        self.state.save(self.target_state, self.progress)
        self.since_checkpoint = 0

    def close(self) -> None:
        self.backend.close()

    def stop(self) -> None:
        """After an error or Ctrl-C: keep what was sent (if the tracker takes the flush), close."""
        if not self.opened:
            return
        try:
            self.checkpoint()
        except Exception:  # not flushed: not marked, so sent again next time rather than lost
            pass
        try:
            self.backend.close()
        except Exception:
            pass


class _progress_bar:
    """``with _progress_bar(total) as advance: advance()``: a tqdm bar on stderr (``None``: no bar)."""

    def __init__(self, total: int | None) -> None:
        self.total = total
        self.bar: Any = None

    def __enter__(self) -> Callable[[], None]:
        if self.total is None:
            return lambda: None
        try:
            from tqdm.auto import tqdm
        except ImportError:  # the bar is a convenience: tqdm is not a dependency of the core
            return lambda: None
        # disable=None: no bar when stderr is not a terminal (logs, CI)
        self.bar = tqdm(total=self.total, desc="tensorlens sync", unit="step", disable=None, dynamic_ncols=True)
        return lambda: self.bar.update(1)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def _config(stored: Any) -> dict[str, Any]:
    # the store's own untrusted-JSON reader: a config nested 200,000 deep is a CorruptRunError, not a RecursionError
    value = stored.meta_json("config", {})
    return value if isinstance(value, dict) else {}
