"""The package's shape (issue 11): small modules and classes, and no import circle.

A module over about 450 lines or a class over about 250 is a sign that several
paradigms or concerns share one place; an import circle (two modules importing
each other at import time) makes the order of imports matter. Imports inside
functions (deferred on purpose, e.g. to keep `shardwise --help` free of torch)
and under ``TYPE_CHECKING`` are not import-time edges.
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

PKG = pathlib.Path(__file__).resolve().parent.parent / "shardwise"
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 250


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _import_time_edges(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """Modules of the package that ``name`` imports when it is imported (top level, not TYPE_CHECKING)."""
    edges: set[str] = set()
    package = name if any(k.startswith(name + ".") for k in known) else name.rpartition(".")[0]

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for h in getattr(node, "handlers", []):
                    visit(h.body)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                edges.add(base)
                edges.update(f"{base}.{a.name}" for a in node.names)
    visit(tree.body)
    return {e for e in edges if e in known and e != name}


def test_no_module_or_class_is_too_big():
    big = []
    for path in sorted(PKG.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            big.append(f"{path.relative_to(PKG.parent)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            size = node.end_lineno - node.lineno + 1 if isinstance(node, ast.ClassDef) else 0
            if size > MAX_CLASS_LINES:
                big.append(f"{path.relative_to(PKG.parent)}: class {node.name} {size} lines")
    assert big == []


def test_no_import_circle():
    mods = _modules()
    known = set(mods)
    graph = {n: _import_time_edges(n, t, known) for n, t in mods.items()}
    circles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                circles.append(" -> ".join(stack[stack.index(m):] + [m]))
            elif m not in state:
                dfs(m)
        stack.pop()
        state[n] = 2
    for n in sorted(graph):
        if n not in state:
            dfs(n)
    assert circles == []


def test_every_module_imports_in_a_fresh_interpreter():
    # One interpreter per check would cost a second each; one that imports every module in turn still
    # catches a name imported from a module that no longer defines it, whichever module is imported first.
    names = sorted(n for n in _modules() if not n.endswith("__main__"))
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
    done = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
