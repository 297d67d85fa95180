"""One extension point per tracker: a backend of the user's own, registered once with
``tl.register_backend``, records live and is a ``tensorlens sync`` destination, through
``tl.sync_run`` and through the command (its module named by ``--backend-module`` or
``TENSORLENS_BACKENDS``), resumably: the sync machinery keeps what was sent and the tracker run to
continue, so a second sync sends only the steps recorded since. No tracker library is needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens.backends import base

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: what the list backend was given, across its instances: ("open", run name) ... ("close",)
CALLS: list[tuple[Any, ...]] = []


class ListBackend(tl.Backend):
    """The smallest backend: it overrides ``write`` (and records the other calls)."""

    def open(self, run: tl.RunInfo) -> None:
        CALLS.append(("open", run.run_name))

    def write_metadata(self, metadata: Any) -> None:
        CALLS.append(("metadata", metadata["model"]["parameters"]))

    def write(self, record: tl.StepRecord) -> None:
        CALLS.append(("write", str(record.mode), record.step, record.mode_step, record.scalar_dict()))

    def close(self) -> None:
        CALLS.append(("close",))


class JsonLinesBackend(tl.Backend):
    """A backend with an option and a tracker run id of its own: one file per run in ``folder``."""

    replay_options: ClassVar[tuple[str, ...]] = ("folder",)

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: Any = None

    @classmethod
    def replay_settings(cls, options: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(options.get("folder"), str):
            raise ValueError(f"Expected `folder` to be a folder, got {options.get('folder')!r}")
        return {"folder": os.path.abspath(options["folder"])}

    @classmethod
    def open_for_replay(cls, replay: Any, run_name: str) -> tuple[tl.Backend, str]:
        run_id = replay.run_id or f"{run_name}-{len(os.listdir(replay.options['folder']))}"
        return cls(os.path.join(replay.options["folder"], run_id + ".jsonl")), run_id

    def open(self, run: tl.RunInfo) -> None:
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: tl.StepRecord) -> None:
        self._file.write(json.dumps({"mode": str(record.mode), "step": record.step, "mode_step": record.mode_step}) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


@pytest.fixture(autouse=True)
def _registry() -> Iterator[None]:
    """Each test registers its own backends; the registry is as it was afterwards."""
    saved = dict(base._REGISTRY)
    CALLS.clear()
    try:
        yield
    finally:
        base._REGISTRY.clear()
        base._REGISTRY.update(saved)


def train(out_dir: str, steps: int, resume: str = "never", seed: int = 0) -> str:
    """A tiny model, every step saved, an evaluation batch after every second step."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    hook = tl.watch(model, save_interval=1, activations=True, out_dir=out_dir, backends=["local"], resume=resume)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        if step % 2 == 1:
            model.eval()
            with torch.no_grad():
                model(torch.randn(2, 3))
            model.train()
    hook.close()
    return hook.run_dir


def stored_records(run_dir: str) -> list[tuple[Any, ...]]:
    with tl.open_run(run_dir) as stored:
        return [("write", str(r.mode), r.step, r.mode_step, r.scalar_dict()) for r in stored.records()]


def writes() -> list[tuple[Any, ...]]:
    return [c for c in CALLS if c[0] == "write"]


# ---------------------------------------------------------------------------------------- sync_run


def test_a_user_backend_registered_once_records_live_and_replays_resumably(tmp_path: Any) -> None:
    tl.register_backend("listing", ListBackend)
    assert "listing" in tl.sync.sync_target_names()
    run_dir = train(str(tmp_path / "run"), steps=4)
    with tl.open_run(run_dir) as stored:
        name = stored.meta["run_name"]

    first = tl.sync_run(run_dir, to="listing", progress=False)
    assert first.new_run and first.target == "listing" and first.already_sent == 0
    assert writes() == stored_records(run_dir)  # every record, in the store's order, as stored
    assert CALLS[0] == ("open", name) and CALLS[1] == ("metadata", 3 * 4 + 4 + 4 + 1) and CALLS[-1] == ("close",)
    assert first.sent == {("train", "worker_0"): 4, ("eval", "worker_0"): 2}

    sent = {c[1:4] for c in writes()}
    CALLS.clear()  # nothing new: no backend is even created
    nothing = tl.sync_run(run_dir, to="listing", progress=False)
    assert nothing.records_sent == 0 and nothing.already_sent == 6 and CALLS == []
    assert nothing.run_id == first.run_id

    train(run_dir, steps=3, resume="allow", seed=1)  # the run goes on
    CALLS.clear()
    again = tl.sync_run(run_dir, to="listing", progress=False)
    new = [r for r in stored_records(run_dir) if r[1:4] not in sent]
    assert writes() == new and len(new) == 3 + 1  # only what is new, once
    assert again.run_id == first.run_id and not again.new_run and again.already_sent == 6
    assert ("metadata", 21) not in CALLS  # the metadata went with the new tracker run only

    # the live path of the same class: backends=["listing"]
    CALLS.clear()
    hook = tl.watch(nn.Linear(2, 1), out_dir=str(tmp_path / "live"), backends=["listing"])
    hook.close()
    assert CALLS[-1] == ("close",)


