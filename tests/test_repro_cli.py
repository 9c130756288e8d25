"""``python -m hotfix repro``: the operator's reproduction, end to end in a subprocess (the
scheduler world from a bundle is in test_bundle.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, clean_env, run_py
from hotfix import repro


def repro_cli(argv: list, timeout: float = 120):
    return run_py(f"import sys; from hotfix.cli import main; sys.exit(main({argv!r}))",
                  path=[REPO], env=clean_env(), timeout=timeout)


@pytest.mark.beyond_ci_budget("tests/test_engine_world.py (the same run_engine, stock and hotfix) and "
                              "tests/test_bundle.py::test_repro_from_the_bundle_runs_quietly_where_the_image_has_"
                              "neither_the_checkout_nor_the_test_tools (the repro CLI end to end)")
def test_repro_engine_world_stock_dies_on_the_assert_and_the_hotfix_returns_every_token():
    proc = repro_cli(["repro", "--world", "engine", "--json"], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # quiet: the JSON is all of stdout
    (row,) = report["rows"]
    assert row["stock"] == "EngineDeadError: assert req_id in self.requests", row
    assert row["hotfix"] == "every token returned" and row["ok"] and report["exit"] == 0, row
    stock_log = (Path(report["logs"]) / "engine-stock.log").read_text()
    assert "AssertionError" in stock_log and "(EngineCore pid=" in stock_log
    assert "event='hotfix." not in stock_log  # the stock engine had nothing of ours
    assert "event='hotfix.patch.applied'" in (Path(report["logs"]) / "engine-hotfix.log").read_text()


def _rows(*pairs) -> list:
    return [repro._row("scheduler", f"race{i}", stock, fixed, 0.0) for i, (stock, fixed) in enumerate(pairs)]


@pytest.mark.parametrize("pairs, status", [
    ((("EngineCore dies: assert", "clean"), ("silent: compute_while_loading", "clean")), 0),
    ((("EngineCore dies: assert", "clean"), ("EngineCore dies: assert", "silent: x")), 1),
    ((("clean", "clean"), ("EngineCore dies: assert", "clean")), 2),  # stock held: nothing proven
    ((("clean", "EngineCore dies: assert"),), 1),  # a hotfix that fails outranks a stock that held
    ((), 2),
])
def test_repro_exit_status_is_0_proven_1_hotfix_failed_2_not_reproduced(pairs, status):
    assert repro.exit_status(_rows(*pairs)) == status


def test_repro_lmcache_without_lmcache_names_the_install_command(tmp_path):
    for argv, says in ((["repro", "--world", "pd", "--lmcache", str(tmp_path)], "pip install --no-deps lmcache=="),
                       (["repro", "--lmcache"], "add --world pd")):
        proc = repro_cli(argv)
        assert proc.returncode == 2 and says in proc.stderr, (argv, proc.stderr[-2000:])
