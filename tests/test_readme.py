"""Every Python block of the README runs as pasted: in an empty namespace, or, when its first line
says ``# names from examples/X.py: a, b, ...``, after that example file, which must exist and
define every name listed; and every name the block uses without defining it must be listed (so
the marker tells a reader the whole truth). Each block runs in a fresh temporary folder, trackers
offline."""

from __future__ import annotations

import ast
import builtins
import os
import re
import runpy

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
MARKER = re.compile(r"# names from (examples/[\w/]+\.py): (.+)")


def python_blocks() -> list[tuple[int, str]]:
    text = open(README, encoding="utf-8").read()
    out = []
    for match in re.finditer(r"```python\n(.*?)```", text, re.S):
        out.append((text.count("\n", 0, match.start()) + 2, match.group(1)))
    return out


def marker(code: str) -> tuple[str, list[str]] | None:
    """The example file and names a block's first line names, or ``None``."""
    found = MARKER.fullmatch(code.split("\n", 1)[0].strip())
    if found is None:
        return None
    return found.group(1), [name.strip() for name in found.group(2).split(",")]


def free_names(code: str) -> set[str]:
    """Names the block reads that it never binds itself (imports, assignments, defs, arguments)."""
    tree = ast.parse(code)
    bound: set[str] = set()
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound - set(dir(builtins))


BLOCKS = python_blocks()


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_readme_block_runs_as_pasted(line: int, code: str, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    names = marker(code)
    namespace: dict[str, object] = {"__name__": "__readme__"}
    if names is not None:
        path, listed = names
        assert os.path.isfile(os.path.join(ROOT, path)), f"README.md:{line} names {path}, which does not exist"
        unlisted = free_names(code) - set(listed)
        assert not unlisted, f"README.md:{line} uses {sorted(unlisted)} without listing them in its first line"
        if {"LitModel", "loader"} & set(listed):
            pytest.importorskip("lightning")
        if {"hf_model", "training_args", "train_dataset"} & set(listed):
            pytest.importorskip("transformers")
        namespace = runpy.run_path(os.path.join(ROOT, path), run_name="readme_setup")
        missing = [name for name in listed if name not in namespace]
        assert not missing, f"README.md:{line}: {path} does not define {missing}"
    try:
        exec(compile(code, f"README.md:{line}", "exec"), namespace)  # noqa: S102 - the README's own code
    finally:
        if "mlflow" in code:  # the block sets MLflow's process-wide tracking URI: give later tests theirs back
            import mlflow

            mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", ""))


def test_every_block_says_where_its_names_come_from() -> None:
    """A block with no marker must use no name it does not define (it runs in an empty namespace)."""
    for line, code in BLOCKS:
        if marker(code) is None:
            assert not free_names(code), f"README.md:{line} uses {sorted(free_names(code))}: add a '# names from' line"


def test_the_marker_is_read_and_checked() -> None:
    assert marker("# names from examples/readme_setup.py: model, train\nx = 1\n") == ("examples/readme_setup.py", ["model", "train"])
    assert marker("x = 1\n") is None
    assert free_names("import torch\nhook = tl.watch(model)\ndef f(a):\n    return a + b\n") == {"tl", "model", "b"}


def test_the_readme_links_the_examples() -> None:
    text = open(README, encoding="utf-8").read()
    for example in ("quickstart.py", "lightning_wandb.py", "lightning_mlflow.py", "hf_trainer.py", "sync.py", "readme_setup.py"):
        assert f"(examples/{example})" in text, example
        assert os.path.isfile(os.path.join(ROOT, "examples", example))


def test_the_readme_states_no_placeholder() -> None:
    text = open(README, encoding="utf-8").read()
    assert "DYNAMICS_TABLE" not in text and "PERFORMANCE_TABLE" not in text
