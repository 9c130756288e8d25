"""xfer-guard: cost of the wrapped ``Scheduler._update_from_kv_xfer_finished`` vs stock, and
hold-ledger memory.

    python benchmarks/xfer_guard.py

Same process, real method: an output with no ids (the common step), 10 and 1,000
``finished_recving`` ids of requests waiting for remote KV (the normal case, which stock
handles too). Then 1,000,000 requests with two holders each go through a HoldLedger.
"""
from __future__ import annotations

from types import SimpleNamespace

from _common import applied, per_call_us, retained_bytes


def main() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    from hotfix.fixes._holds import RECV, SAVE, HoldLedger

    def scheduler(n: int):
        s = object.__new__(Scheduler)
        s.connector = None
        s.finished_recving_kv_req_ids = set()
        s.requests = {f"r{i}": SimpleNamespace(request_id=f"r{i}", status=RequestStatus.WAITING_FOR_REMOTE_KVS)
                      for i in range(n)}
        return s

    def step(n: int):
        s = scheduler(n)
        output = KVConnectorOutput(finished_recving={f"r{i}" for i in range(n)} or None)
        def call():
            s.finished_recving_kv_req_ids.clear()
            s._update_from_kv_xfer_finished(output)
        return call

    rows = []
    for n in (0, 10, 1000):
        calls = 2000 if n < 1000 else 200
        stock = per_call_us(step(n), calls=calls)
        act = applied("xfer-guard")
        try:
            fixed = per_call_us(step(n), calls=calls)
        finally:
            act.revert_all()
        rows.append((n, stock, fixed))
    print("Scheduler._update_from_kv_xfer_finished: stock vs xfer-guard (same run)")
    print(f"{'ids':>6} {'stock us':>10} {'fixed us':>10} {'ratio':>7}")
    for n, stock, fixed in rows:
        print(f"{n:>6} {stock:10.2f} {fixed:10.2f} {fixed / stock:7.2f}")

    def churn(ledger):
        for i in range(1_000_000):
            req = f"req-{i}"
            ledger.hold(req, RECV)
            ledger.hold(req, SAVE)
            ledger.release(req, SAVE)
            ledger.release(req, RECV)
            ledger.forget(req)

    ledger, empty, after = retained_bytes(HoldLedger, churn)
    print(f"\nHoldLedger after 1,000,000 requests: {len(ledger)} entries; {empty} B empty, {after} B after")


if __name__ == "__main__":
    main()
