"""``hotfix/`` has no import circle: every module imports only modules below it.

Imports inside functions count too (a lazy import is still a dependency, and a circle through
one breaks the first time the lazy path runs in a half-initialised module). What a lower
layer needs of a higher one is handed to it: the registry gives the status layer its
activation getter (``status.write_records_of``), the config gives the log its format reader
(``log.read_format_with``)."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO


def module_graph(root: Path, package: str = "hotfix") -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``, from the source alone."""
    files = {}
    for path in (root / package).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    graph = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for alias in node.names:  # `from hotfix import status` imports hotfix.status
                    deps.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_hotfix_imports_form_no_circle():
    graph = module_graph(Path(REPO))
    assert {"hotfix.config", "hotfix.log", "hotfix.status", "hotfix.registry", "hotfix.cli"} <= graph.keys()
    found = circles(graph)
    assert found == [], "\n".join(
        " <-> ".join(c) + "\n" + "\n".join(f"    {m} imports {sorted(graph[m] & set(c))}" for m in c)
        for c in found)


def test_a_circle_through_a_lazy_import_is_found(tmp_path):
    """The check itself can fail: a package whose lower module imports its upper one inside a
    function, and a relative import, are both seen."""
    package = tmp_path / "hotfix"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def f():\n    from hotfix import high\n")
    (package / "high.py").write_text("from . import low\n")
    (package / "alone.py").write_text("import os\n")
    assert circles(module_graph(tmp_path)) == [["hotfix.high", "hotfix.low"]]
