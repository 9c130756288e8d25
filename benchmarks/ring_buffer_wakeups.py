"""Lost wake-ups in vLLM's EngineCore-to-worker ring buffer (issue #30's stall, narrowed).

vLLM's ``MessageQueue`` (``shm_broadcast``) is how an EngineCore hands each step to its workers:
a shared-memory ring buffer, plus a ZMQ PUB/SUB notification that wakes a reader which has been
idle for more than ``busy_loop_s`` (1 s). A reader that misses the notification finds the
message only when its wait times out: for a worker (``dequeue(indefinite=True)``) vLLM's fixed
``SHM_READER_RECHECK_INTERVAL_MS``, 5 s. This runs the real class with one writer (this
process, the EngineCore) and one reader (a spawned process, the worker), nothing else of vLLM:
the writer enqueues a timestamped message every ``--gap`` seconds (longer than the busy loop, so
the reader is idle in ``poll`` each time, as a worker is between an idle engine's steps), the
reader records how late each arrived. ``--hogs N`` adds N processes that spin on the CPU (the
worlds' oversubscribed 2 cores); ``--recheck-ms`` sets the reader's recheck as the faults world
does. A message later than half the recheck is counted as a lost wake-up. ``--burst N``: after
each gapped message the writer enqueues N more back to back, which the reader takes while it
spins (as a worker takes an active engine's steps, never reading their notifications); only
the gapped messages are timed (each still reaches a reader idle past its spin, so this is not
the two queues' request-reply lockstep).

    .venv/bin/python benchmarks/ring_buffer_wakeups.py [--messages 200] [--gap 1.1] [--hogs 0,4] [--burst 0,50] [--json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import _common  # noqa: F401  (puts the checkout on sys.path)


def _read(handle, count: int, burst: int, recheck_ms: int | None, out) -> None:
    from vllm.distributed.device_communicators import shm_broadcast

    if recheck_ms:
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = recheck_ms
    queue = shm_broadcast.MessageQueue.create_from_handle(handle, 0)
    queue.wait_until_ready()
    late = []
    for _ in range(count * (burst + 1)):
        timed, sent = queue.dequeue(indefinite=True)
        if timed:
            late.append(time.monotonic() - sent)
    out.send(late)


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def run(messages: int, gap_s: float, hogs: int, recheck_ms: int | None, burst: int = 0) -> dict:
    from vllm.distributed.device_communicators import shm_broadcast

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    spinners = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(hogs)]
    for p in spinners:
        p.start()
    queue = shm_broadcast.MessageQueue(1, 1)
    ours, theirs = ctx.Pipe()
    reader = ctx.Process(target=_read, args=(queue.export_handle(), messages, burst, recheck_ms, theirs))
    reader.start()
    try:
        queue.wait_until_ready()
        for _ in range(messages):
            time.sleep(gap_s)
            queue.enqueue((True, time.monotonic()))
            for _ in range(burst):
                queue.enqueue((False, time.monotonic()))
        late = ours.recv() if ours.poll(messages * 6 + 60) else []
    finally:
        stop.set()
        reader.join(10)
        if reader.is_alive():
            reader.kill()
        for p in spinners:
            p.join(5)
    recheck_s = (recheck_ms or shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS) / 1000
    lost = [x for x in late if x >= recheck_s / 2]
    return {"hogs": hogs, "burst": burst, "gap_s": gap_s, "recheck_ms": int(recheck_s * 1000), "messages": len(late),
            "lost_wake_ups": len(lost), "lost_late_s": [round(x, 2) for x in lost],
            "p50_ms": round(statistics.median(late) * 1000, 2) if late else None,
            "p99_ms": round(sorted(late)[int(len(late) * 0.99) - 1] * 1000, 1) if late else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--gap", type=float, default=1.1, help="seconds between messages (> the 1 s busy loop)")
    parser.add_argument("--hogs", default="0,4", help="spinning processes per run, comma-separated")
    parser.add_argument("--recheck-ms", type=int, default=None, help="the reader's recheck (vLLM: 5000)")
    parser.add_argument("--burst", default="0", help="messages back to back after each gapped one, per run, comma-separated")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [run(args.messages, args.gap, int(h), args.recheck_ms, int(b))
            for h in args.hogs.split(",") for b in args.burst.split(",")]
    if args.json:
        print(json.dumps({"rows": rows}))
        return
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
