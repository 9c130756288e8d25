"""``python -m hotfix shapes DIR``: a new release's targets against the known shapes, with diffs.

The "new release" is the installed vLLM with one target changed (a statement added to
xfer-guard's ``Scheduler._update_from_kv_xfer_finished``), as a directory and as a wheel;
the reference is the installed vLLM itself. No network: ``--download`` is not used here.
"""
from __future__ import annotations

import ast
import json
import shutil
import zipfile

import pytest

from hotfix import cli, fingerprint, registry
from hotfix.shapes import Tree

SCHEDULER = "v1/core/sched/scheduler.py"
TARGET = "vllm.v1.core.sched.scheduler:Scheduler._update_from_kv_xfer_finished"
ADDED = "    _new_release_bookkeeping = None  # added by the new release"
NEW_VERSION = "9.99.0"


@pytest.fixture(scope="module")
def installed():
    root = fingerprint.package_root("vllm")
    if root is None:
        pytest.skip("vLLM is not installed")
    return root


@pytest.fixture(scope="module")
def new_release(installed, tmp_path_factory):
    """A tree with vLLM's scheduler module (one target changed) and nothing else of vLLM."""
    dest = tmp_path_factory.mktemp("new-release")
    package = dest / "vllm"
    (package / "v1/core/sched").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "_version.py").write_text(f"__version__ = version = '{NEW_VERSION}'\n")
    lines = open(f"{installed}/{SCHEDULER}", encoding="utf-8").read().splitlines(keepends=True)
    node = fingerprint.find_definition(ast.parse("".join(lines)), "Scheduler._update_from_kv_xfer_finished")
    first = node.body[1] if ast.get_docstring(node) else node.body[0]  # the first statement
    lines.insert(first.lineno - 1, " " * (first.col_offset - 4) + ADDED + "\n")
    (package / SCHEDULER).write_text("".join(lines))
    return dest


def shapes(capsys, *argv) -> tuple[int, str]:
    code = cli.main(["shapes", *map(str, argv)])
    return code, capsys.readouterr().out


def rows_of(out: str) -> dict:
    return {row["target"]: row for row in json.loads(out)["targets"]}


def test_every_target_of_the_installed_release_is_a_known_shape(installed, capsys):
    code, out = shapes(capsys, installed, "--json")
    rows = rows_of(out)
    assert code == 0, [r for r in rows.values() if r["needs_work"]]
    assert len(rows) == len({t.key for s in registry.discover() for t in s.targets})


def test_a_changed_target_is_new_and_diffed_against_the_closest_known_shape(new_release, installed, capsys):
    code, out = shapes(capsys, new_release, "--against", installed, "--json")
    rows = rows_of(out)
    assert code == 1
    changed = rows[TARGET]
    assert changed["verdict"] == "new" and changed["needs_work"]
    closest = changed["closest"]
    assert closest["release"] == fingerprint.vllm_version() and closest["similarity"] > 0.9
    assert f"+{ADDED}\n" in closest["diff"] and f"{NEW_VERSION}/vllm/{SCHEDULER}" in closest["diff"]
    same_file = [r for key, r in rows.items() if key.startswith("vllm.v1.core.sched.scheduler:") and key != TARGET]
    assert same_file and all(not r["needs_work"] for r in same_file), same_file
    elsewhere = [r for key, r in rows.items() if not key.startswith("vllm.v1.core.sched.scheduler:")]
    assert elsewhere and all(r["verdict"].startswith("absent") for r in elsewhere)


def test_a_wheel_reads_like_its_unpacked_tree(new_release, installed, tmp_path, capsys):
    wheel = tmp_path / f"vllm-{NEW_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path in new_release.rglob("*.py"):
            zf.write(path, path.relative_to(new_release).as_posix())
    assert Tree(str(wheel)).version == NEW_VERSION
    _, from_dir = shapes(capsys, new_release, "--against", installed, "--json")
    code, from_wheel = shapes(capsys, wheel, "--against", installed, "--json")
    strip = lambda rows: {k: {**r, "closest": r["closest"] and {**r["closest"], "diff": None}}
                          for k, r in rows.items()}
    assert code == 1 and strip(rows_of(from_wheel)) == strip(rows_of(from_dir))


def test_the_text_report_names_what_to_read(new_release, installed, capsys):
    code, out = shapes(capsys, new_release, "--against", installed)
    assert code == 1
    assert f"xfer-guard  {TARGET} [engine_core]" in out
    assert "closest known shape: " + fingerprint.vllm_version() in out and f"+{ADDED}" in out


def test_a_directory_that_is_not_vllm_is_one_clear_line(tmp_path, capsys):
    code = cli.main(["shapes", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 2 and captured.err.count("\n") == 1 and "vllm/__init__.py" in captured.err


def test_a_moved_class_is_found_in_its_new_module(installed, tmp_path, capsys):
    package = tmp_path / "vllm"
    (package / "v1/core/sched").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    shutil.copy(f"{installed}/{SCHEDULER}", package / "v1/core/sched/moved_scheduler.py")
    _, out = shapes(capsys, tmp_path, "--json")
    row = rows_of(out)[TARGET]
    assert row["verdict"] == "absent" and row["moved_to"] == ["vllm.v1.core.sched.moved_scheduler"]
