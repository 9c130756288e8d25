"""The P/D world with the decode at TP=2: what it costs, and that the hotfix holds there.

    python benchmarks/pd_tp2.py [--json]

A prefill engine (TP=1) and a bug-report decode engine at TP=2 with the hotfix on its
``PYTHONPATH`` (NIXL's heterogeneous TP: each D rank READs its own KV head from P's one rank
over UCX/TCP), each READ started 16 steps late on rank 0 and 20 on rank 1, so the second
connector's report (one step) comes long before NIXL's on either rank. Three P/D requests:
a clean pull, the racy one (the second connector loads it too), and one after it. Printed:
start and run seconds, whether each decode equals P's local greedy decode, each rank's NIXL
report step for the racy request and the step D promoted it (after both, with the hotfix).

Not in CI: on a 2-core machine a TP=2 decode's workers busy-poll vLLM's shared-memory
broadcast while the engine steps, which starves the engines around it. Measured here
(2 cores): one TP=2 decode added to test_pd_world.py's eight engines made that module 311 s
instead of 180 s; this world alone (two engines) starts in ~55 s. The engine world runs TP=2
in CI (tests/test_engine_world.py), where an engine has the box to itself.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

READ_DELAY_STEPS, RANK_1_LATER, MAX_TOKENS = 16, 4, 8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from hotfix.worlds import pd_world as pd
    from hotfix.worlds.home import clean_env, hotfix_home

    root = Path(tempfile.mkdtemp(prefix="bench-pd-tp2-"))
    began = time.monotonic()
    with pd.PDWorld(root, pd.build_model(root / "model"), clean_env()) as world:
        prefill = world.start("prefill", pd.prefill_config(), engine_args={"enable_prefix_caching": False})
        config = pd.decode_bug_report_config(READ_DELAY_STEPS,
                                             read_delay_steps_by_rank={1: READ_DELAY_STEPS + RANK_1_LATER})
        decode = world.start("decode-tp2-hotfix", config, hotfix_home=hotfix_home(root / "home"),
                             engine_args={"tensor_parallel_size": 2})
        for engine in world.engines:
            engine.wait_ready()
        started = time.monotonic() - began
        pd.warm_up(prefill, decode)
        rng = random.Random(3)
        equal = {}
        for name, length, cache_hit in (("clean", 70, False), ("racy", 100, True), ("after", 90, False)):
            tokens = [rng.randrange(3, pd.VOCAB_SIZE) for _ in range(length)]
            (local,) = prefill.generate([pd.Request(tokens, MAX_TOKENS)])
            equal[name] = pd.transfer(prefill, decode, tokens, MAX_TOKENS, cache_hit=cache_hit) == local.token_ids
        log = decode.log()
        ((racy_id, _),) = [(r, e) for r, e in pd.timeline(log).items() if "cache_reported" in e]
        reports = pd.nixl_reports_by_rank(log)[racy_id]
        promoted = sorted({step for step, owner, _ in pd.allocations(log) if owner == racy_id})[1]
        result = {"start_s": round(started, 1), "total_s": round(time.monotonic() - began, 1),
                  "tokens_equal_reference": equal, "racy_nixl_report_step_by_rank": reports,
                  "racy_promoted_step": promoted, "decode_alive": decode.alive(),
                  "promoted_after_every_rank": promoted > max(reports.values())}
    print(json.dumps(result, indent=None if args.json else 2))
    return 0 if all(equal.values()) and result["promoted_after_every_rank"] and result["decode_alive"] else 1


if __name__ == "__main__":
    sys.exit(main())