def test_a_backend_with_options_and_run_ids_of_its_own(tmp_path: Any) -> None:
    tl.register_backend("jsonl", JsonLinesBackend)
    run_dir = train(str(tmp_path / "run"), steps=2)
    folder = tmp_path / "out"
    folder.mkdir()
    first = tl.sync_run(run_dir, "jsonl", folder=str(folder), progress=False)
    assert first.target == f"jsonl:folder={folder}" and first.run_id.endswith("-0")
    train(run_dir, steps=2, resume="allow", seed=1)
    again = tl.sync_run(run_dir, "jsonl", options={"folder": str(folder)}, progress=False)  # the same, as a dict
    assert again.run_id == first.run_id and again.records_sent == first.records_sent == 3
    (written,) = os.listdir(folder)
    with open(folder / written, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    with tl.open_run(run_dir) as stored:
        assert sorted((line["mode"], line["step"], line["mode_step"]) for line in lines) == sorted(
            (str(r.mode), r.step, r.mode_step) for r in stored.records()
        )
    # a new run on request: the backend names it
    assert tl.sync_run(run_dir, "jsonl", folder=str(folder), new_run=True, progress=False).run_id.endswith("-1")


def test_bad_destinations_and_options_name_the_backend_and_what_it_takes(tmp_path: Any) -> None:
    tl.register_backend("listing", ListBackend)
    tl.register_backend("jsonl", JsonLinesBackend)
    run_dir = train(str(tmp_path / "run"), steps=1)
    with pytest.raises(ValueError, match=r"Expected `colour` to be None with --to jsonl \(it takes folder\)"):
        tl.sync_run(run_dir, "jsonl", folder="x", colour="red")
    with pytest.raises(ValueError, match=r"Expected `folder` to be None with --to listing \(it takes no options\)"):
        tl.sync_run(run_dir, "listing", options={"folder": "x"})
    with pytest.raises(ValueError, match="Expected `folder` to be a folder"):
        tl.sync_run(run_dir, "jsonl")
    with pytest.raises(ValueError, match="given once"):
        tl.sync_run(run_dir, "jsonl", options={"folder": "x"}, folder="x")
    for name in ("memory", "local"):  # registered, but they do not replay
        with pytest.raises(ValueError, match="supports_replay = False"):
            tl.sync_run(run_dir, name)
    assert not {"memory", "local"} & set(tl.sync.sync_target_names())
    with pytest.raises(ValueError, match=r"Expected `to` to be one of \[.*'listing'"):
        tl.sync_run(run_dir, "neptune")
    # a class that is not registered works too (its name is the destination)
    ListBackend.name = "unregistered-list"
    try:
        assert tl.sync_run(run_dir, ListBackend, progress=False).target == "unregistered-list"
    finally:
        del ListBackend.name


def test_register_sync_target_is_a_deprecated_alias(tmp_path: Any) -> None:
    from tensorlens.sync import SyncTarget, register_sync_target

    with pytest.warns(DeprecationWarning, match="tl.register_backend"):
        register_sync_target("listing", ListBackend)
    assert "listing" in tl.registered_backends()
    with pytest.raises(ValueError, match="a Backend class"):
        register_sync_target("old", SyncTarget)


# ---------------------------------------------------------------------------------------- the command


BACKEND_MODULE = '''
"""Registers the jsonl backend of the test for `tensorlens sync`."""
import tensorlens as tl
from test_sync_user_backend import JsonLinesBackend
tl.register_backend("jsonl", JsonLinesBackend)
'''


@pytest.fixture
def backend_module(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_trackers.py").write_text(textwrap.dedent(BACKEND_MODULE), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(os.path.dirname(os.path.abspath(__file__)))
    yield "my_trackers"
    sys.modules.pop("my_trackers", None)


def test_the_command_replays_into_a_backend_its_module_registers(
    tmp_path: Any, backend_module: str, capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("click")
    from tensorlens.cli import main

    run_dir = train(str(tmp_path / "run"), steps=3)
    out = tmp_path / "out"
    out.mkdir()
    # unknown until its module is imported: a usage error (2)
    assert main(["sync", run_dir, "--to", "jsonl", "--option", f"folder={out}"]) == 2
    assert "'jsonl' is not one of" in capsys.readouterr().err
    args = ["sync", run_dir, "--backend-module", backend_module, "--to", "jsonl", "--option", f"folder={out}", "--no-progress"]
    assert main(args) == 0
    assert f"4 new records of {os.path.normpath(run_dir)} sent to jsonl:folder={out} (created run" in capsys.readouterr().out
    train(run_dir, steps=2, resume="allow", seed=1)
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "3 new records" in printed and "continued run" in printed and "4 were there already" in printed
    (written,) = os.listdir(out)
    with open(out / written, encoding="utf-8") as f:
        assert len(f.readlines()) == 7  # each record once
    # errors: one line, exit 1 (the backend's) or 2 (the command's usage)
    assert main(["sync", run_dir, "--backend-module", backend_module, "--to", "jsonl", "--option", "colour=red"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Error: Expected `colour` to be None with --to jsonl (it takes folder)") and err.count("\n") == 1
    assert main(["sync", run_dir, "--to", "tensorboard", "--option", "nokey"]) == 2
    assert "'nokey' is not KEY=VALUE" in capsys.readouterr().err
    assert main(["sync", run_dir, "--to", "tensorboard", "--logdir", "a", "--option", "logdir=b"]) == 2
    assert "given by --logdir already" in capsys.readouterr().err
    assert main(["sync", run_dir, "--backend-module", "no_such_module_here", "--to", "jsonl"]) == 1
    err = capsys.readouterr().err
    assert "could not import the backend module 'no_such_module_here'" in err and "Traceback" not in err
    assert main(["sync", run_dir, "--to", "memory"]) == 2  # registered, does not replay


def test_tensorlens_backends_names_the_modules_and_help_lists_them_without_importing_a_tracker(tmp_path: Any) -> None:
    pytest.importorskip("click")
    (tmp_path / "my_trackers.py").write_text(textwrap.dedent(BACKEND_MODULE), encoding="utf-8")
    here = os.path.dirname(os.path.abspath(__file__))
    script = (
        "import sys\nfrom tensorlens.cli import main\ncode = main(sys.argv[1:])\n"
        "print('IMPORTED', sorted(m for m in ('torch', 'wandb', 'mlflow', 'tensorboard') if m in sys.modules))\n"
        "sys.exit(code)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, str(tmp_path), here]), "TENSORLENS_BACKENDS": "my_trackers"}
    done = subprocess.run([sys.executable, "-c", script, "sync", "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "[jsonl|mlflow|tensorboard|wandb]" in " ".join(done.stdout.split())
    # the module imports torch (the test's); a plain help imports no tracker and no torch
    env.pop("TENSORLENS_BACKENDS")
    plain = subprocess.run([sys.executable, "-c", script, "sync", "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert plain.returncode == 0 and "[mlflow|tensorboard|wandb]" in " ".join(plain.stdout.split())
    assert "IMPORTED []" in plain.stdout


def test_the_lazy_replay_flags_are_the_classes_own() -> None:
    """``replaying_backends`` answers for the built-ins without importing them; it must agree."""
    for entry, replays in base._LAZY_REPLAYS.items():
        module, attribute = entry.split(":")
        try:
            cls = getattr(__import__(module, fromlist=[attribute]), attribute)
        except ImportError:
            continue
        assert cls.supports_replay is replays, entry
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set(base.replaying_backends()) >= {"wandb", "mlflow", "tensorboard"}
