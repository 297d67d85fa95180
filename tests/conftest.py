"""Shared test settings: W&B never goes online, and nothing a test writes lands in the checkout.

Every test runs in its own empty working directory, and MLflow's default tracking store (a
``mlflow.db`` and ``mlruns/`` in the working directory) points into the session's tmp folder, so
``mlruns/``, ``wandb/``, ``tensorlens_runs/`` and ``lightning_logs/`` written by default go there.
At the end of the session the repository is compared with what it held at the start: a file or
folder that appeared fails the run and is named.
"""

from __future__ import annotations

import os
import shutil
import tempfile

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# written by Python and tools, never by tensorlens or a tracker
_IGNORED_NAMES = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".venv", ".mypy_cache"}
_SESSION_DIR = tempfile.mkdtemp(prefix="tensorlens-tests-")
# before any test imports mlflow: its default store would be ./mlflow.db and ./mlruns
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{os.path.join(_SESSION_DIR, 'mlflow.db')}"


def repository_paths(root: str = ROOT) -> set[str]:
    """Every file and folder under ``root`` (relative), leaving out caches and build metadata."""
    found: set[str] = set()
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _IGNORED_NAMES and not d.endswith(".egg-info")]
        relative = os.path.relpath(folder, root)
        for name in dirs + files:
            found.add(os.path.normpath(os.path.join(relative, name)))
    return found


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_BEFORE] = repository_paths()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)
    before = session.config.stash.get(_BEFORE, None)
    if before is None:
        return
    new = sorted(repository_paths() - before)
    if new:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"the tests wrote into the repository ({ROOT}): {new[:20]}"
        if reporter is not None:
            reporter.write("\n")
            reporter.write_line(message, red=True)
        else:
            print(message)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BEFORE = pytest.StashKey[set]()


@pytest.fixture(autouse=True, scope="session")
def _session_working_directory() -> object:
    """Session and module fixtures run in a tmp folder too (before the per-test one applies)."""
    previous = os.getcwd()
    os.chdir(_SESSION_DIR)
    yield _SESSION_DIR
    os.chdir(previous)


@pytest.fixture(autouse=True)
def _working_directory(tmp_path_factory: pytest.TempPathFactory) -> object:
    """Each test starts in an empty folder of its own: relative paths never reach the checkout."""
    previous = os.getcwd()
    cwd = tmp_path_factory.mktemp("cwd")
    os.chdir(cwd)  # not monkeypatch.chdir: a test's monkeypatch.undo() must not bring it back
    yield cwd
    os.chdir(previous)


@pytest.fixture(params=["native", "torch", "triton"])
def kernel(request, monkeypatch):
    """Run a test with the compiled CPU kernel, with PyTorch ops alone (TENSORLENS_NATIVE=0) and with
    the fused Triton kernels (TENSORLENS_STATS_PATH=triton; on CPU tensors only in Triton's
    interpreter, TRITON_INTERPRET=1): all must give the same, exact statistics. A session run with
    TENSORLENS_STATS_PATH set takes that path only (CI runs the suite once more with =triton)."""
    from tensorlens.stats import native, path

    chosen = os.environ.get("TENSORLENS_STATS_PATH")
    if chosen and chosen != request.param:
        pytest.skip(f"this session runs the {chosen} path only (TENSORLENS_STATS_PATH={chosen})")
    if request.param == "torch":
        monkeypatch.setenv("TENSORLENS_NATIVE", "0")
    if request.param == "triton":
        if not path.triton_importable():
            pytest.skip("triton is not installed (pip install --no-deps triton==3.9.0): the Triton path is not tested")
        if not path.interpreting():
            pytest.skip("the Triton kernels read CPU tensors only in Triton's interpreter: run with TRITON_INTERPRET=1 "
                        "(as .ci/run does)")
        monkeypatch.setenv("TENSORLENS_STATS_PATH", "triton")
    native.reset()
    path.reset()
    if request.param == "native" and not native.available():
        pytest.skip("no C compiler here: the compiled kernel is not built (PyTorch ops are used)")
    yield request.param
    monkeypatch.undo()
    native.reset()
    path.reset()


@pytest.fixture
def kernel_on(monkeypatch):
    """The compiled kernel in use (skipped where no C compiler builds it), whatever the environment
    asks for; forgotten again afterwards."""
    from tensorlens.stats import native

    monkeypatch.delenv("TENSORLENS_NATIVE", raising=False)
    monkeypatch.delenv("TENSORLENS_STATS_PATH", raising=False)
    native.reset()
    if not native.available():
        pytest.skip("no C compiler here: the compiled kernel is not built")
    yield
    native.reset()
