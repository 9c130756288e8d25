"""Custom vLLM builds: layout changes keep every fix, one changed statement drops exactly one.

Each test builds, from the installed vLLM (whatever release the venv has), a tree in which
some fix-target files are rewritten (``tests.worlds.shifted_tree``), and runs
``python -m hotfix status`` with that tree first on ``PYTHONPATH``; the engine world runs an
engine on such a tree (``tests/test_engine_world.py``).
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest
from conftest import NEUTRAL_CWD, clean_env, install_home

from hotfix import fingerprint, registry
from tests.worlds import shifted_tree
from tests.worlds.shifted_tree import stock_fingerprint, tree_with_one_statement_changed

SPECS = registry.discover()
#: what each fix decides on the installed (stock) vLLM: known_shape, or fixed_upstream where the
#: release carries the fix itself (nixl-settle on 0.30+)
ON_STOCK = {s.id: (d.apply, d.reason) for s in SPECS for d in [registry.decide(s, mode="on")]}


def hotfix_status(path, *args) -> subprocess.CompletedProcess:
    """``python -m hotfix status ARGS`` in a fresh interpreter with exactly ``path`` on PYTHONPATH."""
    env = clean_env(PYTHONPATH=os.pathsep.join(str(p) for p in path))
    return subprocess.run([sys.executable, "-m", "hotfix", "status", *args], env=env, cwd=NEUTRAL_CWD,
                          capture_output=True, text=True, timeout=120)


def test_backport_like_tree_applies_every_fix_with_the_stock_fingerprints(tmp_path):
    """A backport moves stock code down (banner, extra import, unrelated helper) and rewords
    comments and blank lines inside the targets; that is layout, so every fix must still apply."""
    files = shifted_tree.target_files()
    rewrites = {rel: shifted_tree.backport_like(shifted_tree.stock_text(rel), names)
                for rel, names in files.items()}
    for rel, names in files.items():  # the copies really are shifted and re-laid-out
        stock_tree, copy_tree = ast.parse(shifted_tree.stock_text(rel)), ast.parse(rewrites[rel])
        for name in names:
            old, new = (fingerprint.find_definition(t, name) for t in (stock_tree, copy_tree))
            if old is not None:
                assert new.lineno >= old.lineno + len(shifted_tree.BANNER) + len(shifted_tree.HELPER)
                assert ast.get_source_segment(rewrites[rel], new) != \
                    ast.get_source_segment(shifted_tree.stock_text(rel), old)
    tree = shifted_tree.farm(tmp_path / "tree", rewrites)

    proc = hotfix_status([install_home(tmp_path / "home", fixes=()), tree], "--json")

    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ready"], report["problems"]
    assert report["vllm"]["path"] == str(tree / "vllm")
    assert {f["fix"]: (f["apply"], f["reason"]) for f in report["fixes"]} == ON_STOCK
    for fix in report["fixes"]:
        for target in fix["targets"]:
            module, qualname = target["target"].split(":")
            assert target["found"] == stock_fingerprint(module, qualname), target
            if target["found"] is not None:
                assert target["path"] == str(tree / "vllm" / shifted_tree.relpath(module))
                assert target["matches"] and target["action"] != "unknown", target


@pytest.mark.parametrize("fix_id", [s.id for s in SPECS])
def test_one_changed_statement_skips_only_its_fix_and_status_names_both_fingerprints(fix_id, tmp_path):
    """A build whose target code differs from every verified release must not be patched
    blind: that fix is skipped whole, the others still apply, and the gate says why."""
    tree, target, stock_fp, changed_fp = tree_with_one_statement_changed(tmp_path / "tree", fix_id)
    home = install_home(tmp_path / "home", fixes=())

    proc = hotfix_status([home, tree], "--json")

    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and not report["ready"]
    assert report["problems"] == [f"{fix_id}: fingerprint_mismatch"]
    fixes = {f["fix"]: f for f in report["fixes"]}
    assert (fixes[fix_id]["apply"], fixes[fix_id]["reason"]) == (False, "fingerprint_mismatch")
    (unknown,) = [t for t in fixes[fix_id]["targets"] if t["action"] == "unknown"]
    assert unknown["target"] == target.key and unknown["found"] == changed_fp
    assert stock_fp in unknown["known"] and changed_fp not in unknown["known"]
    assert {fid: (f["apply"], f["reason"]) for fid, f in fixes.items() if fid != fix_id} == {
        fid: d for fid, d in ON_STOCK.items() if fid != fix_id}

    text = hotfix_status([home, tree])

    assert text.returncode == 1
    lines = text.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{target.key} ["))
    assert f"found={changed_fp}" in lines[at] and "unknown" in lines[at]
    assert all(fp in lines[at + 1] for fp in unknown["known"])
    assert f"[SKIP] {fix_id} " in text.stdout
