"""The sync and Hugging Face Trainer examples run as their docstrings say, write only where they
are told, and print what they read back (each in a fresh working directory)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 300  # each takes 10-20 s here; the bound only keeps a hang from holding the suite


def _run(tmp_path: Path, example: str, *args: str) -> str:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    env.pop("WANDB_DIR", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", example), *args],
        cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert os.listdir(cwd) == []
    return proc.stdout


def test_sync_example(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    out = _run(tmp_path, "sync.py", str(tmp_path / "out"))
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
    assert "saved train steps: [5, 10, 15, 20, 25, 30]  (trainer.state.global_step = 30)" in out
    assert "sent to: ['local', 'wandb', 'tensorboard']" in out
    rows = re.findall(r"gradient norm ([\d.]+) \(Trainer's grad_norm ([\d.]+)\) -> after clipping ([\d.]+)", out)
    assert len(rows) == 6
    for ours, trainers, clipped in rows:
        assert ours == trainers  # the same number as the Trainer's own log, at the same global step
        assert float(clipped) == pytest.approx(min(float(ours), 0.3), abs=2e-4)
    assert "eval records (global step, eval step): [(10, 0), (20, 5), (30, 10)]" in out
    assert sorted(os.listdir(tmp_path / "out")) == ["trainer", "wandb"]
    assert sorted(os.listdir(tmp_path / "out" / "trainer")) == ["runs", "tensorlens_runs"]
