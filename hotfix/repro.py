"""``python -m hotfix repro``: the bug report's races on the installed vLLM, stock vs hotfix.

Runs wherever the hotfix is deployed as a directory (a checkout, or a bundle:
``PYTHONPATH=DIR python -m hotfix repro``): the worlds are in ``hotfix.worlds``. Each side of
every race runs in processes of its own, the hotfix side getting it only through
``PYTHONPATH`` (a copy of this directory), the stock side with the kill switch set and
nothing of ours on vLLM's path. Quiet by default: one line per race, then the table; every
vLLM and engine log goes to files under the directory named on the first line
(``--verbose`` prints them too).

- ``scheduler`` (default, about a minute on 2 cores): the real Scheduler, MultiConnector and
  NIXL scheduler, test connectors loaded by vLLM, one process per side;
- ``engine`` (about two minutes): a real ``vllm.LLM`` (EngineCore and worker processes) with
  ``MultiConnector[NIXL-like slow loader, LMCache-like fast loader that loads anyway]``;
- ``pd`` (several minutes, needs ``nixl``): a prefill and two decode engines (stock, hotfix)
  moving KV through NIXL/UCX on loopback, the decode node as in the bug report;
  ``--lmcache [DIR]`` makes the decode's second connector the real LMCache (a ``lmcache
  server`` and LMCache's own ``LMCacheMPConnector``; lmcache from DIR, a ``pip install
  --target`` directory, or else the one this interpreter imports) and the traffic a two-turn
  conversation whose first turn D's LMCache stored.

Exit status: 0 when every stock run failed as the bug report says and every hotfix run held;
1 when a hotfix run did not hold; 2 when a stock run did not fail (nothing is proven on this
install) or the worlds cannot run here.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hotfix import config
from hotfix.worlds.home import NotDeployable

SCHEDULER_RACES = ("LATE_REPORT_AFTER_FREE", "LATE_REPORT_WHILE_RUNNING", "EARLY_PROMOTION",
                   "TP_MIXED_REPORTS", "ABORT_SAVE_FIRST_ALL_SAVED", "ABORT_NIXL_FIRST_ALL_SAVED",
                   "NIXL_RANKS_FINISH_APART")
CLEAN = "clean"
TOKENS_OK = "tokens equal the reference"
HOLDS = {"scheduler": CLEAN, "engine": "every token returned", "pd": TOKENS_OK}
OK, HOTFIX_FAILED, NOT_REPRODUCED = 0, 1, 2


class CannotRun(RuntimeError):
    """The worlds cannot run on this install (said in one line, exit 2)."""


def _row(world: str, race: str, stock: str, fixed: str, seconds: float) -> dict:
    return {"world": world, "race": race, "stock": stock, "hotfix": fixed,
            "reproduced": stock != HOLDS[world], "held": fixed == HOLDS[world],
            "ok": stock != HOLDS[world] and fixed == HOLDS[world], "seconds": round(seconds, 1)}


# -- scheduler world: one process per side -------------------------------------------------

def _outcome(result) -> str:
    if result.crash is not None:
        return f"EngineCore dies: {result.crash.source_line} (tick {result.crash.step})"
    kinds = sorted({v.kind for v in result.violations})
    return CLEAN if not kinds else "silent: " + ", ".join(kinds)


def run_scheduler_side(results_path: str) -> None:
    """One side's races in this process (``python -m hotfix.repro``), one JSON line each;
    the first line says what wrapped vLLM here, so a stock side that was patched, or a hotfix
    side that was not, is caught rather than reported."""
    import hotfix
    from hotfix.worlds import scenarios
    from hotfix.worlds.scheduler_world import patched_methods

    with open(results_path, "w", buffering=1) as out:
        out.write(json.dumps({"activated_by": hotfix.activated_by, "patched": patched_methods()}) + "\n")
        for name in SCHEDULER_RACES:
            started = time.monotonic()
            outcome = _outcome(getattr(scenarios, name).run())
            out.write(json.dumps({"race": name.lower(), "outcome": outcome,
                                  "seconds": time.monotonic() - started}) + "\n")


def _side_env(side: str, logs: Path) -> dict:
    from hotfix.worlds.home import clean_env

    env = clean_env(HOTFIX_STATUS_DIR=str(logs / f"status-{side}"))
    if side == "stock":
        env["HOTFIX_DISABLE"] = "1"  # our directory is on the path (the worlds are in it): off
        env["VLLM_PLUGINS"] = ""
    return env


def scheduler_world(logs: Path, verbose: bool, progress):
    from hotfix.worlds.home import hotfix_home

    home = hotfix_home(logs / "home")
    sides, files = {}, {}
    for side in ("stock", "hotfix"):
        files[side] = logs / f"scheduler-{side}.jsonl"
        log = None if verbose else open(logs / f"scheduler-{side}.log", "wb")
        sides[side] = subprocess.Popen(
            [sys.executable, "-m", "hotfix.repro", str(files[side])], cwd=logs,
            env={**_side_env(side, logs), "PYTHONPATH": str(home)},
            stdout=log, stderr=subprocess.STDOUT if log else None, stdin=subprocess.DEVNULL)
        if log:
            log.close()
    try:
        header, shown = {}, 0
        while shown < len(SCHEDULER_RACES):
            lines = {side: _json_lines(files[side]) for side in sides}
            for side, found in lines.items():
                if found and side not in header:
                    header[side] = found[0]
                    _check_side(side, found[0])
            while shown < min(len(found) - 1 for found in lines.values()):
                stock, fixed = (lines[s][shown + 1] for s in ("stock", "hotfix"))
                progress(_row("scheduler", stock["race"], stock["outcome"], fixed["outcome"],
                              max(stock["seconds"], fixed["seconds"])))
                shown += 1
            if shown < len(SCHEDULER_RACES):
                for side, proc in sides.items():
                    if proc.poll() is not None and len(lines[side]) - 1 < len(SCHEDULER_RACES):
                        raise CannotRun(f"the scheduler world's {side} side exited ({proc.returncode}) "
                                        f"after {max(0, len(lines[side]) - 1)} races; its log: "
                                        f"{logs / f'scheduler-{side}.log'}")
                time.sleep(0.2)
    finally:
        for proc in sides.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _json_lines(path: Path) -> list:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _check_side(side: str, header: dict) -> None:
    if side == "stock" and (header["activated_by"] or header["patched"]):
        raise CannotRun(f"the stock side is not stock: {header}")
    if side == "hotfix" and (header["activated_by"] != "sitecustomize" or not header["patched"]):
        raise CannotRun(f"the hotfix side did not get the hotfix through PYTHONPATH: {header}")


# -- engine world: a real vllm.LLM per side -----------------------------------------------

def engine_world(logs: Path, verbose: bool, progress):
    from hotfix.worlds import engine_world as ew

    started = time.monotonic()
    runs = ew.side_by_side({side: (lambda variant=variant: ew.run_engine_retrying_a_port_race(variant))
                            for side, variant in (("stock", ew.STOCK), ("hotfix", ew.PYTHONPATH))})
    verdicts = {}
    for side, run in runs.items():
        (logs / f"engine-{side}.log").write_text(run.log)
        if verbose:
            print(run.log)
        verdicts[side] = _engine_verdict(run, ew)
    progress(_row("engine", "bug report (early promotion, late NIXL report)", verdicts["stock"], verdicts["hotfix"],
                  time.monotonic() - started))


def _engine_verdict(run, ew) -> str:
    if run.engine_dead:
        crash = next((line.split("]", 1)[-1].strip() for line in run.log.splitlines()
                      if line.strip().split("]", 1)[-1].strip().startswith("assert ")), None)
        return f"EngineDeadError: {crash}" if crash else "EngineDeadError"
    expected = {r.name: r.max_tokens for r in ew.RACE}
    if run.completed and {k: len(v) for k, v in (run.outputs or {}).items()} == expected:
        return HOLDS["engine"]
    return f"did not finish (rc={run.returncode}, timed out={run.timed_out}): {(run.error or '')[:80]}"


# -- P/D world: NIXL over UCX ---------------------------------------------------------------

def pd_world(logs: Path, verbose: bool, progress, max_tokens: int = 8):
    from hotfix.worlds import pd_world as pd
    from hotfix.worlds.home import clean_env, hotfix_home

    started = time.monotonic()
    home = hotfix_home(logs / "home")
    env = clean_env()
    rng = random.Random(7)
    clean, racy, after = ([rng.randrange(3, pd.VOCAB_SIZE) for _ in range(n)] for n in (70, 100, 90))
    outcomes = {}
    with pd.PDWorld(logs / "pd", pd.build_model(logs / "pd" / "model"), env) as world:
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
            outcomes[label] = "; then ".join(findings) or TOKENS_OK
        _show_logs(world, verbose)
    progress(_row("pd", "bug report (delayed NIXL READ)", outcomes["stock"], outcomes["hotfix"],
                  time.monotonic() - started))


LMCACHE_INSTALL = ("pip install --no-deps lmcache==0.5.4 sortedcontainers  (or with --target DIR, "
                   "then --lmcache DIR; 0.5.4 carries the defect, 0.5.6 does not)")


def lmcache_release(where: str) -> Path | None:
    """The directory to put on the engines' path for lmcache (None: this interpreter's own)."""
    import importlib.util

    if where:
        path = Path(where).resolve()
        if not (path / "lmcache" / "__init__.py").is_file():
            raise CannotRun(f"repro --lmcache {where}: no lmcache package there; {LMCACHE_INSTALL}")
        return path
    if importlib.util.find_spec("lmcache") is None:
        raise CannotRun(f"repro --lmcache: lmcache is not installed here; {LMCACHE_INSTALL}")
    return None


def pd_lmcache_world(release: Path | None, logs: Path, verbose: bool, progress, max_tokens: int = 8):
    from hotfix.worlds import pd_world as pd
    from hotfix.worlds.home import clean_env, hotfix_home
    from hotfix.worlds.lmcache_server import LMCacheServer

    started = time.monotonic()
    home = hotfix_home(logs / "home")
    env = clean_env()
    rng = random.Random(7)
    question, new_text = ([rng.randrange(3, pd.VOCAB_SIZE) for _ in range(40)] for _ in range(2))
    extra = (release,) if release else ()
    outcomes = {}
    with LMCacheServer(release, logs / "lmcache-server.log", env, transfer_mode="engine_driven") as server, \
            pd.PDWorld(logs / "pd", pd.build_model(logs / "pd" / "model"), env) as world:
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
            outcomes[label] = "; then ".join(findings) or TOKENS_OK
        _show_logs(world, verbose)
    progress(_row("pd", "bug report + real LMCache", outcomes["stock"], outcomes["hotfix"],
                  time.monotonic() - started))


def _show_logs(world, verbose: bool) -> None:
    if verbose:
        for engine in world.engines:
            print(f"--- {engine.name} ({engine.log_path}) ---\n{engine.log()}")


# -- the command ----------------------------------------------------------------------------

WORLDS = {"scheduler": scheduler_world, "engine": engine_world, "pd": pd_world}


def exit_status(rows: list) -> int:
    if not all(row["held"] for row in rows):
        return HOTFIX_FAILED
    return OK if rows and all(row["reproduced"] for row in rows) else NOT_REPRODUCED


def main(world: str = "scheduler", as_json: bool = False, lmcache: str | None = None,
         verbose: bool = False) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logs = Path(tempfile.mkdtemp(prefix=f"hotfix-repro-{world}-"))
    rows: list = []

    def progress(row: dict) -> None:
        rows.append(row)
        if not as_json:
            print(f"{row['race']}: stock {row['stock']} | hotfix {row['hotfix']} ({row['seconds']:.1f} s)",
                  flush=True)

    if not as_json:
        print(f"repro --world {world}: logs in {logs}", flush=True)
    try:
        if lmcache is not None and world != "pd":
            raise CannotRun("repro --lmcache runs in the pd world: add --world pd")
        if lmcache is not None:
            pd_lmcache_world(lmcache_release(lmcache), logs, verbose, progress)
        else:
            WORLDS[world](logs, verbose, progress)
    except (CannotRun, NotDeployable) as exc:
        print(f"repro: {exc}", file=sys.stderr)
        return NOT_REPRODUCED
    except Exception as exc:  # a world that broke on this install: one line, the logs kept
        if config.strict():
            raise
        print(f"repro: the {world} world failed ({type(exc).__name__}: {exc}); logs in {logs}",
              file=sys.stderr)
        return NOT_REPRODUCED
    if as_json:
        print(json.dumps({"world": world, "logs": str(logs), "rows": rows, "exit": exit_status(rows)}, indent=2))
    else:
        _print_table(rows)
    return exit_status(rows)


def _print_table(rows: list) -> None:
    width = max([len(r["race"]) for r in rows] + [4]) + 2
    stock_width = max([len(r["stock"]) for r in rows] + [10]) + 2
    print(f"\n{'race':{width}}{'stock vLLM':{stock_width}}with the hotfix")
    for row in rows:
        print(f"{row['race']:{width}}{row['stock']:{stock_width}}{row['hotfix']}")
    status = exit_status(rows)
    print({OK: "\nreproduced on stock vLLM and fixed by the hotfix",
           HOTFIX_FAILED: "\nHOTFIX FAILED: a hotfix run did not hold (exit 1)",
           NOT_REPRODUCED: "\nNOT REPRODUCED: a stock run did not fail; nothing is proven on this install (exit 2)",
           }[status])


if __name__ == "__main__":
    run_scheduler_side(sys.argv[1])
