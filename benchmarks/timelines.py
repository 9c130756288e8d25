"""Randomized timelines at scale: the property of tests/test_randomized_timelines.py over
10,000 generated timelines with recv-barrier + xfer-guard on, and a smaller stock run.

    python benchmarks/timelines.py [--fixed 10000] [--stock 1000] [--seed 0]

Same strategy (`tests.worlds.randomized.timelines`) and runner (`play`) as the test, in
the generate phase only (no shrinking). Prints, per side: timelines run, crashes (by the
line that raised), violations by kind, requests never finished, failure rate, what the
timelines exercised, wall time; for the fixed side also the hotfix's counters and the
smallest failing timeline of each kind, if there is one. Takes ~60 ms a timeline.
"""
from __future__ import annotations

import argparse
import logging
import time
from collections import Counter

import _common  # noqa: F401  (repository root on sys.path, HF_HUB_OFFLINE)


def sweep(n: int, seed: int) -> dict:
    """Run ``n`` generated timelines in whatever vLLM is right now; tally what they did."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fixed_seed

    from tests.worlds.randomized import play, timelines

    tally = {"run": 0, "failing": 0, "violating": 0, "crashes": Counter(), "violations": Counter(),
             "never_finished": 0, "features": Counter(), "smallest": {}}

    @fixed_seed(seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(timelines())
    def run_one(scenario):
        outcome = play(scenario)
        tally["run"] += 1
        tally["features"].update(outcome.features())
        problems = outcome.problems()
        if not problems:
            return
        tally["failing"] += 1
        if outcome.crash:
            tally["crashes"][outcome.crash] += 1
        kinds = {v.kind for v in outcome.result.violations}
        tally["violating"] += bool(kinds)
        tally["violations"].update(kinds)
        tally["never_finished"] += bool(outcome.never_finished)
        for kind in problems:
            best = tally["smallest"].get(kind)
            if best is None or len(scenario.timeline) < len(best.scenario.timeline):
                tally["smallest"][kind] = outcome

    start = time.perf_counter()
    run_one()
    tally["wall_s"] = time.perf_counter() - start
    return tally


def show(title: str, tally: dict, examples: bool) -> None:
    run, failing = tally["run"], tally["failing"]
    print(f"\n== {title}")
    print(f"timelines run:  {run}  ({tally['wall_s']:.1f} s, "
          f"{1000 * tally['wall_s'] / max(run, 1):.1f} ms each)")
    print(f"failing:        {failing}  ({100 * failing / max(run, 1):.2f} %)")
    print(f"crashes:        {sum(tally['crashes'].values())}")
    for line, count in tally["crashes"].most_common():
        print(f"  {count:>6}  {line}")
    print(f"violations:     {tally['violating']} timelines; by kind:")
    for kind, count in tally["violations"].most_common():
        print(f"  {count:>6}  {kind}")
    print(f"never finished: {tally['never_finished']}")
    print("exercised:      " + ", ".join(f"{k} {v}" for k, v in sorted(tally["features"].items())))
    if examples:
        for kind, outcome in sorted(tally["smallest"].items()):
            print(f"\n-- smallest timeline with {kind}:\n{outcome.report()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", type=int, default=10_000, help="timelines with the fixes on")
    parser.add_argument("--stock", type=int, default=1_000, help="timelines on stock vLLM")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import vllm  # noqa: F401  (configures the vllm logger, which we then quiet)

    logging.getLogger("vllm").setLevel(logging.CRITICAL)
    from hotfix import status
    from hotfix.worlds.hotfix_on import hotfix_active
    from tests.worlds.randomized import play
    from hotfix.worlds.scenarios import SINGLE_LOADER
    from hotfix.worlds.scheduler_world import patched_methods

    if patched_methods():
        raise SystemExit(f"vLLM is already patched in this process: {patched_methods()}")
    play(SINGLE_LOADER)  # the first world pays vLLM's lazy imports (~20 s): keep it out of timings
    stock = sweep(args.stock, args.seed)

    before = status.counters()
    with hotfix_active("recv-barrier", "xfer-guard", "pull-pin") as act:
        states = {fix: state["state"] for fix, state in act.snapshot().items()}
        if set(states.values()) != {"applied"}:
            raise SystemExit(f"the fixes did not apply here: {states}")
        fixed = sweep(args.fixed, args.seed)
    after = status.counters()

    show("stock vLLM", stock, examples=False)
    show("recv-barrier + xfer-guard", fixed, examples=True)
    absorbed = {
        f"{fix}.{kind}": n - before.get(fix, {}).get(kind, 0)
        for fix, kinds in after.items() for kind, n in sorted(kinds.items())
        if n > before.get(fix, {}).get(kind, 0)
    }
    print(f"hotfix counters during the fixed run: {absorbed}")


if __name__ == "__main__":
    main()
