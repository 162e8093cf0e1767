"""The package's layout, read from its real import graph (docs/architecture.md): no import cycle
(function-level imports count: one that closes a cycle only hides it), no ``_private`` name or
private module imported from another module, and no module over 450 lines unless its docstring
says why ("Long because ...").  The checks are unit-tested on small made-up packages first, so
each can be seen to fail."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "shmstage"
MAX_LINES = 450


@dataclass(frozen=True)
class Edge:
    """``importer`` imports ``imported`` at ``line`` (``names``: what it takes from it)."""

    importer: str
    imported: str
    line: int
    names: tuple[str, ...]


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name (a package by its __init__)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that runs (``if TYPE_CHECKING:`` blocks never do)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for child in ast.iter_child_nodes(node):
            if not _type_checking_only(child):
                stack.append(child)


def from_module(node: ast.ImportFrom, name: str, path: Path) -> str:
    """The absolute module a ``from ... import`` in module ``name`` (file ``path``) names."""
    base = node.module or ""
    if not node.level:
        return base
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    anchor = here.split(".")
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([base] if base else []))


def edges(root: Path) -> list[Edge]:
    """The package's import edges, to modules of the package only."""
    mods = modules(root)
    top = root.name
    found = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == top:
                        found.append(Edge(name, alias.name, node.lineno, ()))
                continue
            base = from_module(node, name, path)
            if base.split(".")[0] != top:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in mods:  # ``from pkg import module``
                    found.append(Edge(name, sub, node.lineno, ()))
                else:
                    found.append(Edge(name, base, node.lineno, (alias.name,)))
    return [e for e in found if e.imported in mods]


def cycles(graph: list[Edge]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    succ: dict[str, set[str]] = {}
    for e in graph:
        if e.importer != e.imported:
            succ.setdefault(e.importer, set()).add(e.imported)
            succ.setdefault(e.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(root: Path) -> list[str]:
    """``module:line imports X`` for each private name or private module taken from another module
    (``from m import _x``, ``import pkg._m``, or ``alias._x`` on an imported module)."""
    mods = modules(root)
    bad = []
    for e in edges(root):
        if e.importer == e.imported:
            continue
        if any(_private(part) for part in e.imported.split(".")):
            bad.append(f"{e.importer}:{e.line} imports private module {e.imported}")
        for n in e.names:
            if _private(n):
                bad.append(f"{e.importer}:{e.line} imports {e.imported}.{n}")
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases = {}  # local name -> module of the package
        for node in _imports(tree):
            if isinstance(node, ast.ImportFrom):
                for e in edges_of(node, name, path, mods, root.name):
                    aliases[e[0]] = e[1]
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and _private(node.attr)
            ):
                bad.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return bad


def edges_of(
    node: ast.ImportFrom, name: str, path: Path, mods: dict[str, Path], top: str
) -> Iterator[tuple[str, str]]:
    """``(local name, module)`` for each module that ``from ... import`` binds."""
    base = from_module(node, name, path)
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if base.split(".")[0] == top and sub in mods and sub != name:
            yield alias.asname or alias.name, sub


def too_long(root: Path) -> list[str]:
    """Modules over MAX_LINES lines whose docstring does not say why ("Long because")."""
    bad = []
    for name, path in modules(root).items():
        text = path.read_text()
        lines = text.count("\n")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if lines > MAX_LINES and "Long because" not in " ".join(doc.split()):
            bad.append(f"{name}: {lines} lines")
    return bad


# The checks themselves, on made-up packages: each must be able to fail.


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg import b\n",
            "b.py": "def f():\n    from pkg.sub import c\n",
            "sub/__init__.py": "",
            "sub/c.py": "from ..a import x\n",
            "d.py": "from pkg import a\n",
        },
    )
    assert cycles(edges(root)) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


def test_type_checking_imports_and_a_dag_are_not_cycles(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "from pkg import a\n",
            "a.py": "from pkg import b\n",
            "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n",
        },
    )
    assert cycles(edges(root)) == []


def test_private_names_and_modules_taken_across_modules_are_found(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "_libc.py": "def load(): pass\n",
            "a.py": "_x = 1\ndef f(): return _x\n",
            "b.py": "from pkg.a import _x\nfrom pkg import a\nfrom pkg._libc import load\n"
            "y = a._x\nz = a.f\n",
        },
    )
    assert sorted(private_uses(root)) == [
        "pkg.b:1 imports pkg.a._x",
        "pkg.b:3 imports private module pkg._libc",
        "pkg.b:4 uses pkg.a._x",
    ]


def test_a_long_module_must_say_why(tmp_path: Path) -> None:
    body = "x = 1\n" * (MAX_LINES + 1)
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "short.py": body[: 6 * MAX_LINES],
            "long.py": body,
            "said.py": '"""Holds x.\n\nLong because every x is\nneeded."""\n' + body,
        },
    )
    assert too_long(root) == [f"pkg.long: {MAX_LINES + 1} lines"]


# The package itself.


def test_the_package_has_no_import_cycle() -> None:
    found = cycles(edges(PACKAGE))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_private_name_is_imported_across_modules() -> None:
    found = private_uses(PACKAGE)
    assert not found, "\n".join(found)


def test_no_module_is_long_without_saying_why() -> None:
    found = too_long(PACKAGE)
    assert not found, "over 450 lines without 'Long because' in the docstring:\n" + "\n".join(found)


@pytest.mark.parametrize("name", sorted(m for m in modules(PACKAGE) if not m.endswith("__main__")))
def test_every_module_imports_on_its_own(name: str) -> None:
    """Each module imports in a fresh interpreter, alone (an order-dependent import is a hidden cycle)."""
    env = dict(os.environ, PYTHONPATH=str(PACKAGE.parent))
    done = subprocess.run(
        [sys.executable, "-c", f"import {name}"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]


# stage/'s parts, top to bottom: a part imports only parts below it (docs/architecture.md).
STAGE_RANKS = {
    "engine": 5,
    "staging": 5,
    "verification": 5,
    "signals": 5,
    "resident": 5,
    "cache": 4,
    "build": 3,
    "sources": 2,
    "store": 1,
}


def upward_imports(graph: list[Edge], top: str = "shmstage") -> list[str]:
    """``importer -> imported`` for each import from a lower part of stage/ to a higher one
    (the package's own __init__ re-exports everything and is no part)."""
    prefix = f"{top}.stage."

    def rank(module: str) -> int | None:
        if not module.startswith(prefix):
            return None
        return STAGE_RANKS.get(module[len(prefix) :].split(".")[0])

    bad = []
    for e in graph:
        a, b = rank(e.importer), rank(e.imported)
        if a is not None and b is not None and b > a:
            bad.append(f"{e.importer}:{e.line} -> {e.imported}")
    return bad


def test_an_upward_import_between_stage_parts_is_found(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "stage/__init__.py": "",
            "stage/store/__init__.py": "",
            "stage/store/names.py": "from pkg.stage.build import copy\n",
            "stage/build/__init__.py": "",
            "stage/build/copy.py": "from pkg.stage.store import names\n",
        },
    )
    assert upward_imports(edges(root), "pkg") == ["pkg.stage.store.names:1 -> pkg.stage.build.copy"]


def test_stage_parts_import_only_downwards() -> None:
    """engine -> cache -> build -> sources -> store: never the other way."""
    found = upward_imports(edges(PACKAGE))
    assert not found, "\n".join(found)
