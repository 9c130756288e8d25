"""lease-guard: the decode scheduler's per-step cost, stock vs fixed, and the book's memory.

    python benchmarks/lease_guard.py

1. Per-step cost, stock vs fixed in the same run, of vLLM's real
   ``NixlBaseConnectorScheduler.build_connector_meta`` (a step that ships no READ and no
   heartbeat, the common one) with 0, 100 and 10,000 arrived requests whose lease is not
   judged yet, and of ``on_new_request`` for a request with a deadline.
2. ``LeaseBook`` after 1,000,000 requests (arrive, judged at their READ): entries and bytes
   left (tracemalloc); and a burst of 1,000,000 arrivals nobody judges: held at its cap.
"""
from __future__ import annotations

import time

from _common import applied, per_call_us, retained_bytes


def nixl_scheduler():
    from hotfix.worlds.scheduler_world import World, nixl_pull

    return World([nixl_pull()]).child("nixl").connector_scheduler


def main() -> None:
    from hotfix.fixes import lease_guard
    from hotfix.worlds.scheduler_world import World, nixl_pull
    from hotfix.worlds.timeline import Arrive

    world = World([nixl_pull()])
    request = world.make_request(Arrive(0, "bench", remote_prefill=True,
                                        extra_params={lease_guard.DEADLINE_KEY: time.time() + 30}))
    rows = []
    for pending in (0, 100, 10_000):
        stock_sched = nixl_scheduler()
        stock = per_call_us(lambda: stock_sched.build_connector_meta(None))
        stock_arrive = per_call_us(lambda: stock_sched.on_new_request(request))
        act = applied("lease-guard")
        try:
            fixed_sched = nixl_scheduler()
            book = lease_guard._book(fixed_sched)
            for i in range(pending):
                book.arrive(f"r{i}", time.time() + 30)
            fixed = per_call_us(lambda: fixed_sched.build_connector_meta(None))
            arrive = per_call_us(lambda: fixed_sched.on_new_request(request))
        finally:
            act.revert_all()
        rows.append((pending, stock, fixed, stock_arrive, arrive))
    print("NixlBaseConnectorScheduler.build_connector_meta: per-step cost, stock vs lease-guard")
    print(f"{'unjudged':>10} {'stock us':>10} {'fixed us':>10} {'ratio':>7}"
          f" {'on_new_request stock us':>24} {'fixed us':>9}")
    for pending, stock, fixed, stock_arrive, arrive in rows:
        print(f"{pending:>10} {stock:10.2f} {fixed:10.2f} {fixed / stock:7.2f}"
              f" {stock_arrive:24.2f} {arrive:9.2f}")

    def churn(book):
        now = 1000.0
        for i in range(1_000_000):
            req = f"req-{i}"
            book.arrive(req, now + 30)
            book.take_refusal(req, now + (40 if i % 10 == 0 else 1))  # every tenth refused

    book, empty, after = retained_bytes(lambda: lease_guard.LeaseBook(5.0), churn)
    print(f"\nLeaseBook after 1,000,000 requests: {len(book)} entries; {empty} B empty, {after} B after")

    def burst(book):
        for i in range(1_000_000):
            book.arrive(f"req-{i}", 2000.0)

    book, empty, after = retained_bytes(lambda: lease_guard.LeaseBook(5.0), burst)
    print(f"LeaseBook after 1,000,000 arrivals never judged: {len(book)} entries (cap {book.cap}), "
          f"{after} B")
    for req_id in book.pending():
        book.forget(req_id)
    print(f"... and after each of them finished: {len(book)} entries")


if __name__ == "__main__":
    main()
