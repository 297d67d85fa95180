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
from tensorlens.dispatch import Dispatcher
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
