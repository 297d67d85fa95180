"""The layout's principles, checked: no import cycle among tensorlens's modules, every module opens
with a docstring saying what it holds, none grows far past 500 lines, and the core imports no
optional dependency at module level (``import tensorlens`` needs only torch and numpy)."""

from __future__ import annotations

import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"tensorlens": os.path.join(ROOT, "tensorlens"), "tensorlens.integrations": os.path.join(ROOT, "integrations")}
MAX_LINES = 560  # "about 500": a module past this is doing two things
OPTIONAL = {"wandb", "mlflow", "tensorboard", "lightning", "pytorch_lightning", "transformers", "matplotlib", "click",
            "tqdm", "pyarrow", "accelerate", "websocket"}


def modules() -> dict[str, str]:
    found = {}
    for package, folder in PACKAGES.items():
        for dirpath, _, files in os.walk(folder):
            for file in files:
                if file.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, file), folder)[:-3].replace(os.sep, ".")
                    name = package if rel == "__init__" else f"{package}.{rel.removesuffix('.__init__')}"
                    found[name] = os.path.join(dirpath, file)
    return found


def imported_names(node: ast.AST, package: str) -> set[str]:
    """The modules (and possible submodules) one import statement names, relative ones resolved."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
        return {base, *(f"{base}.{alias.name}" for alias in node.names)}
    return set()


def package_of(path: str, name: str) -> str:
    return name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]


def module_level_imports(path: str, name: str, typing: bool = False) -> set[str]:
    """tensorlens modules imported when ``name`` is imported (not inside functions; for typing
    only with ``typing``)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    out: set[str] = set()
    package = package_of(path, name)

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test) and not typing:
                continue
            out.update(imported_names(node, package))
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body + node.orelse + getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return out


def test_no_import_cycle() -> None:
    """Type-only imports count: a cycle a type checker sees is a cycle of concepts all the same."""
    mods = modules()
    graph = {
        name: {m for m in module_level_imports(path, name, typing=True) if m in mods and m != name}
        for name, path in mods.items()
    }
    # importing a submodule imports its packages first
    for name in list(graph):
        graph[name] |= {p for p in (".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)) if p in mods} - {name}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt == "tensorlens" or nxt.startswith("tensorlens.") and node.startswith(nxt + "."):
                continue  # a module importing its own package: the package is already being imported
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 5000))
    for name in sorted(graph):
        if name not in state:
            visit(name)


@pytest.mark.parametrize("name", sorted(modules()))
def test_every_module_says_what_it_holds_and_stays_small(name: str) -> None:
    path = modules()[name]
    source = open(path, encoding="utf-8").read()
    tree = ast.parse(source)
    if source.strip():
        assert ast.get_docstring(tree), f"{name} opens with no docstring"
    assert source.count("\n") <= MAX_LINES, f"{name} has {source.count(chr(10))} lines (> {MAX_LINES})"


# The CLI's subcommand modules are built on click (the ``cli`` extra): ``tensorlens.cli`` itself checks
# for it and names the extra before it imports them, and nothing else imports them.
@pytest.mark.parametrize(
    "name", sorted(n for n in modules() if not n.startswith(("tensorlens.integrations", "tensorlens.cli.")))
)
def test_the_core_imports_no_optional_dependency_at_import_time(name: str) -> None:
    imported = {m.split(".")[0] for m in module_level_imports(modules()[name], name)}
    assert not imported & OPTIONAL, f"{name} imports {sorted(imported & OPTIONAL)} at module level"


def all_imports(path: str, name: str) -> set[str]:
    """Every tensorlens module ``name`` imports anywhere: at module level, inside functions and
    for typing alike."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = package_of(path, name)
    return {module for node in ast.walk(tree) for module in imported_names(node, package)}


# The batched statistics are "jobs in, host statistics out": they know nothing of the recorder, the
# dispatcher thread, the captures or the backends, so they can be tested, benchmarked and changed alone.
COMPUTE_MUST_NOT_IMPORT = ("tensorlens.engine", "tensorlens.dispatch", "tensorlens.capture", "tensorlens.backends")


@pytest.mark.parametrize("name", sorted(n for n in modules() if n == "tensorlens.compute" or n.startswith("tensorlens.compute.")))
def test_compute_imports_nothing_of_the_recorder_the_dispatcher_the_captures_or_the_backends(name: str) -> None:
    imported = all_imports(modules()[name], name)
    wrong = sorted(m for m in imported if any(m == p or m.startswith(p + ".") for p in COMPUTE_MUST_NOT_IMPORT))
    assert not wrong, f"{name} imports {wrong}"


def test_the_compute_check_sees_every_kind_of_import(tmp_path) -> None:
    """The check above would catch an import inside a function, a relative one and a typing-only one."""
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tensorlens.engine.recorder import Recorder\n"
        "def f():\n    from ..dispatch import assemble\n    import tensorlens.backends.base\n"
    )
    path = tmp_path / "probe.py"
    path.write_text(source)
    found = all_imports(str(path), "tensorlens.compute.probe")
    assert {"tensorlens.engine.recorder", "tensorlens.dispatch", "tensorlens.backends.base"} <= found


# The packages split by thread (issue 23) share only public names: a private one (``from x import
# _y``) would tie a module to what its owner may change without notice. Dunder names are public.
THREAD_PACKAGES = ("tensorlens.engine", "tensorlens.compute", "tensorlens.dispatch")


@pytest.mark.parametrize("name", sorted(n for n in modules() if n.startswith(THREAD_PACKAGES)))
def test_no_private_name_is_imported_across_modules(name: str) -> None:
    tree = ast.parse(open(modules()[name], encoding="utf-8").read())
    wrong = [
        f"{node.module}.{alias.name}" for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and ((node.module or "").startswith("tensorlens") or node.level)
        for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not wrong, f"{name} imports private names {wrong}"


def test_every_file_docs_architecture_names_exists() -> None:
    """docs/architecture.md is the map of the code: every file it names (``engine/recorder.py``,
    relative to ``tensorlens/``, to the repository or, for a bare name, anywhere in the package)
    must exist, so a move that forgets the map fails here."""
    import re

    text = open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8").read()
    files = {os.path.relpath(path, ROOT) for path in modules().values()}
    names = {os.path.basename(path) for path in files}
    missing = []
    for found in sorted(set(re.findall(r"[\w./]*\w\.py\b", text))):
        if "/" in found:
            if not any(os.path.exists(os.path.join(base, found)) for base in (os.path.join(ROOT, "tensorlens"), ROOT)):
                missing.append(found)
        elif found not in names:
            missing.append(found)
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
