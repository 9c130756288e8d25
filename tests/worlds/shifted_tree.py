"""Backport-like vLLM trees: the installed vLLM with some fix-target files rewritten.

A custom build (e.g. the sm89 backport of 0.27.1) ships stock code moved around: banners
and helpers above the patched classes, comments reworded and blank lines added inside the
patched methods. :func:`farm` builds such a tree cheaply: ``<dest>/vllm`` mirrors the
installed package through symlinks, and only the rewritten files (and the directories
leading to them) are real. Putting ``<dest>`` on ``PYTHONPATH`` makes a subprocess import
that tree, with the installed vLLM's compiled extensions and data.
"""
from __future__ import annotations

import ast
import io
import os
import tokenize
from pathlib import Path

from hotfix import fingerprint, registry

BANNER = [f"# sm89 backport of this file, line {i} of its banner" for i in range(1, 11)]
HELPER = [
    "import functools as _backport_functools  # pulled in by the backport",
    "",
    "",
    "def _backport_sm89_enabled() -> bool:",
    '    """A helper the backport adds above the patched classes; unrelated to them."""',
    "    return _backport_functools is not None",
    "",
    "",
]
REWORDED = "# comment reworded by the backport"

_SWAPPABLE = {ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is", ast.IsNot: "is not"}


def installed_root() -> Path:
    """The installed ``vllm`` package directory (what the venv imports)."""
    return Path(fingerprint.package_root("vllm"))


def relpath(module: str) -> str | None:
    """``vllm.a.b`` -> ``a/b.py`` (or ``a/b/__init__.py``) in the installed vLLM; None if absent."""
    path = fingerprint.module_file(module)
    return None if path is None else os.path.relpath(path, installed_root())


def target_files() -> dict[str, list[str]]:
    """The installed vLLM's files that hold fix targets -> the targets' qualnames."""
    files: dict[str, list[str]] = {}
    for spec in registry.discover():
        for target in spec.targets:
            rel = relpath(target.module)
            if rel is None or fingerprint.of_file(str(installed_root() / rel), target.qualname) is None:
                continue  # absent here (a target this release lacks, e.g. removed in 0.34)
            if target.qualname not in files.setdefault(rel, []):
                files[rel].append(target.qualname)
    return files


def stock_text(rel: str) -> str:
    return (installed_root() / rel).read_text(encoding="utf-8")


def farm(dest: Path, rewrites: dict[str, str]) -> Path:
    """``dest/vllm``: the installed vLLM as symlinks, each ``rewrites`` path a real file with
    the given text. Returns ``dest``, the directory to put on ``PYTHONPATH``."""
    source = installed_root()
    top = dest / "vllm"
    top.mkdir(parents=True)
    _mirror(source, top)
    for rel, text in rewrites.items():
        *dirs, name = Path(rel).parts
        here, there = top, source
        for part in dirs:
            here, there = here / part, there / part
            if here.is_symlink():  # make the directory real, its entries still links
                here.unlink()
                here.mkdir()
                _mirror(there, here)
        (here / name).unlink()
        (here / name).write_text(text, encoding="utf-8")
    return dest


def _mirror(source: Path, dest: Path) -> None:
    # No __pycache__: a rewritten file must never get (or overwrite) the venv's bytecode.
    for entry in os.scandir(source):
        if entry.name != "__pycache__":
            (dest / entry.name).symlink_to(entry.path, target_is_directory=entry.is_dir())


def backport_like(source: str, qualnames) -> str:
    """``source`` as a backport carries it: code unchanged, layout around and in the targets not.

    A banner on top, an extra import and an unrelated helper right above the first
    top-level definition holding a target, every comment inside a target reworded, and a
    new comment plus a blank line before each statement of a target's body.
    """
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    nodes = [n for n in (fingerprint.find_definition(tree, q) for q in qualnames) if n is not None]
    assert nodes, f"none of {qualnames} is defined here"
    spans = [(n.lineno, n.end_lineno) for n in nodes]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and any(a <= tok.start[0] <= b for a, b in spans):
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col] + REWORDED + lines[row - 1][tok.end[1]:]
    inserts: dict[int, list[str]] = {1: BANNER}
    holders = [n for n in tree.body if any(n is m or _contains(n, m) for m in nodes)]
    inserts.setdefault(min(_first_line(n) for n in holders), []).extend(HELPER)
    for node in nodes:
        for stmt in node.body:
            first = _first_line(stmt)
            indent = lines[first - 1][:len(lines[first - 1]) - len(lines[first - 1].lstrip())]
            if first > node.lineno and stmt.col_offset == len(indent):  # starts its line
                inserts.setdefault(first, []).extend([f"{indent}# backport note", ""])
    for line_no in sorted(inserts, reverse=True):
        lines[line_no - 1:line_no - 1] = [f"{text}\n" for text in inserts[line_no]]
    return "".join(lines)


