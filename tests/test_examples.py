"""The quickstart example runs as the README says and prints what it read back."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_runs(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "quickstart.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "saved steps: [0, 50, 100, 150, 200, 250]" in proc.stdout
    assert "gradients/0.weight" in proc.stdout
    assert (tmp_path / "tensorlens_runs").is_dir()
