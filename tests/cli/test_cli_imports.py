"""The commands that read stores do not import torch (about 2 s per command here), and
``import tensorlens`` binds its public API lazily without losing a name."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from cli_runs import ENV, write_store

from tensorlens.cli import COMMANDS

#: Commands that only read stores (sync needs a tracker's library: only its import is checked).
READERS = [name for name in COMMANDS if name != "wandb-install-chart"]


def python(code: str, *args: str, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          env=ENV, timeout=120, cwd=cwd)


@pytest.mark.parametrize("name", READERS)
def test_command_modules_do_not_import_torch(name: str) -> None:
    done = python("""
        import sys
        from tensorlens.cli.group import cli, LazyGroup
        import click
        command = cli.get_command(click.Context(cli), sys.argv[1])
        assert command is not None
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert not loaded, f"importing the {sys.argv[1]!r} command imported torch"
    """, name)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    top = tmp_path_factory.mktemp("runs")
    names = ["gradients/a.weight", "weights/a.weight", "activations/a"]
    stats = ("min", "max", "mean", "std", "l2", "nan_count", "inf_count", "numel")
    return (write_store(str(top / "a"), names, stats, steps=4), write_store(str(top / "b"), names, stats, steps=4, seed=1))


def _argv(name: str, a: str, b: str, out: str) -> list[str]:
    return {
        "ls": ["ls", os.path.dirname(a)],
        "show": ["show", a],
        "summary": ["summary", a],
        "export": ["export", a, "-o", os.path.join(out, "a.csv")],
        "report": ["report", a, b, "-o", os.path.join(out, "r.html")],
        "explore": ["explore", a, "-o", os.path.join(out, "e.html")],
        "rules": ["rules", a],
        "compare": ["compare", a, b],
    }[name]


@pytest.mark.parametrize("name", ["ls", "show", "summary", "export", "report", "explore", "rules", "compare"])
def test_reading_a_run_does_not_import_torch(two_runs: tuple[str, str], tmp_path, name: str) -> None:
    a, b = two_runs
    done = python("""
        import runpy, sys
        sys.argv = ["tensorlens", *sys.argv[1:]]
        try:
            runpy.run_module("tensorlens", run_name="__main__")
        except SystemExit as done:
            code = done.code
        else:
            code = 0
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        print("exit", code, file=sys.stderr)
        assert not loaded, f"python -m tensorlens {' '.join(sys.argv[1:2])} imported torch"
    """, *_argv(name, a, b, str(tmp_path)), cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "exit 0" in done.stderr or (name == "rules" and "exit 1" in done.stderr), done.stderr


def test_the_package_is_lazy_and_keeps_every_name() -> None:
    done = python("""
        import sys
        import tensorlens as tl
        assert "torch" not in sys.modules, "import tensorlens imported torch"
        assert tl.__version__
        assert set(tl.__all__) <= set(dir(tl)), set(tl.__all__) - set(dir(tl))
        import tensorlens.watch  # the submodule of the same name as the function
        assert callable(tl.watch) and tl.watch.__module__ == "tensorlens.watch", tl.watch
        from tensorlens import watch, open_run, Hook, rules, modes
        assert watch is tl.watch and rules.DeadRelu and modes.ModeKeys
        for name in tl.__all__:
            assert getattr(tl, name) is not None, name
        namespace = {}
        exec("from tensorlens import *", namespace)
        assert set(tl.__all__) <= set(namespace), set(tl.__all__) - set(namespace)
        try:
            tl.no_such_name
        except AttributeError as err:
            assert "no_such_name" in str(err)
        else:
            raise AssertionError("tl.no_such_name did not raise")
        assert tl.Hook.__name__ == "Hook" and tl.ModeKeys.TRAIN
        assert tl.scales.render_scales_png and tl.store.reader.open_run is tl.open_run  # subpackages as before
        assert not hasattr(tl, "_no_such_private")
    """)
    assert done.returncode == 0, done.stderr