def _first_line(node: ast.AST) -> int:
    return min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])


def _contains(outer: ast.AST, inner: ast.AST) -> bool:
    return any(child is inner for child in ast.walk(outer))


def swappable_comparison(source: str, qualname: str) -> ast.Compare | None:
    """The first ``a == b`` / ``!=`` / ``is`` / ``is not`` in ``qualname`` whose sides differ."""
    node = fingerprint.find_definition(ast.parse(source), qualname)
    for child in ast.walk(node) if node is not None else ():
        if (isinstance(child, ast.Compare) and len(child.ops) == 1
                and type(child.ops[0]) in _SWAPPABLE
                and ast.dump(child.left) != ast.dump(child.comparators[0])):
            return child
    return None


def change_one_statement(source: str, qualname: str) -> str:
    """``source`` with the operands of one comparison in ``qualname`` swapped (``a is None``
    becomes ``None is a``): the same behaviour, a different statement."""
    compare = swappable_comparison(source, qualname)
    assert compare is not None, f"{qualname} has no comparison to change"
    left = ast.get_source_segment(source, compare.left)
    right = ast.get_source_segment(source, compare.comparators[0])
    swapped = f"({right}) {_SWAPPABLE[type(compare.ops[0])]} ({left})".encode()
    data = source.encode("utf-8")  # AST columns are UTF-8 byte offsets
    starts = [0]
    for line in data.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    begin = starts[compare.lineno - 1] + compare.col_offset
    end = starts[compare.end_lineno - 1] + compare.end_col_offset
    return (data[:begin] + swapped + data[end:]).decode("utf-8")


def stock_fingerprint(module: str, qualname: str) -> str | None:
    rel = relpath(module)
    return None if rel is None else fingerprint.of_source(stock_text(rel), qualname)


def target_to_change(fix_id: str):
    """The first target of ``fix_id`` that the installed vLLM has in a shape the fix wraps (or
    in the shape of the upstream fix), that no other fix targets, and that holds a comparison
    to change; failing that, the first such target the fix only checks (``LEAVE``: a fix whose
    wrapped methods other fixes wrap too, or one that wraps nothing on this release)."""
    specs = registry.discover()
    (spec,) = [s for s in specs if s.id == fix_id]
    shared = {t.key for s in specs if s is not spec for t in s.targets}
    # a changed FIXED shape (the upstream fix) must not pass unseen either
    for actions in ((registry.WRAP, registry.FIXED), (registry.LEAVE,)):
        for target in spec.targets:
            shape = target.shapes.get(stock_fingerprint(target.module, target.qualname))
            if shape is None or shape.action not in actions or target.key in shared:
                continue
            if swappable_comparison(stock_text(relpath(target.module)), target.qualname):
                return target
    raise AssertionError(f"{fix_id}: no target of it can be changed on this vLLM")


def tree_with_one_statement_changed(dest, fix_id: str):
    """(tree, target, stock fingerprint, changed fingerprint) for one changed target of ``fix_id``."""
    target = target_to_change(fix_id)
    rel = relpath(target.module)
    stock = stock_text(rel)
    changed = change_one_statement(stock, target.qualname)
    return (farm(dest, {rel: changed}), target,
            fingerprint.of_source(stock, target.qualname), fingerprint.of_source(changed, target.qualname))
