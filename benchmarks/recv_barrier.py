"""recv-barrier: per-step cost of the wrapped worker entry point vs stock, and state memory.

    python benchmarks/recv_barrier.py

Stock and fixed run in the same process on the real ``MultiConnector`` entry point
(``get_finished`` up to 0.29, ``get_transfer_results`` from 0.30) with two children, and
0 / 100 / 10,000 load episodes in flight. Then 1,000,000 requests go through a LoadBarrier
and we check its memory returns to its empty size (plus the fixed-size diagnostics ring).
"""
from __future__ import annotations

from _common import applied, per_call_us, retained_bytes


def main() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from hotfix.fixes.recv_barrier import LoadBarrier

    entry = "get_transfer_results" if "get_transfer_results" in vars(MultiConnector) else "get_finished"

    class Child:
        """Reports ``pending`` once per call, then nothing."""

        def __init__(self):
            self.pending = set()

        def _take(self):
            taken, self.pending = self.pending, set()
            return taken

        def get_finished(self, finished_req_ids):
            return None, self._take()

        def get_transfer_results(self, finished_req_ids):
            from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

            return KVConnectorTransferResults(finished_recving=self._take())

    def connector(in_flight: int):
        mc = object.__new__(MultiConnector)
        mc._connectors = [Child(), Child()]
        mc._extra_async_saves = {}
        barrier = mc.__dict__["_hotfix_barrier"] = LoadBarrier()
        mc.__dict__["_hotfix_coordinated"] = True
        for i in range(in_flight):
            barrier.plan(f"r{i}", 0)
            barrier.started(f"r{i}", 1)
        return mc

    def quiet_step(mc):
        return lambda: getattr(mc, entry)(set())

    def completing_step(mc):
        barrier = mc.__dict__["_hotfix_barrier"]
        def step():
            barrier.plan("hot", 0)
            mc._connectors[0].pending.add("hot")
            getattr(mc, entry)(set())
        return step

    rows = []
    for in_flight in (0, 100, 10_000):
        for label, make in (("no report", quiet_step), ("1 completion", completing_step)):
            stock = per_call_us(make(connector(in_flight)))
            act = applied("recv-barrier")
            try:
                fixed = per_call_us(make(connector(in_flight)))
            finally:
                act.revert_all()
            rows.append((in_flight, label, stock, fixed))
    print(f"MultiConnector.{entry}: per-step cost, stock vs recv-barrier (same run)")
    print(f"{'in flight':>10} {'step':>14} {'stock us':>10} {'fixed us':>10} {'ratio':>7}")
    for in_flight, label, stock, fixed in rows:
        print(f"{in_flight:>10} {label:>14} {stock:10.2f} {fixed:10.2f} {fixed / stock:7.2f}")

    def churn(barrier):
        for i in range(1_000_000):
            req = f"req-{i}"
            barrier.plan(req, 0)
            barrier.started(req, 1)
            barrier.report(req, 1)
            barrier.report(req, 0)

    barrier, empty, after = retained_bytes(LoadBarrier, churn)
    print(f"\nLoadBarrier after 1,000,000 requests: {len(barrier)} open episodes; "
          f"{empty} B empty, {after} B after ({after - empty} B = diagnostics ring of "
          f"{barrier.remember} recently forwarded ids, fixed size)")


if __name__ == "__main__":
    main()
