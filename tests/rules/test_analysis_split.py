"""Run comparison and the Trial API live in tensorlens.analysis, apart from the rules: the rules
never import analysis at import time (both compare records through tensorlens.record_diff; the
one use, offline evaluate's causes from tl.explain, is imported inside it), and every name the
rules package documented stays reachable there, whichever package a program imports first."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

import tensorlens
from tensorlens import analysis
from tensorlens import rules as R

RULES = os.path.join(os.path.dirname(tensorlens.__file__), "rules")
MOVED = ("Comparison", "Divergence", "StepState", "Trial", "TrialTensor", "compare_records", "compare_runs", "create_trial")


def _imports(path: str) -> set[str]:
    """Every module an import statement in ``path`` names, wherever it stands (functions and
    ``TYPE_CHECKING`` blocks included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


#: The one use of analysis by the rules, imported inside the function that needs it (never at
#: import time, so neither package needs the other loaded first): offline ``evaluate`` hands its
#: findings to ``tl.explain``'s ``attach_causes`` (what moved first before a NaN or a spike).
ALLOWED_INSIDE_FUNCTIONS = {
    "offline.py": {"tensorlens.analysis.explain", "tensorlens.analysis.explain.attach_causes"},
    "online.py": {"tensorlens.analysis.explain", "tensorlens.analysis.explain.TrailingSteps"},  # online causes
}


def _function_imports(path: str) -> set[str]:
    """The modules imported inside function bodies of ``path``."""
    found: set[str] = set()
    for function in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and node.module:
                    found.add(node.module)
                    found.update(f"{node.module}.{alias.name}" for alias in node.names)
                elif isinstance(node, ast.Import):
                    found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(RULES) if f.endswith(".py")))
def test_no_rules_module_imports_analysis(name: str) -> None:
    path = os.path.join(RULES, name)
    imported = {m for m in _imports(path) if m == "tensorlens.analysis" or m.startswith("tensorlens.analysis.")}
    allowed = ALLOWED_INSIDE_FUNCTIONS.get(name, set()) & _function_imports(path)
    assert not imported - allowed, f"tensorlens/rules/{name} imports {sorted(imported - allowed)}"


@pytest.mark.parametrize("name", MOVED)
def test_moved_names_stay_where_they_were_documented(name: str) -> None:
    assert name in R.__all__ and name in dir(R)
    assert getattr(R, name) is getattr(analysis, name)


def test_top_level_names_are_the_analysis_ones() -> None:
    assert tensorlens.compare_runs is analysis.compare_runs
    assert tensorlens.create_trial is analysis.create_trial


def test_every_rules_name_resolves() -> None:
    for name in R.__all__:
        assert getattr(R, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        R.nothing_here  # noqa: B018


@pytest.mark.parametrize("first", ["tensorlens.analysis.trial", "tensorlens.analysis.compare", "tensorlens.rules",
                                   "tensorlens.rules.exceptions", "tensorlens.analysis"])
def test_either_package_imports_first(first: str) -> None:
    """An eager re-export in rules/__init__ would be a cycle (analysis.trial -> rules.exceptions ->
    rules -> analysis.trial): importing analysis first failed on a partly initialised module."""
    code = (f"import importlib; importlib.import_module({first!r})\n"
            "from tensorlens.rules import *\n"
            "from tensorlens.rules import Trial, compare_runs, TensorUnavailable\n"
            "import tensorlens.analysis as A, tensorlens.rules.exceptions as E\n"
            "assert Trial is A.Trial and compare_runs is A.compare_runs and TensorUnavailable is E.TensorUnavailable\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
