"""``python -m hotfix repro``: the bug report's races on the installed vLLM, stock vs hotfix.

Runs from a checkout of vllm-hotfix: the worlds live in ``tests/worlds`` (they are also the
test suite's). A bundle does not carry them yet.

Each race runs twice, on stock vLLM and with every fix this copy carries, and the table says
what happened: the assert that killed the EngineCore, blocks written after they were freed,
a request computed over blocks still being loaded, or tokens that differ from a clean run.
Exit 0 when every stock run failed as the bug report says and every hotfix run was clean.

- ``scheduler`` (default, about a minute on 2 cores): the real Scheduler, MultiConnector and
  NIXL scheduler in this process, test connectors loaded by vLLM;
- ``pd`` (several minutes, needs ``nixl``): a prefill and two decode engines (stock, hotfix)
  moving KV through NIXL/UCX on loopback, the decode node as in the bug report;
  ``--lmcache [DIR]`` makes the decode's second connector the real LMCache (a ``lmcache
  server`` and LMCache's own ``LMCacheMPConnector``; lmcache from DIR, a ``pip install
  --target`` directory, or else the one this interpreter imports) and the traffic a two-turn
  conversation whose first turn D's LMCache stored.
"""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path

SCHEDULER_RACES = ("LATE_REPORT_AFTER_FREE", "LATE_REPORT_WHILE_RUNNING", "EARLY_PROMOTION",
                   "TP_MIXED_REPORTS", "ABORT_SAVE_FIRST_ALL_SAVED", "ABORT_NIXL_FIRST_ALL_SAVED",
                   "NIXL_RANKS_FINISH_APART")


def _fix_ids() -> tuple:
    from hotfix import registry

    return tuple(m.SPEC.id for m in registry.fix_modules())


def _outcome(result) -> str:
    if result.crash is not None:
        return f"EngineCore dies: {result.crash.source_line} (tick {result.crash.step})"
    kinds = sorted({v.kind for v in result.violations})
    return "clean" if not kinds else "silent: " + ", ".join(kinds)


def scheduler_world() -> list:
    _home()
    from tests.worlds import scenarios
    from tests.worlds.hotfix_on import hotfix_active

    rows = []
    for name in SCHEDULER_RACES:
        scenario = getattr(scenarios, name)
        stock = _outcome(scenario.run())
        with hotfix_active(*_fix_ids()):
            fixed = _outcome(scenario.run())
        rows.append({"world": "scheduler", "race": name.lower(), "stock": stock, "hotfix": fixed,
                     "ok": stock != "clean" and fixed == "clean"})
    return rows


def _home() -> Path:
    """The checkout holding our ``hotfix`` package, shim and ``tests/worlds``."""
    import hotfix

    home = Path(hotfix.__file__).resolve().parent.parent
    if not (home / "sitecustomize.py").is_file() or not (home / "tests" / "worlds").is_dir():
        raise SystemExit(f"repro needs a checkout of vllm-hotfix (no tests/worlds next to {home / 'hotfix'})")
    if str(home) not in sys.path:
        sys.path.insert(0, str(home))  # vLLM's connector factory imports tests.worlds.* by name
    return home


def pd_world(max_tokens: int = 8) -> list:
    from tests.worlds import pd_world as pd

    home = _home()
    root = Path(tempfile.mkdtemp(prefix="hotfix-repro-pd-"))
    env = _stock_env()
    rng = random.Random(7)
    clean, racy, after = ([rng.randrange(3, pd.VOCAB_SIZE) for _ in range(n)] for n in (70, 100, 90))
    outcomes = {}
    with pd.PDWorld(root, pd.build_model(root / "model"), env) as world:
        prefill = world.start("prefill", pd.prefill_config(), engine_args={"enable_prefix_caching": False})
        bug_report = pd.decode_bug_report_config(read_delay_steps=max_tokens + 8)
        decodes = {"stock": world.start("decode-stock", bug_report),
                   "hotfix": world.start("decode-hotfix", bug_report, hotfix_home=home)}
        for engine in world.engines:
            engine.wait_ready()
        reference = [prefill.generate([pd.Request(p, max_tokens)])[0].token_ids for p in (clean, racy, after)]
        for label, decode in decodes.items():
            wrong, died = [], None
            for name, tokens, ref in zip(("clean", "racy", "next"), (clean, racy, after), reference):
                try:
                    if pd.transfer(prefill, decode, tokens, max_tokens, cache_hit=tokens is racy) != ref:
                        wrong.append(name)
                except pd.EngineFailure as exc:
                    died = exc.kind
                    break
            findings = ([f"wrong tokens for {', '.join(wrong)}"] if wrong else []) + \
                ([f"decode engine died ({died})"] if died else [])
            outcomes[label] = "; then ".join(findings) or "tokens equal the reference"
    return [{"world": "pd", "race": "bug report (delayed NIXL READ)", "stock": outcomes["stock"],
             "hotfix": outcomes["hotfix"],
             "ok": outcomes["stock"] != "tokens equal the reference"
             and outcomes["hotfix"] == "tokens equal the reference"}]


