"""Every example runs as its docstring says, writes only where it is told, and prints what it read back.

Each runs in a fresh working directory with its output folder in pytest's tmp folder, so nothing
lands in the checkout; the Lightning examples run one epoch (40 optimizer steps) to stay short.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 300  # each takes 5-15 s here; the bound only keeps a hang from holding the suite


def _run(tmp_path: Path, example: str, *args: str) -> str:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", example), *args],
        cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_quickstart_runs(tmp_path: Path) -> None:
    out = _run(tmp_path, "quickstart.py")
    assert "saved steps: [0, 50, 100, 150, 200, 250]" in out
    assert "gradients/0.weight" in out
    # the documented default location, relative to the working directory (ignored by git)
    assert os.listdir(tmp_path / "cwd") == ["tensorlens_runs"]


def test_quickstart_prints_the_absolute_max_under_max_abs_x(tmp_path: Path) -> None:
    import tensorlens as tl

    out = _run(tmp_path, "quickstart.py")
    run_dir = re.search(r"run folder: (.*)", out).group(1).strip()
    grad = tl.open_run(os.path.join(tmp_path / "cwd", run_dir)).tensor("gradients/0.weight")
    printed = {int(step): float(v) for step, v in re.findall(r"step +(\d+) .*grad max\|x\| (\S+)", out)}
    assert printed and set(printed) == set(grad.steps())
    for step, value in printed.items():
        low, high = grad.reduction_value(step, "min"), grad.reduction_value(step, "max")
        assert value == pytest.approx(max(abs(low), abs(high)), abs=1e-4), step
    # the signed max would differ where the most negative value is the larger in magnitude
    assert any(abs(grad.reduction_value(s, "min")) > grad.reduction_value(s, "max") for s in printed)


def test_readme_setup_defines_the_readme_names(tmp_path: Path) -> None:
    out = _run(tmp_path, "readme_setup.py")
    assert "defined: tl, torch, nn, model, loss_fn, train" in out


def test_ddp_example_merges_both_ranks(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed")
    out = _run(tmp_path, "ddp.py", str(tmp_path / "run"))
    assert "workers: ['reduced']" in out
    assert "steps with activations (save_interval=5): [0, 5, 10, 15]" in out
    # 32 rows x 32 units of the first layer: the statistics cover both ranks' halves of the batch
    assert len(re.findall(r"activations/0 over 1024 values \(both ranks\)", out)) == 4
    assert (tmp_path / "run" / "tensorlens.sqlite").is_file()
    assert os.listdir(tmp_path / "cwd") == []


def test_lightning_mlflow_example(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    pytest.importorskip("mlflow")
    out = _run(tmp_path, "lightning_mlflow.py", str(tmp_path / "out"), "1")
    assert "saved train steps: [0, 10, 20, 30]  (trainer.global_step = 40)" in out
    history = re.search(r"e\.g\. tensorlens-gradients/net\.0\.weight/l2:\n  (.*)", out)
    assert history is not None, out
    assert [int(s) for s in re.findall(r"step (\d+):", history.group(1))] == [0, 10, 20, 30]
    # the MLflow values are the local store's values (both printed with 4 decimals)
    local = re.findall(r"step +(\d+) +grad l2 ([\d.]+)", out)
    assert [f"step {s}: {v}" for s, v in local] == history.group(1).split(", ")
    assert sorted(os.listdir(tmp_path / "out")) == ["artifacts", "mlflow.db", "tensorlens_runs"]
    assert os.listdir(tmp_path / "cwd") == []


def test_lightning_wandb_example(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    pytest.importorskip("wandb")
    out = _run(tmp_path, "lightning_wandb.py", str(tmp_path / "out"), "1")
    assert "saved train steps: [0, 10, 20, 30]  (trainer.global_step = 40)" in out
    sent = re.search(r"sent to W&B: BackendStats\(written=(\d+), failed=(\d+)", out)
    assert sent is not None and int(sent.group(1)) > 0 and sent.group(2) == "0", out
    clipped = [float(v) for v in re.findall(r"after clipping ([\d.]+)", out)]
    assert len(clipped) == 4 and all(v <= 0.2 + 1e-4 for v in clipped)  # gradient_clip_val=0.2 (norm)
    assert sorted(os.listdir(tmp_path / "out")) == ["tensorlens_runs", "wandb"]
    assert os.listdir(tmp_path / "cwd") == []


def test_sync_example(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    out = _run(tmp_path, "sync.py", str(tmp_path / "out"))
    assert os.listdir(tmp_path / "cwd") == []
    assert "recorded" in out and "train steps [0, 10, 20, 30, 40, 50, 60, 70, 80, 90]" in out
    assert "[mlflow] sent 12 records to a new run" in out and "[wandb] sent 12 records to a new run" in out
    assert out.count("again: 5 new records, 12 there already") == 2
    assert "equal to the local store: True" in out
    assert re.search(r"wandb sync --id \w+ -p tensorlens-sync \S+offline-run-\S+ \S+offline-run-\S+", out)
    assert sorted(os.listdir(tmp_path / "out")) == ["mlflow-artifacts", "mlflow.db", "run", "wandb"]


def test_hf_trainer_example(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    out = _run(tmp_path, "hf_trainer.py", str(tmp_path / "out"))
    assert os.listdir(tmp_path / "cwd") == []
    assert "saved train steps: [5, 10, 15, 20, 25, 30]  (trainer.state.global_step = 30)" in out
    assert "sent to: ['local', 'wandb', 'tensorboard']" in out
    rows = re.findall(r"gradient norm ([\d.]+) \(Trainer's grad_norm ([\d.]+)\) -> after clipping ([\d.]+)", out)
    assert len(rows) == 6
    for ours, trainers, clipped in rows:
        assert ours == trainers  # the same number as the Trainer's own log, at the same global step
        assert float(clipped) == pytest.approx(min(float(ours), 0.3), abs=2e-4)
    # each evaluation's first batch (eval save_interval 5) and its last, which carries the Trainer's
    # eval_loss (the losses collection saves every eval step: an evaluation's loss arrives once)
    assert "eval records (global step, eval step): [(10, 0), (10, 3), (20, 5), (20, 7), (30, 10), (30, 11)]" in out
    assert sorted(os.listdir(tmp_path / "out")) == ["trainer", "wandb"]
    assert sorted(os.listdir(tmp_path / "out" / "trainer")) == ["runs", "tensorlens_runs"]
