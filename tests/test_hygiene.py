"""The suite leaves the checkout as it found it: conftest's check fails a session that writes into it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _pytest(project: Path, test: str) -> subprocess.CompletedProcess[str]:
    (project / "tests").mkdir(parents=True)
    shutil.copy(HERE / "conftest.py", project / "tests" / "conftest.py")
    (project / "tests" / "test_it.py").write_text(textwrap.dedent(test))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=project, capture_output=True, text=True, timeout=300,
    )


def test_a_session_that_writes_into_the_checkout_fails(tmp_path: Path) -> None:
    proc = _pytest(tmp_path / "project", """
        import os
        ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        def test_writes_into_the_checkout():
            os.makedirs(os.path.join(ROOT, "mlruns", "0"))
    """)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
    assert "the tests wrote into the repository" in proc.stdout and "'mlruns'" in proc.stdout


def test_relative_paths_and_trackers_defaults_stay_out_of_the_checkout(tmp_path: Path) -> None:
    project = tmp_path / "project"
    proc = _pytest(project, """
        import os
        def test_relative_writes():
            os.makedirs("mlruns/0")
            open("mlflow.db", "w").close()
            assert os.environ["MLFLOW_TRACKING_URI"].startswith("sqlite:///")
            assert "project" not in os.environ["MLFLOW_TRACKING_URI"]
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(os.listdir(project)) == ["tests"]