LMCACHE_INSTALL = ("pip install --no-deps lmcache==0.5.4 sortedcontainers  (or with --target DIR, "
                   "then --lmcache DIR; 0.5.4 carries the defect, 0.5.6 does not)")


def lmcache_release(where: str) -> Path | None:
    """The directory to put on the engines' path for lmcache (None: this interpreter's own)."""
    import importlib.util

    if where:
        path = Path(where).resolve()
        if not (path / "lmcache" / "__init__.py").is_file():
            raise SystemExit(f"repro --lmcache {where}: no lmcache package there; {LMCACHE_INSTALL}")
        return path
    if importlib.util.find_spec("lmcache") is None:
        raise SystemExit(f"repro --lmcache: lmcache is not installed here; {LMCACHE_INSTALL}")
    return None


def pd_lmcache_world(release: Path | None, max_tokens: int = 8) -> list:
    from tests.worlds import pd_world as pd
    from tests.worlds.lmcache_server import LMCacheServer

    home = _home()
    root = Path(tempfile.mkdtemp(prefix="hotfix-repro-pd-lmcache-"))
    env = _stock_env()
    rng = random.Random(7)
    question, new_text = ([rng.randrange(3, pd.VOCAB_SIZE) for _ in range(40)] for _ in range(2))
    extra = (release,) if release else ()
    outcomes = {}
    with LMCacheServer(release, root / "lmcache-server.log", env, transfer_mode="engine_driven") as server, \
            pd.PDWorld(root, pd.build_model(root / "model"), env) as world:
        config = pd.decode_bug_report_lmcache_config(2.0, server.connector_config())
        prefill = world.start("prefill", pd.prefill_config(), engine_args={"enable_prefix_caching": False})
        decodes = {"stock": world.start("decode-stock", config, extra_path=extra),
                   "hotfix": world.start("decode-hotfix", config, extra_path=extra, hotfix_home=home)}
        for engine in world.engines:
            engine.wait_ready()
        for label, decode in decodes.items():
            pd.warm_up(prefill, decode)
            findings = []
            try:
                turn = pd.two_turn_conversation(prefill, decode, question, new_text, 300, max_tokens)
                if not turn.answer_ok:
                    findings.append("wrong tokens for turn 1")
                if turn.tokens != turn.expected:
                    findings.append("wrong tokens for turn 2")
                pd.transfer(prefill, decode, new_text, max_tokens)
            except pd.EngineFailure as exc:
                findings.append(f"decode engine died ({exc.kind})")
            outcomes[label] = "; then ".join(findings) or "tokens equal the reference"
    return [{"world": "pd", "race": "bug report + real LMCache", "stock": outcomes["stock"],
             "hotfix": outcomes["hotfix"],
             "ok": outcomes["stock"] != "tokens equal the reference"
             and outcomes["hotfix"] == "tokens equal the reference"}]


def _stock_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOTFIX_")}
    env.pop("PYTHONPATH", None)
    env["VLLM_PLUGINS"] = ""  # a pip-installed hotfix must not patch the stock engine
    return env


WORLDS = {"scheduler": scheduler_world, "pd": pd_world}


def main(world: str = "scheduler", as_json: bool = False, lmcache: str | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The stock runs must be stock: no automatic activation in this process (a shim on our
    # PYTHONPATH would otherwise patch vLLM on import); the hotfix runs apply it explicitly.
    os.environ["HOTFIX_DISABLE"] = "1"
    os.environ.setdefault("HOTFIX_STATUS_DIR", tempfile.mkdtemp(prefix="hotfix-repro-status-"))
    if lmcache is not None and world != "pd":
        raise SystemExit("repro --lmcache runs in the pd world: add --world pd")
    rows = pd_lmcache_world(lmcache_release(lmcache)) if lmcache is not None else WORLDS[world]()
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'race':32} {'stock vLLM':62} with the hotfix")
        for row in rows:
            print(f"{row['race']:32} {row['stock']:62} {row['hotfix']}")
    ok = all(row["ok"] for row in rows)
    print("\nreproduced on stock vLLM and fixed by the hotfix" if ok
          else "\nUNEXPECTED: a stock run did not fail or a hotfix run was not clean")
    return 0 if ok else 1
