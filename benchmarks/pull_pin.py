"""pull-pin: how long READ blocks stay pinned beyond stock, and the wrappers' per-step cost.

    python benchmarks/pull_pin.py

1. Scheduler world (real Scheduler + NixlPullConnectorScheduler, TP=2): in the bug report's
   race the request finishes at tick ~3 while NIXL's READ ends on rank 1 at tick 12. Stock
   returns the blocks at the finish (under the READ); pull-pin at NIXL's last confirmation.
   Printed: ticks and seconds the READ blocks stayed out of the pool, stock vs fixed.
2. Per-step cost, stock vs fixed in the same run, of the wrapped worker-side calls
   (``build_connector_worker_meta``, no confirmation pending: the common step) and of the
   scheduler-side ``update_connector_output``.
"""
from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

from _common import applied, per_call_us

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pinned_ticks() -> None:
    from tests.worlds import scenarios

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
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler

    concrete = type("Worker", (KVConnectorBase_V1,),
                    {name: lambda *a, **k: None for name in KVConnectorBase_V1.__abstractmethods__})
    worker = object.__new__(concrete)
    sched = object.__new__(NixlBaseConnectorScheduler)
    sched._heartbeat_req_engine = {}
    sched._heartbeat_by_engine = {}
    output = SimpleNamespace(finished_recving=None, kv_connector_worker_meta=None)
    rows = []
    for label, call in (("build_connector_worker_meta",
                         lambda: worker.build_connector_worker_meta()),
                        ("update_connector_output", lambda: sched.update_connector_output(output))):
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


if __name__ == "__main__":
    pinned_ticks()
    wrapper_costs()
