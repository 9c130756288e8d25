"""load-bound: what the bound costs a step, and its state returning to empty.

    python benchmarks/load_bound.py

The step cost: the wrapper's work before vLLM's ``update_from_output`` body (absorb late
reports, start the clock of new loads, find loads past the bound) on a scheduler holding 0 /
256 / 4,096 requests, 16 of them waiting for remote KV, with no load past the bound (the
healthy case): a scan of the queue of blocked waiting requests each step
(``skipped_waiting`` / ``kv_holding_waiting``), whatever the number of requests. Stock does none of this work, so the
figure is absolute: compare it with a decode step's milliseconds. Then 1,000,000 loads go through the clock
(started, ended) and 100,000 timed-out loads through the quarantine (added, late report):
both return to their empty size, bar the fixed-size ring of recent timeouts (retry budget).
"""
from __future__ import annotations

import time
from types import SimpleNamespace

from _common import retained_bytes


def main() -> None:
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    from hotfix.fixes import load_bound
    from hotfix.fixes.load_bound import LoadClock, Quarantine, _State
    from hotfix.worlds.scheduler_world import runner_output

    def scheduler(n: int):
        requests = {f"r{i}": SimpleNamespace(request_id=f"r{i}", status=RequestStatus.RUNNING)
                    for i in range(n)}
        blocked = [requests[f"r{i}"] for i in range(min(16, n))]
        for request in blocked:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        return SimpleNamespace(requests=requests, connector=object(), skipped_waiting=blocked)

    output = runner_output(kv_connector_output=KVConnectorOutput(finished_recving={"x"}))
    print("Scheduler.update_from_output: the bound's work per step (no load past it)")
    print(f"{'requests':>9} {'us/step':>9}")
    for n in (0, 256, 4096):
        sched, state = scheduler(n), _State(timeout=3600.0)
        steps = 20_000 if n < 4096 else 2_000
        began = time.perf_counter()
        for _ in range(steps):
            load_bound._before(sched, state, output)
        print(f"{n:>9} {(time.perf_counter() - began) / steps * 1e6:9.2f}")

    def churn_clock(clock):
        for i in range(1_000_000):
            clock.start(f"req-{i}", float(i))
            clock.end(f"req-{i}")

    clock, empty, after = retained_bytes(lambda: LoadClock(timeout=1.0), churn_clock)
    print(f"\nLoadClock after 1,000,000 loads: {len(clock)} entries; {empty} B empty, {after} B after")

    def churn_quarantine(q):
        for i in range(100_000):
            q.add(f"req-{i}", ([object()],))
            q.ended(f"req-{i}")

    q, empty, after = retained_bytes(Quarantine, churn_quarantine)
    print(f"Quarantine after 100,000 timed-out loads: {len(q)} held, {q.blocks} blocks; {empty} B "
          f"empty, {after} B after (the ring of {q.remember} recent timeouts, fixed size)")


if __name__ == "__main__":
    main()
