"""The dispatcher: backend failures and stalls are isolated, flush/close/exit deliver everything,
and users can register their own backends. Core only: no vendor library is imported here.

No assertion here is on wall-clock time: a stall is proven harmless by counting (training
finished every step while the backend was still blocked), not by timing it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens.backends import base
from tensorlens.dispatch import BackendStats, Dispatcher
from tensorlens.modes import ModeKeys

# --------------------------------------------------------------------------- helpers


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def train(model: nn.Module, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.randn(5, 6)), torch.randn(5, 3)).backward()
        opt.step()


def watch(model: nn.Module, tmp_path, backends: list, **kwargs) -> tl.Hook:
    return tl.Hook(
        out_dir=tmp_path / "run", save_config=tl.SaveConfig(save_interval=1), backends=backends, **kwargs
    ).register_module(model)


def tensorlens_warnings(caught: list[warnings.WarningMessage], text: str) -> list[str]:
    return [str(w.message) for w in caught if "tensorlens" in str(w.message) and text in str(w.message)]


class Recording(tl.Backend):
    """Keeps every call, and the steps written, in order."""

    name = "recording"

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.calls: list[str] = []
        self.steps: list[int] = []

    def open(self, run: tl.RunInfo) -> None:
        self.calls.append("open")

    def write(self, record: tl.StepRecord) -> None:
        time.sleep(self.delay)  # a slow tracker
        self.steps.append(record.step)
        self.calls.append("write")

    def flush(self) -> None:
        self.calls.append("flush")

    def close(self) -> None:
        self.calls.append("close")


class Failing(tl.Backend):
    name = "failing"

    def __init__(self, fail_in: str) -> None:
        self.fail_in = fail_in
        self.closed = False

    def open(self, run: tl.RunInfo) -> None:
        if self.fail_in == "open":
            raise ConnectionError("tracker unreachable")

    def write(self, record: tl.StepRecord) -> None:
        if self.fail_in == "write":
            raise RuntimeError("tracker is down")

    def flush(self) -> None:
        if self.fail_in == "flush":
            raise OSError("disk full")

    def close(self) -> None:
        self.closed = True
        if self.fail_in == "close":
            raise OSError("disk full")


class Stalled(tl.Backend):
    """Blocks in ``write`` until released, like a tracker whose server stopped answering."""

    name = "stalled"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.steps: list[int] = []

    def write(self, record: tl.StepRecord) -> None:
        self.release.wait()
        self.steps.append(record.step)


def record(step: int) -> tl.StepRecord:
    return tl.StepRecord(step, ModeKeys.TRAIN, step, "worker_0", 0.0, scalars=[tl.ScalarEntry("scalars/x", None, 1.0)])


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize("fail_in", ["write", "open"])
def test_a_failing_backend_warns_once_and_counts_failures(tmp_path, fail_in) -> None:
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    failing = Failing(fail_in)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hook = watch(model, tmp_path, [failing])
        train(model, 4)
        hook.close()

    messages = tensorlens_warnings(caught, "'failing'")
    assert len(messages) == 1, messages
    assert f"failed in {fail_in}()" in messages[0]
    assert "tracker" in messages[0]  # the backend's own error is in the message
    stats = hook.backend_stats()
    assert (stats["failing"].written, stats["failing"].failed, stats["failing"].dropped) == (0, 4, 0)
    assert (stats["local"].written, stats["local"].failed) == (4, 0)
    # training and the local store are unaffected
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with tl.open_run(hook.run_dir) as run:
        assert run.steps() == [0, 1, 2, 3]


@pytest.mark.parametrize("fail_in", ["flush", "close"])
def test_failing_flush_or_close_is_isolated(tmp_path, fail_in) -> None:
    failing, recording = Failing(fail_in), Recording()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = mlp()
        hook = watch(model, tmp_path, [failing, recording])
        train(model, 2)
        hook.flush()
        hook.close()
    assert len(tensorlens_warnings(caught, f"failed in {fail_in}()")) == 1
    assert hook.backend_stats()["failing"].written == 2
    assert recording.calls[-1] == "close" and recording.steps == [0, 1]


def test_a_record_that_cannot_be_built_is_skipped_with_a_warning(tmp_path) -> None:
    recording = Recording()
    dispatcher = Dispatcher([recording], tl.RunInfo("run", str(tmp_path)), build=lambda make: make())

    def broken() -> tl.StepRecord:
        raise ValueError("bad host array")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dispatcher.submit(lambda: record(0))
        dispatcher.submit(broken)
        dispatcher.submit(lambda: record(2))
        dispatcher.close()
    assert recording.steps == [0, 2]
    assert len(tensorlens_warnings(caught, "could not build a record: ValueError: bad host array")) == 1


# --------------------------------------------------------------------------- stalls


def test_a_stalled_backend_drops_records_and_never_blocks_training(tmp_path) -> None:
    stalled = Stalled()
    # if training ever waited on the stalled backend, this would unblock it after a minute and the
    # count below would fail instead of hanging the suite
    watchdog = threading.Timer(60.0, stalled.release.set)
    watchdog.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = mlp()
            hook = watch(model, tmp_path, [stalled], max_pending_steps=2)
            train(model, 20)
            assert not stalled.release.is_set()  # every step trained while the backend was blocked
            assert hook.flush(timeout=0.5) is False  # the stalled backend cannot be flushed ...
            with tl.open_run(hook.run_dir) as run:
                assert run.steps() == list(range(20))  # ... but the local store has every step
            stats = hook.backend_stats()["stalled"]
            # one record inside write(), at most two in its queue: the rest were dropped
            assert stats.written == 0 and 17 <= stats.dropped <= 19
            stalled.release.set()
            hook.close()
    finally:
        watchdog.cancel()
    stats = hook.backend_stats()["stalled"]
    assert stats.written + stats.dropped == 20 and stats.failed == 0
    assert stalled.steps == sorted(stalled.steps) and len(stalled.steps) == stats.written
    assert len(tensorlens_warnings(caught, "falling behind")) == 1


def test_close_gives_up_on_a_backend_that_never_returns(tmp_path) -> None:
    stalled = Stalled()
    dispatcher = Dispatcher([stalled], tl.RunInfo("run", str(tmp_path)), max_pending=1, build=lambda make: make())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(5):
            dispatcher.submit(lambda step=step: record(step))
        closer = threading.Thread(target=dispatcher.close, kwargs={"timeout": 0.2}, daemon=True)
        closer.start()
        closer.join(60.0)  # generous: a hang, not a slow machine, is what this catches
    try:
        assert not closer.is_alive(), "close() hung on a stalled backend"
        assert dispatcher.flush() is True  # closed: nothing more to wait for
    finally:
        stalled.release.set()


class Blocking(tl.Backend):
    """Blocks forever (until released) in one of its calls, like a tracker whose server hangs."""

    name = "blocking"

    def __init__(self, blocks_in: str, critical: bool = False) -> None:
        self.blocks_in = blocks_in
        self.critical = critical  # type: ignore[misc]  # an instance may play the local store
        self.release = threading.Event()
        self.entered = threading.Event()
        self.written = 0

    def _maybe_block(self, call: str) -> None:
        if call == self.blocks_in:
            self.entered.set()
            self.release.wait()

    def open(self, run: tl.RunInfo) -> None:
        self._maybe_block("open")

    def write(self, record: tl.StepRecord) -> None:
        self._maybe_block("write")
        self.written += 1

    def flush(self) -> None:
        self._maybe_block("flush")

    def close(self) -> None:
        self._maybe_block("close")


def _accounted(stats: BackendStats, produced: int) -> None:
    assert stats.produced == produced, stats
    assert stats.written + stats.failed + stats.dropped + stats.abandoned == produced, stats


@pytest.mark.timeout(180)
def test_close_does_not_wait_for_a_tracker_blocked_forever_and_counts_what_it_abandons(tmp_path) -> None:
    """Through the hook, with the default stall timeout: close() returns while the backend is
    still blocked in write(), and every record is accounted for."""
    blocking = Blocking("write")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = mlp()
            hook = watch(model, tmp_path, [blocking])
            train(model, 6)
            started = time.monotonic()
            hook.close()
            print(f"close() with a tracker blocked in write(): {time.monotonic() - started:.2f} s")
        assert blocking.entered.is_set() and not blocking.release.is_set()  # it is still blocked
        stats = hook.backend_stats()
        _accounted(stats["blocking"], 6)
        assert stats["blocking"].written == 0 and stats["blocking"].abandoned == 6
        _accounted(stats["local"], 6)
        assert stats["local"].written == 6
        (message,) = tensorlens_warnings(caught, "'blocking'")
        assert "was blocked in write() for" in message and "6 record(s) abandoned" in message
        with tl.open_run(hook.run_dir) as run:
            assert run.steps() == list(range(6))
    finally:
        blocking.release.set()
    assert blocking.written == 0  # the call that returned late after close() counts nowhere twice


@pytest.mark.timeout(120)
@pytest.mark.parametrize("blocks_in", ["open", "write", "flush"])
def test_flush_and_close_stop_waiting_for_a_stalled_tracker(tmp_path, blocks_in) -> None:
    blocking, recording = Blocking(blocks_in), Recording()
    dispatcher = Dispatcher([blocking, recording], tl.RunInfo("run", str(tmp_path)), max_pending=16, stall_timeout=0.3)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(10):
                dispatcher.submit(record(step))
            assert dispatcher.flush(timeout=None) is False  # no deadline: the stall alone ends the wait
            assert blocking.entered.is_set()
            dispatcher.close(timeout=None)
        assert not blocking.release.is_set()
        stats = dispatcher.stats()
        _accounted(stats["blocking"], 10)
        _accounted(stats["recording"], 10)
        assert recording.steps == list(range(10)) and recording.calls[-1] == "close"
        # blocked in flush(), it had written every record; blocked earlier, it abandons them all
        assert stats["blocking"].abandoned == (0 if blocks_in == "flush" else 10)
        assert len(tensorlens_warnings(caught, f"was blocked in {blocks_in}() for")) == 1
    finally:
        blocking.release.set()


@pytest.mark.timeout(120)
def test_a_backend_blocked_in_its_own_close_is_waited_for_until_the_timeout(tmp_path) -> None:
    blocking = Blocking("close")
    dispatcher = Dispatcher([blocking], tl.RunInfo("run", str(tmp_path)), stall_timeout=0.1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                dispatcher.submit(record(step))
            dispatcher.close(timeout=1.0)
        assert blocking.entered.is_set() and not blocking.release.is_set()
        stats = dispatcher.stats()["blocking"]
        _accounted(stats, 3)
        assert (stats.written, stats.abandoned) == (3, 0)  # written before its close() stalled
        assert len(tensorlens_warnings(caught, "0 record(s) abandoned")) == 1
    finally:
        blocking.release.set()


@pytest.mark.timeout(120)
def test_a_stalled_local_store_is_waited_for_until_the_timeout_then_counted(tmp_path) -> None:
    """A critical backend is never dropped and has no stall rule: close waits for it until the
    timeout; records it never got, and those the dispatcher never handed over, are abandoned."""
    store, recording = Blocking("write", critical=True), Recording()
    dispatcher = Dispatcher([store, recording], tl.RunInfo("run", str(tmp_path)), max_pending=2, stall_timeout=0.1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            submitter = threading.Thread(target=lambda: [dispatcher.submit(record(s)) for s in range(8)], daemon=True)
            submitter.start()
            submitter.join(5.0)  # training blocks behind a stuck store once every queue is full
            dispatcher.close(timeout=1.0)
        assert not store.release.is_set()
        produced = 8 - submitter.is_alive()  # the one step still being submitted, if any, never arrived
        for name in ("blocking", "recording"):
            _accounted(dispatcher.stats()[name], dispatcher.stats()[name].produced)
        assert dispatcher.stats()["blocking"].written == 0
        assert dispatcher.stats()["recording"].written + dispatcher.stats()["recording"].abandoned <= produced
    finally:
        store.release.set()


@pytest.mark.timeout(300)
def test_every_record_is_accounted_for_whatever_the_backends_do(tmp_path) -> None:
    """Property test: random mixes of failing, slow, small-queued and blocked trackers."""
    import random

    class Random(tl.Backend):
        name = "random"

        def __init__(self, rng: random.Random) -> None:
            self.fail = rng.random() * 0.5
            self.delay = rng.choice([0.0, 0.0, 0.002])
            self.block_at = rng.choice([None, None, rng.randint(0, 30)])
            self.release = threading.Event()
            self.seen = 0
            self.rng = random.Random(rng.random())

        def write(self, record: tl.StepRecord) -> None:
            self.seen += 1
            if self.seen == self.block_at:
                self.release.wait()
            time.sleep(self.delay)
            if self.rng.random() < self.fail:
                raise RuntimeError("flaky")

    rng = random.Random(3)
    for _ in range(6):
        backends = [Random(rng) for _ in range(rng.randint(1, 4))]
        records = rng.randint(0, 60)
        dispatcher = Dispatcher(backends, tl.RunInfo("run", str(tmp_path)), max_pending=rng.randint(1, 8), stall_timeout=0.2)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for step in range(records):
                    dispatcher.submit(record(step))
                dispatcher.close(timeout=5.0)
            for stats in dispatcher.stats().values():
                _accounted(stats, records)
        finally:
            for backend in backends:
                backend.release.set()


# --------------------------------------------------------------------------- delivery


def test_flush_and_close_deliver_everything_in_order(tmp_path) -> None:
    recording = Recording(delay=0.005)
    model = mlp()
    hook = watch(model, tmp_path, [recording])
    train(model, 10)
    assert hook.flush() is True
    assert recording.steps == list(range(10))  # all there as soon as flush returns
    assert recording.calls[-1] == "flush"
    train(model, 5)
    hook.close()
    assert recording.steps == list(range(15))
    assert recording.calls[0] == "open" and recording.calls[-1] == "close"
    assert hook.backend_stats()["recording"].written == 15
    hook.close()  # idempotent
    assert recording.calls.count("close") == 1


def test_interpreter_exit_flushes_without_close(tmp_path) -> None:
    script = textwrap.dedent(
        """
        import sys, time
        import torch
        from torch import nn
        import tensorlens as tl

        class Slow(tl.Backend):
            name = "slow"
            def __init__(self, path):
                self.path = path
            def open(self, run):
                self.file = open(self.path, "w")
            def write(self, record):
                time.sleep(0.02)  # still writing when the script ends
                self.file.write(f"{record.step}\\n")
            def close(self):
                self.file.write("closed\\n")
                self.file.close()

        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        hook = tl.watch(model, save_interval=1, out_dir=sys.argv[1], backends=[Slow(sys.argv[2])])
        for _ in range(10):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
        # no hook.close(): the atexit handler has to flush and close
        """
    )
    run_dir, lines = tmp_path / "run", tmp_path / "slow.txt"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(run_dir), str(lines)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    assert lines.read_text().split() == [str(s) for s in range(10)] + ["closed"]
    with tl.open_run(str(run_dir)) as run:
        assert run.steps() == list(range(10))


# --------------------------------------------------------------------------- registry


@pytest.fixture
def registry():
    saved = dict(base._REGISTRY)
    yield
    base._REGISTRY.clear()
    base._REGISTRY.update(saved)


class Mine(Recording):
    name = "mine"


def test_register_backend_by_name(tmp_path, registry) -> None:
    tl.register_backend("mine", Mine)
    assert "mine" in tl.registered_backends()
    model = mlp()
    hook = tl.watch(model, save_interval=1, out_dir=tmp_path / "run", backends=["mine"])
    train(model, 3)
    hook.close()
    mine = next(b for b in hook.backends if isinstance(b, Mine))
    assert mine.steps == [0, 1, 2]
    assert hook.backend_stats()["mine"].written == 3
    assert [b.name for b in hook.backends] == ["local", "mine"]  # the local store is always there


@pytest.mark.parametrize(
    ("name", "backend", "message"),
    [
        ("", Mine, "Expected `name` to be a non-empty string, but got ''"),
        (3, Mine, "Expected `name` to be a non-empty string, but got 3"),
        ("mine", Mine(), "Expected `backend` to be a subclass of tensorlens.Backend, but got <"),
        ("mine", object, "Expected `backend` to be a subclass of tensorlens.Backend, but got <class 'object'>"),
        ("mine", "tensorlens.backends.local:LocalBackend", "Expected `backend` to be a subclass"),
    ],
)
def test_bad_registrations_fail_clearly(registry, name, backend, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tl.register_backend(name, backend)
    assert name not in tl.registered_backends()


def test_an_unknown_backend_name_lists_the_known_ones(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"Expected `backends` to be names from \['local', 'memory'.*but got 'nope'"):
        tl.watch(mlp(), out_dir=tmp_path / "run", backends=["nope"])


def test_a_record_is_changed_by_replace_sharing_what_it_does_not_change() -> None:
    """Records are immutable (every backend shares one): ``replace`` makes the changed copy, and
    ``without`` (a backend that takes no histograms) is one such copy."""
    import numpy as np

    record = tl.StepRecord(
        3, ModeKeys.TRAIN, 3, "worker_0", 1.0,
        scalars=[tl.ScalarEntry("gradients/w", "l2", 2.0)],
        histograms=[tl.HistogramEntry("gradients/w", np.array([1, 2]), np.array([0.0, 1.0, 2.0]), 0.0, 2.0, 3, 3.0, 5.0)],
    )
    later = record.replace(step=4, mode_step=4, worker="worker_1", scalar_values=record.scalar_values * 2)
    assert (later.step, later.mode_step, later.worker, later.wall_time) == (4, 4, "worker_1", 1.0)
    assert later.scalar_dict() == {"gradients/w/l2": 4.0} and record.scalar_dict() == {"gradients/w/l2": 2.0}
    assert later.counts is record.counts and later.edges is record.edges and later.scalar_names is record.scalar_names
    assert later.histogram_dict()["gradients/w"].counts.tolist() == [1, 2]
    bare = record.without(histograms=True)
    assert bare.histogram_names == () and bare.scalar_values is record.scalar_values and bare.step == 3
    assert record.without() is record
    with pytest.raises(TypeError, match="no field 'stepp'"):
        record.replace(stepp=5)
    with pytest.raises(AttributeError, match="immutable"):
        record.step = 5


def test_a_record_gives_back_each_histogram_field_by_name() -> None:
    """Every histogram field survives the record's packed arrays under its own name, whatever
    the order the record keeps them in (``HISTOGRAM_INFO``)."""
    import numpy as np

    from tensorlens.records import HISTOGRAM_INFO

    entry = tl.HistogramEntry(
        "activations/fc1", np.array([4, 5, 6]), np.array([-1.5, 0.0, 0.5, 2.0]), min=-1.25, max=1.75, count=15,
        sum=3.5, sum_squares=9.25, nan_count=2, inf_count=3, rejected=4, underflow=5, overflow=6, sampled=True,
    )
    record = tl.StepRecord(1, ModeKeys.TRAIN, 1, "worker_0", 0.0, scalars=[], histograms=[entry])
    back = record.histogram("activations/fc1")
    for key in HISTOGRAM_INFO:
        assert getattr(back, key) == getattr(entry, key) and type(getattr(back, key)) is type(getattr(entry, key)), key
    assert back.counts.tolist() == [4, 5, 6] and back.edges.tolist() == [-1.5, 0.0, 0.5, 2.0]
