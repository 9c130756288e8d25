"""``python -m hotfix repro``: the operator's reproduction, end to end in a subprocess."""
from __future__ import annotations

import json

from conftest import REPO, clean_env, run_py


def test_repro_shows_every_scheduler_race_failing_on_stock_and_clean_with_the_hotfix():
    # the repo on PYTHONPATH, as an operator runs it from a checkout: the shim is active
    proc = run_py("import sys; from hotfix.cli import main; sys.exit(main(['repro', '--json']))",
                  path=[REPO], env=clean_env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    start = proc.stdout.rindex("\n[\n") + 1  # vLLM logs to stdout too: the JSON block is last
    rows = json.loads(proc.stdout[start:proc.stdout.rindex("]") + 1])
    assert len(rows) == 7 and all(r["ok"] for r in rows), rows
    assert all(r["hotfix"] == "clean" for r in rows)
    assert {r["stock"].split(":")[0] for r in rows} == {"EngineCore dies", "silent"}


def test_repro_lmcache_without_lmcache_names_the_install_command(tmp_path):
    for argv, says in ((["repro", "--world", "pd", "--lmcache", str(tmp_path)], "pip install --no-deps lmcache=="),
                       (["repro", "--lmcache"], "add --world pd")):
        proc = run_py(f"import sys; from hotfix.cli import main; sys.exit(main({argv!r}))",
                      path=[REPO], env=clean_env(), timeout=120)
        assert proc.returncode != 0 and says in proc.stderr, (argv, proc.stderr[-2000:])
