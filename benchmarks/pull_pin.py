"""pull-pin: how long READ blocks stay pinned beyond stock, and the wrappers' per-step cost.

    python benchmarks/pull_pin.py
    python benchmarks/pull_pin.py --pd     # 3. only (several minutes)

1. Scheduler world (real Scheduler + NixlPullConnectorScheduler, TP=2): in the bug report's
   race the request finishes at tick ~3 while NIXL's READ ends on rank 1 at tick 12. Stock
   returns the blocks at the finish (under the READ); pull-pin at NIXL's last confirmation.
   Printed: ticks and seconds the READ blocks stayed out of the pool, stock vs fixed.
2. Per-step cost, stock vs fixed in the same run, of the wrapped worker-side calls
   (``build_connector_worker_meta``, no confirmation pending: the common step) and of the
   scheduler-side ``update_connector_output``.
3. P/D world (``--pd``): a prefill engine and two bug-report decode engines, stock and
   pull-pin (recv-barrier off, so the cache's report still promotes early), moving KV through
   the real NixlConnector with each READ started 24 steps late (a request finishes in 10, so
   the next one is served before a late READ lands). Each decode engine serves the same
   sequence: a clean pull (after one that does NIXL's handshake), an early-promoted request
   that finishes, one the client aborts after its first token, then a local request that
   keeps the engine stepping while the late READs land and a P/D request (a late READ over
   UCX/TCP may complete only once P works again; stock dies at the first late report).
   Printed per request: worker steps and seconds its READ's blocks stayed out of the pool
   (stock: allocation to finish or abort; pull-pin: to the later of that and NIXL's report),
   how long pull-pin kept them past the request's end (what it adds over stock on that very
   request), and pull-pin/stock ratios (the two engines' clean pulls differ by READ latency
   only). Seconds include whatever the box's load adds; steps do not.
"""
from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from _common import applied, per_call_us

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pinned_ticks() -> None:
    from hotfix.worlds import scenarios

    scenario = scenarios.NIXL_RANKS_FINISH_APART
    for label, fixes in (("stock", ()), ("pull-pin+xfer-guard", ("pull-pin", "xfer-guard"))):
        act = applied(*fixes) if fixes else None
        start = time.perf_counter()
        try:
            result = scenario.run()
        finally:
            if act is not None:
                act.revert_all()
        elapsed = time.perf_counter() - start
        ticks = len(result.steps)
        per_tick = elapsed / max(ticks, 1)
        finish = next(s.step for s in result.steps if "R" in s.finished)
        freed = [s.step for s in result.steps if s.step > finish and s.free_blocks > result.steps[s.step - 1].free_blocks]
        released = finish if label == "stock" else (freed[0] if freed else None)
        extra = (released - finish) if released is not None else None
        print(f"{label:22} R finished at tick {finish}; READ blocks back in the pool at tick "
              f"{released} (+{extra} ticks, ~{(extra or 0) * per_tick * 1e3:.1f} ms of world time)")


def wrapper_costs() -> None:
    """Per-step cost of the wrapped calls once the halves agreed (the common step: nothing
    to confirm, nothing to announce), stock vs fixed; plus the handshake's stamp."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector

    from hotfix.fixes import pull_pin
    from hotfix.halves import AGREED

    concrete = type("Worker", (KVConnectorBase_V1,),
                    {name: lambda *a, **k: None for name in KVConnectorBase_V1.__abstractmethods__})
    worker = object.__new__(concrete)
    reads = worker.__dict__["_hotfix_reads"] = pull_pin._WorkerReads()
    reads.half.state = AGREED
    sched = object.__new__(NixlBaseConnectorScheduler)
    sched._heartbeat_req_engine = {}
    sched._heartbeat_by_engine = {}
    sched.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=1))
    sched.build_connector_meta = lambda scheduler_output: SimpleNamespace()
    pull_pin._scheduler_half(sched).state = AGREED
    facade = object.__new__(type("Nixl", (NixlBaseConnector,), {
        name: lambda *a, **k: None for name in NixlBaseConnector.__abstractmethods__}))
    facade.connector_scheduler = sched
    output = SimpleNamespace(finished_recving=None, kv_connector_worker_meta=None)
    rows = []
    for label, call in (("build_connector_worker_meta",
                         lambda: worker.build_connector_worker_meta()),
                        ("update_connector_output", lambda: sched.update_connector_output(output)),
                        ("build_connector_meta (stamp)", lambda: facade.build_connector_meta(None))):
        stock = per_call_us(call)
        act = applied("pull-pin")
        try:
            fixed = per_call_us(call)
        finally:
            act.revert_all()
        rows.append((label, stock, fixed))
    print(f"\n{'call':30} {'stock us':>9} {'fixed us':>9} {'ratio':>6}")
    for label, stock, fixed in rows:
        print(f"{label:30} {stock:9.2f} {fixed:9.2f} {fixed / stock:6.2f}")


def _held(log: str, req_id: str, pinned: bool) -> tuple:
    """(steps, seconds) from ``req_id``'s allocation until its READ's blocks were free again,
    and (steps, seconds) of that past the request's end."""
    from hotfix.worlds import pd_world as pd

    steps, at = pd.timeline(log)[req_id], pd.seconds(log)[req_id]
    back, back_s = steps["finished"], at["finished"]
    if pinned:  # a pin goes in the step NIXL's report is processed: free for the next step
        back, back_s = max(back, steps["nixl_reported"] + 1), max(back_s, at["nixl_reported"])
    return (back - steps["allocated"], back_s - at["allocated"],
            back - steps["finished"], back_s - at["finished"])


