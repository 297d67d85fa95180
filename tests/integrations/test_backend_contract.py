"""One contract, every registered backend, each against its real library.

The same tiny training runs through each backend (W&B offline with a run in ``tmp_path``,
MLflow on a SQLite store in ``tmp_path``, TensorBoard event files, the local store, memory). The
backend's own methods are wrapped to record the calls; they still run for real.

Contract: ``open`` first and once, ``write`` once per saved step, ``flush`` when the hook
flushes, ``close`` last and once; no failed or dropped record; a hook closed before any saved
step closes the backend cleanly. The same class replays (``tensorlens sync``): every backend that
replays gets each stored record once, and a second sync sends nothing.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens.backends.base import backend_class, replaying_backends

BACKENDS = tl.registered_backends()
#: what each built-in tracker needs to replay into ``tmp_path`` (a backend of one's own: its defaults)
REPLAY_OPTIONS = {
    "wandb": lambda tmp: {"offline": True, "wandb_dir": str(tmp / "wb"), "project": "tensorlens-contract"},
    "mlflow": lambda tmp: {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "contract"},
    "tensorboard": lambda tmp: {"logdir": str(tmp / "tb")},
}
LIBRARY = {"wandb": "wandb", "mlflow": "mlflow", "tensorboard": "tensorboard"}


@contextlib.contextmanager
def make_backend(name: str, tmp_path) -> Iterator[tl.Backend]:
    """The backend registered as ``name``, configured to write under ``tmp_path``."""
    if name == "wandb":
        wandb = pytest.importorskip("wandb")
        run = wandb.init(mode="offline", dir=str(tmp_path), project="tensorlens-contract", reinit="create_new")
        try:
            yield backend_class(name)(run=run)
        finally:
            run.finish()
    elif name == "mlflow":
        mlflow = pytest.importorskip("mlflow")
        uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
        client = mlflow.MlflowClient(tracking_uri=uri)
        run = client.create_run(experiment_id="0")
        try:
            yield backend_class(name)(tracking_uri=uri, run_id=run.info.run_id)
        finally:
            client.set_terminated(run.info.run_id)
    elif name == "tensorboard":
        pytest.importorskip("tensorboard")
        yield backend_class(name)()
    else:
        yield backend_class(name)()


def spy(backend: tl.Backend) -> list[str]:
    """Record the names of the lifecycle calls the dispatcher makes, in order; the real methods
    still run. A backend calling its own ``flush()`` from ``close()`` is not a second call."""
    calls: list[str] = []
    depth = [0]
    for method in ("open", "write", "flush", "close"):
        real = getattr(backend, method)

        def wrapper(*args, _real=real, _name=method):
            if not depth[0]:
                calls.append(_name)
            depth[0] += 1
            try:
                return _real(*args)
            finally:
                depth[0] -= 1

        setattr(backend, method, wrapper)  # an instance attribute shadows the class method
    return calls


def tiny_training(hook: tl.Hook, model: nn.Module, loss_fn: nn.Module) -> None:
    torch.manual_seed(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(5):
        opt.zero_grad()
        loss_fn(model(torch.randn(8, 6)), torch.randn(8, 3)).backward()
        opt.step()
    hook.flush()
    model.eval()
    with torch.no_grad():
        for _ in range(2):
            model(torch.randn(8, 6))
    model.train()


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_contract(name, tmp_path) -> None:
    cls = backend_class(name)
    assert cls.name == name, "backend_stats() is keyed by the class's `name`"
    for flag in ("supports_histograms", "supports_tensors", "main_process_only", "critical"):
        assert isinstance(getattr(cls, flag), bool), flag

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    loss_fn = nn.MSELoss()
    with make_backend(name, tmp_path) as backend, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calls = spy(backend)
        hook = tl.watch(model, loss_fn, save_interval=2, activations=True, out_dir=tmp_path / "run", backends=[backend])
        tiny_training(hook, model, loss_fn)
        hook.close()

    problems = [str(w.message) for w in caught if "tensorlens: backend" in str(w.message)]
    assert not problems, problems
    with tl.open_run(hook.run_dir) as run:
        saved = sum(len(run.steps(mode=mode)) for mode in run.modes())
        assert run.steps(mode="train") == [0, 2, 4] and run.steps(mode="eval") == [0]
    stats = hook.backend_stats()[name]
    assert (stats.written, stats.failed, stats.dropped) == (saved, 0, 0)
    assert calls[0] == "open" and calls.count("open") == 1
    assert calls.count("write") == saved
    assert "flush" in calls  # hook.flush() and close() reach the backend
    assert calls[-1] == "close" and calls.count("close") == 1


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_closes_cleanly_without_any_record(name, tmp_path) -> None:
    with make_backend(name, tmp_path) as backend, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calls = spy(backend)
        hook = tl.Hook(out_dir=tmp_path / "run", backends=[backend])
        hook.close()
    problems = [str(w.message) for w in caught if "tensorlens: backend" in str(w.message)]
    assert not problems, problems
    assert calls == ["close"]  # never opened: nothing was saved


@pytest.mark.parametrize("name", replaying_backends())
def test_every_backend_that_replays_gets_each_stored_record_once(name, tmp_path, monkeypatch) -> None:
    if name in LIBRARY:
        pytest.importorskip(LIBRARY[name])
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    loss_fn = nn.MSELoss()
    hook = tl.watch(model, loss_fn, save_interval=2, activations=True, out_dir=tmp_path / "run", backends=["local"])
    tiny_training(hook, model, loss_fn)
    hook.close()
    cls = backend_class(name)
    written = []
    real = cls.write
    monkeypatch.setattr(cls, "write", lambda self, record: (written.append((record.mode, record.step)), real(self, record)))
    options = REPLAY_OPTIONS.get(name, lambda tmp: {})(tmp_path)
    first = tl.sync_run(hook.run_dir, name, options=options, progress=False)
    with tl.open_run(hook.run_dir) as run:
        assert written == [(r.mode, r.step) for r in run.records()] and first.records_sent == len(written) == 4
    again = tl.sync_run(hook.run_dir, name, options=options, progress=False)
    assert again.records_sent == 0 and again.already_sent == 4 and again.run_id == first.run_id and len(written) == 4


def test_the_backends_that_replay_are_the_trackers() -> None:
    assert {"wandb", "mlflow", "tensorboard"} <= set(replaying_backends())
    assert not {"local", "memory"} & set(replaying_backends())  # the store itself; a list that ends with the sync
