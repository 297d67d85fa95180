"""The local run store: readable while written, intact after kill -9, names never become paths."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import tensorlens as tl


def test_readable_while_training_writes(tmp_path) -> None:
    model = nn.Linear(4, 2)
    hook = tl.watch(model, save_interval=1, out_dir=tmp_path / "run", backends=["local"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for _ in range(4):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        hook.flush()
        with tl.open_run(hook.run_dir) as run:  # a reader beside the live writer
            seen.append(run.steps())
    hook.close()
    assert seen == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]


CRASHING_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, torch
    import tensorlens as tl
    model = torch.nn.Linear(8, 4)
    hook = tl.watch(model, save_interval=1, out_dir=sys.argv[1], backends=["local"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 4:
            hook.flush()          # steps 0..4 are on disk
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_kill_9_keeps_every_flushed_step(tmp_path) -> None:
    script = tmp_path / "crash.py"
    script.write_text(CRASHING_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    with tl.open_run(str(tmp_path / "run")) as run:
        steps = run.steps()
        assert steps[:5] == [0, 1, 2, 3, 4]
        for step in steps:  # every step present is whole
            assert len(run.scalars(step)) == len(run.scalars(0))
        assert run.tensor("gradients/weight").reduction_value(step=4, name="l2") > 0


def test_hostile_names_stay_inside_the_run_folder(tmp_path) -> None:
    outside = tmp_path / "x"
    run_dir = tmp_path / "a" / "b" / "run"
    hook = tl.Hook(out_dir=run_dir, save_config=tl.SaveConfig(save_interval=1), include_collections=["summaries", "scalars"],
                   reduction_config=tl.ReductionConfig(save_raw_tensor=True))
    hook.save_tensor("../../x", torch.ones(3), collections_to_write="summaries")
    hook.save_scalar("../../../x", 1.0)
    hook.step()
    hook.close()
    assert not outside.exists()
    assert sorted(os.listdir(run_dir)) == [n for n in sorted(os.listdir(run_dir)) if n.startswith("tensorlens")]
    run = tl.open_run(str(run_dir))
    assert "summaries/../../x" in run.tensor_names()
    assert run.read_tensor("summaries/../../x", step=0).tensor.tolist() == [1.0, 1.0, 1.0]


def test_run_name_is_sanitised(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    hook = tl.Hook(run_name="../../evil/name")
    hook.close()
    assert os.path.dirname(hook.run_dir) == str(tmp_path / "tensorlens_runs")
    assert ".." not in os.path.basename(hook.run_dir)


def test_default_run_folder_and_reader_errors(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = nn.Linear(2, 2)
    with tl.watch(model, save_interval=1, backends=["local"]) as hook:
        model(torch.randn(1, 2)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert hook.run_dir.startswith(str(tmp_path / "tensorlens_runs"))
    run = tl.open_run(hook.run_dir)
    with pytest.raises(KeyError, match="no tensor"):
        run.tensor("gradients/nope")
    with pytest.raises(KeyError, match="recorded:"):
        run.tensor("gradients/weight").reduction_value(step=0, name="median")
    with pytest.raises(FileNotFoundError):
        tl.open_run(str(tmp_path))


def test_nan_survives_the_store(tmp_path) -> None:
    hook = tl.Hook(out_dir=tmp_path / "run", save_config=tl.SaveConfig(save_interval=1), include_collections=["summaries"])
    hook.save_tensor("t", torch.tensor([1.0, float("nan")]), collections_to_write="summaries")
    hook.step()
    hook.close()
    view = tl.open_run(str(tmp_path / "run")).tensor("summaries/t")
    assert view.reduction_value(step=0, name="nan_count") == 1
    assert view.reduction_value(step=0, name="mean") != view.reduction_value(step=0, name="mean")  # NaN