def pd_pinned(max_tokens: int = 8, read_delay_steps: int = 24) -> None:
    from hotfix.worlds import pd_world as pd

    repo = Path(__file__).resolve().parent.parent
    root = Path(tempfile.mkdtemp(prefix="bench-pull-pin-pd-"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HOTFIX_") and k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    rng = random.Random(3)
    handshake, clean, racy, aborted, after, flush = (
        [rng.randrange(3, pd.VOCAB_SIZE) for _ in range(n)] for n in (40, 70, 100, 100, 90, 60))
    bug_report = pd.decode_bug_report_config(read_delay_steps)
    rows = {}
    with pd.PDWorld(root, pd.build_model(root / "model"), env) as world:
        prefill = world.start("prefill", pd.prefill_config(), engine_args={"enable_prefix_caching": False})
        decodes = {"stock": world.start("decode-stock", bug_report),
                   "pull-pin": world.start("decode-pin", bug_report, hotfix_home=repo,
                                           env={"HOTFIX_RECV_BARRIER": "off"})}
        for engine in world.engines:
            engine.wait_ready()
        for label, decode in decodes.items():
            pd.transfer(prefill, decode, handshake, max_tokens)
            pd.transfer(prefill, decode, clean, max_tokens)
            pd.transfer(prefill, decode, racy, max_tokens, cache_hit=True)
            abort_id = pd.transfer_then_abort(prefill, decode, aborted, 4 * max_tokens, 1, cache_hit=True)
            try:
                decode.generate([pd.Request(after, 4 * max_tokens)])
                pd.transfer(prefill, decode, flush, max_tokens)
            except pd.EngineFailure as exc:
                print(f"{label}: the decode engine died ({exc.kind}) at a late NIXL report")
            log = decode.log()
            served = list(dict.fromkeys(owner for _, owner, _ in pd.allocations(log)))
            assert served[3] == abort_id, served
            for kind, req_id in zip(("clean pull", "early-promoted, finished", "aborted after 1 token"),
                                    served[1:]):
                rows.setdefault(kind, {})[label] = _held(log, req_id, pinned=label == "pull-pin")
    print(f"\nREAD blocks out of the pool, allocation to free (worker steps, seconds); "
          f"READ {read_delay_steps} steps late")
    print(f"{'request':26} {'stock':>14} {'pull-pin':>14} {'past its end':>14} {'ratio steps':>11} "
          f"{'ratio s':>8}")
    for kind, held in rows.items():
        (stock_steps, stock_s, _, _), (pin_steps, pin_s, past, past_s) = held["stock"], held["pull-pin"]
        print(f"{kind:26} {stock_steps:5d} {stock_s:7.2f}s {pin_steps:5d} {pin_s:7.2f}s "
              f"{past:+5d} {past_s:+7.2f}s {pin_steps / stock_steps:11.2f} {pin_s / stock_s:8.2f}")


if __name__ == "__main__":
    if "--pd" in sys.argv[1:]:
        pd_pinned()
    else:
        pinned_ticks()
        wrapper_costs()
