"""Run metadata: what it holds, that it reaches every backend once before the first record, that
two runs of one model get one key set, and that git can never hold a run up."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens.engine.metadata import LazyMetadata, flatten, git_commit, model_metadata


class Recording(tl.MemoryBackend):
    """A memory backend that notes the order of the calls it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write_metadata(self, metadata: Any) -> None:
        self.calls.append("metadata")
        super().write_metadata(metadata)

    def write(self, record: Any) -> None:
        self.calls.append("record")
        super().write(record)


def train(hook: tl.Hook, model: nn.Module, steps: int = 3) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 5, dtype=dtype)).sum().backward()
        opt.step()
    hook.close()


def test_metadata_reaches_every_backend_once_before_the_first_record(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    model[2].bias.requires_grad_(False)
    backend = Recording()
    hook = tl.watch(model, save_interval=1, backends=[backend], out_dir=tmp_path / "run")
    train(hook, model)
    assert backend.calls == ["metadata", "record", "record", "record"]
    meta = backend.metadata
    assert meta["model"] == {
        "parameters": 5 * 4 + 4 + 4 * 2 + 2, "trainable_parameters": 5 * 4 + 4 + 4 * 2,
        "parameters_per_module": {"0": 24, "2": 10}, "dtype": "float32", "device": "cpu", "class": "Sequential",
    }
    assert meta["versions"] == {"tensorlens": tl.__version__, "torch": torch.__version__,
                                "python": ".".join(map(str, sys.version_info[:3]))}
    assert meta["run"] == {"world_size": 1, "include_workers": "reduce"}
    assert meta["config"]["collections"] == hook.enabled_collections()
    assert meta["config"]["save"]["train"] == {"save_interval": 1, "start_step": 0, "end_step": None, "save_steps": []}
    assert meta["config"]["histograms"]["bins"] == 64
    assert set(meta["git"]) == {"commit"}
    # the local store keeps the same, and gives it back
    with tl.open_run(hook.run_dir) as run:
        assert run.metadata() == meta


def test_two_runs_of_one_model_have_the_same_keys(tmp_path: Any) -> None:
    runs = []
    for i, kwargs in enumerate([
        {"save_config": tl.SaveConfig(save_interval=1)},
        {"save_config": tl.SaveConfig(save_interval=2, end_step=9, save_steps=[1],
                                       mode_save_configs={"eval": tl.SaveConfigMode(save_interval=1)}),
         "reduction_config": tl.ReductionConfig(reductions=["max"], abs_norms=["l1"], counts=["zero_fraction"]),
         "histogram_config": tl.HistogramConfig(bins=0), "include_collections": ["gradients"], "include_workers": "all"},
    ]):
        torch.manual_seed(i)
        model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
        if i:
            model = model.double()
        backend = Recording()
        hook = tl.Hook(out_dir=tmp_path / f"run{i}", backends=[backend], **kwargs)
        hook.register_module(model)
        train(hook, model)
        runs.append(flatten(backend.metadata))
    assert runs[0].keys() == runs[1].keys()
    assert runs[0]["model.dtype"] == "float32" and runs[1]["model.dtype"] == "float64"
    assert runs[1]["config.save.eval.save_interval"] == 1 and runs[1]["config.save.train.save_steps"] == "[1]"


def test_model_metadata_counts_tied_weights_once() -> None:
    embedding = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    model = nn.ModuleDict({"embed": embedding, "head": head})
    seen, parameters = set(), []
    for name, p in model.named_parameters():  # as the recorder lists them: tied weights once
        if id(p) not in seen:
            seen.add(id(p))
            parameters.append((name, p))
    assert model_metadata(parameters)["parameters_per_module"] == {"embed": 40}
    assert model_metadata([])["dtype"] is None


def test_flatten_and_lazy_metadata() -> None:
    nested = {"a": {"b": 1, "c": [1, 2], "d": {}}, "e": None}
    assert flatten(nested) == {"a.b": 1, "a.c": "[1, 2]", "a.d": "{}", "e": None}
    built = []

    def build() -> dict[str, int]:
        built.append(1)
        time.sleep(0.05)  # several threads ask at once: one builds, the others wait for it
        return {"x": 1}

    lazy = LazyMetadata(build)
    threads = [threading.Thread(target=lambda: dict(lazy)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert built == [1] and dict(lazy) == {"x": 1}


def test_git_commit(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert git_commit(str(tmp_path)) is None  # not a checkout
    repo = tmp_path / "repo"
    repo.mkdir()
    try:
        for command in (["git", "init", "-q"], ["git", "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q",
                                                  "--allow-empty", "-m", "x"]):
            subprocess.run(command, cwd=repo, check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git here")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert git_commit(str(repo)) == head
    # a git that hangs costs the timeout, not the run
    slow = tmp_path / "bin"
    slow.mkdir()
    (slow / "git").write_text("#!/bin/sh\nsleep 30\n")
    (slow / "git").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{slow}{os.pathsep}{os.environ['PATH']}")
    started = time.monotonic()
    assert git_commit(str(repo), timeout=0.5) is None
    assert time.monotonic() - started < 10
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))  # no git at all
    assert git_commit(str(repo)) is None


def test_sync_and_the_core_need_no_optional_dependency(tmp_path: Any) -> None:
    blocked = ["wandb", "mlflow", "tensorboard", "transformers", "accelerate", "click", "tqdm", "lightning", "matplotlib"]
    script = textwrap.dedent(f"""
        import sys
        for name in {blocked!r}:  # None in sys.modules: "import name" fails, find_spec says "not installed"
            sys.modules[name] = None
        import torch, tensorlens as tl
        from tensorlens.sync import sync_run
        model = torch.nn.Linear(3, 2)
        with tl.watch(model, save_interval=1, out_dir=sys.argv[1]) as hook:
            model(torch.randn(2, 3)).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
        print("parameters:", tl.open_run(hook.run_dir).metadata()["model"]["parameters"])
        for to, extra in (("wandb", {{}}), ("mlflow", {{}}), ("tensorboard", {{"logdir": sys.argv[1] + "-tb"}})):
            try:
                sync_run(hook.run_dir, to, **extra)
            except ImportError as err:
                print("hint:", err)
        try:
            import tensorlens.integrations.transformers
        except ImportError as err:
            print("hint:", err)
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "parameters: 8" in proc.stdout
    for extra in ("wandb", "mlflow", "tensorboard", "transformers"):
        assert f"pip install 'tensorlens[{extra}]'" in proc.stdout, proc.stdout
