"""lease-guard's confirmation (D6b): what asking the prefill costs a READ, stock vs fixed.

    python benchmarks/lease_confirm.py [--questions N] [--json]

1. The question's round trip: a ZMQ question to vLLM's real NIXL handshake listener
   (``NixlBaseConnectorScheduler._nixl_handshake_listener``, wrapped as in production, in a
   thread on loopback), 1 and 16 request ids per question; and, for scale, the same listener's
   own metadata request (what every NIXL handshake makes). Median and p99 in ms.
2. A READ's report on vLLM's real NIXL worker (the NIXL agent a double,
   ``hotfix.worlds.nixl_worker``; P TP=2, so two READ handles): worker polls (steps) from NIXL's
   DONE to the report, and milliseconds, stock vs confirmed, one poll per ``--step-ms``
   (a real engine polls once a step, so the delay is about one step plus the round trip).
3. Memory: ``HeldLeases`` and ``PrefillConfirmations`` after 1,000,000 READs, and at their caps.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from _common import applied, retained_bytes


def _listener(port: int):
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler

    stop, ready = threading.Event(), threading.Event()
    encoded = {(0, 0): msgspec.msgpack.encode({"agent": "x" * 2048})}
    thread = threading.Thread(target=NixlBaseConnectorScheduler._nixl_handshake_listener,
                              args=(encoded, ready, stop, "127.0.0.1", port), daemon=True)
    thread.start()
    ready.wait(10)
    return stop, thread


def _quantiles(samples):
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e3, ordered[int(len(ordered) * 0.99) - 1] * 1e3


def round_trips(questions: int) -> dict:
    import zmq
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG

    from hotfix.fixes import _lease_confirm
    from hotfix.worlds.nixl_worker import _free_port

    port = _free_port()
    act = applied("lease-guard")
    try:
        stop, thread = _listener(port)
    finally:
        act.revert_all()
    for i in range(16):
        _lease_confirm.HELD.hold(f"r{i}")
    out = {}
    try:
        for ids in (1, 16):
            asked = [f"r{i}" for i in range(ids)]
            samples = []
            for _ in range(questions):
                began = time.perf_counter()
                held = _lease_confirm.ask_over_zmq(("127.0.0.1", port), GET_META_MSG, asked, 5.0)
                samples.append(time.perf_counter() - began)
                assert held == asked, held
            out[f"question_{ids}_ids_ms"] = _quantiles(samples)
        import msgspec

        samples = []
        context = zmq.Context.instance()
        for _ in range(questions):
            began = time.perf_counter()
            sock = context.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
            sock.recv_multipart()
            sock.close(0)
            samples.append(time.perf_counter() - began)
        out["handshake_metadata_ms"] = _quantiles(samples)
    finally:
        stop.set()
        thread.join(3)
        _lease_confirm.HELD.release([f"r{i}" for i in range(16)])
    return out


class _MonkeyPatch:
    def __init__(self):
        self._undo = []

    def setattr(self, owner, name, value):
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def undo(self):
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)


def report_delay(reads: int, step_s: float) -> dict:
    from hotfix.fixes import _lease_confirm
    from hotfix.fixes.lease_guard import CONFIRM_ATTR
    from hotfix.worlds.nixl_worker import DecodeWorld

    out = {}
    for variant in ("stock", "confirmed"):
        patch = _MonkeyPatch()
        act = applied("lease-guard") if variant == "confirmed" else None
        world = DecodeWorld(patch)
        polls, seconds = [], []
        try:
            for n in range(reads):
                req = f"R{n}"
                _lease_confirm.HELD.hold(f"prefill-{req}")
                world.load(req, [1, 2], [5, 6], **{CONFIRM_ATTR: (None, None)})
                if n == 0:
                    world.wait_for_handshake(req)
                    world.start()
                for handle in list(world.worker._recving_transfers[req]):
                    world.agent.finish(handle)
                began, count = time.perf_counter(), 0
                while True:
                    count += 1
                    recving, _ = world.finished()
                    if req in recving:
                        break
                    if time.perf_counter() - began > 10:
                        raise SystemExit(f"{variant}: {req} never reported")
                    time.sleep(step_s)  # the rest of an engine step (its forward pass)
                seconds.append(time.perf_counter() - began)
                polls.append(count)
                _lease_confirm.HELD.release([f"prefill-{req}"])
        finally:
            world.close()
            if act is not None:
                act.revert_all()
            patch.undo()
        out[variant] = {"polls_median": statistics.median(polls), "polls_max": max(polls),
                        "ms_median": statistics.median(seconds) * 1e3,
                        "ms_p99": sorted(seconds)[int(len(seconds) * 0.99) - 1] * 1e3}
    return out


def memory() -> dict:
    from hotfix.fixes._lease_confirm import Asker, HeldLeases, PrefillConfirmations

    def churn_held(held):
        for i in range(1_000_000):
            held.hold(f"req-{i}")
            held.release([f"req-{i}"])

    held, empty, after = retained_bytes(HeldLeases, churn_held)
    out = {"held_after_1e6": [len(held), empty, after]}

    def burst(held):
        for i in range(1_000_000):
            held.hold(f"req-{i}")

    held, _, at_cap = retained_bytes(HeldLeases, burst)
    out["held_at_cap"] = [len(held), held.cap, at_cap]

    def churn_reads(book):
        for i in range(1_000_000):
            book.expect(f"req-{i}", ("10.0.0.1", 5600), f"p-{i}", [("agent", b"p:1")])
            book.forget(f"req-{i}")

    book, empty, after = retained_bytes(lambda: PrefillConfirmations(Asker(lambda a, i: None)), churn_reads)
    out["reads_after_1e6"] = [len(book), empty, after]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=2000)
    parser.add_argument("--reads", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=5.0,
                        help="time between the worker's polls (an engine step)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = {"round_trip": round_trips(args.questions), "report": report_delay(args.reads, args.step_ms / 1e3),
              "memory": memory()}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print("Question to vLLM's NIXL handshake listener (loopback): median / p99 ms")
    for name, (median, p99) in result["round_trip"].items():
        print(f"  {name:<26} {median:7.3f} / {p99:7.3f}")
    print(f"A READ's report after NIXL's DONE, vLLM's NIXL worker (a poll every {args.step_ms} ms)")
    for variant, row in result["report"].items():
        print(f"  {variant:<10} polls median {row['polls_median']} max {row['polls_max']}; "
              f"ms median {row['ms_median']:.3f} p99 {row['ms_p99']:.3f}")
    mem = result["memory"]
    print(f"HeldLeases after 1,000,000 holds and releases: {mem['held_after_1e6'][0]} entries, "
          f"{mem['held_after_1e6'][1]} B empty, {mem['held_after_1e6'][2]} B after")
    print(f"HeldLeases after 1,000,000 holds never released: {mem['held_at_cap'][0]} entries "
          f"(cap {mem['held_at_cap'][1]}), {mem['held_at_cap'][2]} B")
    print(f"PrefillConfirmations after 1,000,000 READs: {mem['reads_after_1e6'][0]} entries, "
          f"{mem['reads_after_1e6'][1]} B empty, {mem['reads_after_1e6'][2]} B after")


if __name__ == "__main__":
    main()
