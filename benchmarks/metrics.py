"""Monitoring: what the status flushing costs the hot path, and what the scrape costs.

    python benchmarks/metrics.py            # all four parts (part 4 starts two API servers)
    python benchmarks/metrics.py --no-servers

1. Hot path: ``status.count`` and ``status.gauge`` per call (what a fix pays per event; no
   file I/O there) against an empty call, and how many status writes a storm of counts
   causes per second (the timer writes at most once per ``FLUSH_INTERVAL_S``).
2. Collector: one scrape's ``collect()`` over an engine of 1 EngineCore + 8 workers.
3. Engine steps: the same 200 randomized timelines (real Scheduler, MultiConnector, NIXL
   scheduler; ``benchmarks/timelines.py``'s runner) with recv-barrier, xfer-guard and pull-pin
   on, once with the status accounting as shipped and once with ``status.count``/``gauge``
   replaced by no-ops, four rounds in alternating order, best of each: the ratio is what the
   accounting costs a step.
4. Real servers, same run: ``/metrics`` scrape latency (p50/p99 of 60 scrapes) of an API
   server with the hotfix and of one with ``HOTFIX_DISABLE=1``, and the ratio.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

from _common import per_call_us


def hot_path() -> None:
    from hotfix import registry, status

    os.environ["HOTFIX_STATUS_DIR"] = tempfile.mkdtemp(prefix="bench-status-")
    registry.activation = lambda: SimpleNamespace(source="bench", snapshot=lambda: {})
    writes = []
    real_write = status.write
    status.write = lambda act: (writes.append(threading.current_thread()), real_write(act))

    def nothing(_fix, _kind):
        return None

    empty = per_call_us(lambda: nothing("bench", "event"), calls=20000)
    counted = per_call_us(lambda: status.count("bench", "event"), calls=20000)
    same = per_call_us(lambda: status.gauge("bench", "level", 3), calls=20000)
    levels = iter(range(10**9))
    changed = per_call_us(lambda: status.gauge("bench", "level", next(levels)), calls=20000)
    print("1. hot path, per call (us)")
    print(f"   empty call {empty:.3f}; status.count {counted:.3f} (+{counted - empty:.3f}); "
          f"status.gauge unchanged {same:.3f}, changed {changed:.3f}")
    writes.clear()
    t0 = time.monotonic()
    calls = 0
    while time.monotonic() - t0 < 5.0:
        status.count("bench", "storm")
        calls += 1
    time.sleep(status.FLUSH_INTERVAL_S + 0.2)
    elapsed = time.monotonic() - t0
    print(f"   storm: {calls:,} counts in 5 s -> {len(writes)} status writes "
          f"({len(writes) / elapsed:.2f}/s, interval {status.FLUSH_INTERVAL_S} s), "
          f"none on the counting thread: {threading.main_thread() not in writes}")


def collector_cost() -> None:
    from hotfix import metrics, registry

    directory = tempfile.mkdtemp(prefix="bench-scrape-")
    specs = registry.discover()
    fixes = {s.id: {"state": "applied"} for s in specs}
    counters = {s.id: {k: 3 for m in s.metrics for k in m.kinds} for s in specs}
    pids = [os.getpid()] + [os.getppid()] * 8  # live pids; one file each
    for i, pid in enumerate(pids):
        record = {"pid": pid, "ppid": 1, "role": "EngineCore" if i == 0 else f"VllmWorker-{i}",
                  "identity": {"kind": "engine_core" if i == 0 else "worker"}, "model_name": "m",
                  "engine": "0", "fixes": fixes, "counters": counters, "gauges": {}}
        with open(os.path.join(directory, f"{100000 + i}.json"), "w") as fh:
            json.dump(record, fh)
    collector = metrics.HotfixCollector(directory, "m")
    cost = per_call_us(lambda: list(collector.collect()), calls=50, repeats=5)
    print(f"2. collect() over 9 status records: {cost / 1000:.2f} ms per scrape")


def engine_steps(timelines: int = 200, rounds: int = 4) -> None:
    import logging

    import vllm  # noqa: F401  (configures the vllm logger, which we then quiet)

    logging.getLogger("vllm").setLevel(logging.CRITICAL)
    from timelines import sweep

    from hotfix import status
    from hotfix.worlds.hotfix_on import hotfix_active
    from tests.worlds.randomized import play
    from hotfix.worlds.scenarios import SINGLE_LOADER

    play(SINGLE_LOADER)  # vLLM's lazy imports stay out of the timings
    real = (status.count, status.gauge)
    walls = {"shipped": [], "no-op": []}
    with hotfix_active("recv-barrier", "xfer-guard", "pull-pin"):
        for round_ in range(rounds):
            for side in (("shipped", "no-op") if round_ % 2 else ("no-op", "shipped")):
                if side == "no-op":
                    status.count = status.gauge = lambda *a, **k: None
                try:
                    walls[side].append(sweep(timelines, seed=0)["wall_s"])
                finally:
                    status.count, status.gauge = real
    shipped, noop = min(walls["shipped"]), min(walls["no-op"])
    print(f"3. engine steps, {timelines} timelines with the fixes (best of {rounds}): status accounting "
          f"as shipped {shipped:.2f} s, no-op {noop:.2f} s, ratio {shipped / noop:.3f}")


def servers() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from pathlib import Path

    from hotfix.worlds import api_server

    root = Path(tempfile.mkdtemp(prefix="bench-metrics-"))
    started = {}
    try:
        started["hotfix"] = api_server.start(root, "hotfix")
        started["disabled"] = api_server.start(root, "disabled", env={"HOTFIX_DISABLE": "1"})
        for server in started.values():
            server.wait_ready()
            server.complete(list(range(3, 23)), 4)
        times = {name: [] for name in started}
        for _ in range(60):
            for name, server in started.items():
                t0 = time.perf_counter()
                text = server.scrape()
                times[name].append((time.perf_counter() - t0) * 1000)
                times.setdefault(f"{name}_bytes", len(text))
        print("4. /metrics scrape, ms (60 each, interleaved)")
        for name in started:
            samples = sorted(times[name])
            print(f"   {name:>8}: p50 {statistics.median(samples):.2f}  p99 {samples[int(0.99 * len(samples)) - 1]:.2f}"
                  f"  ({times[f'{name}_bytes']:,} bytes)")
        ratio = statistics.median(times["hotfix"]) / statistics.median(times["disabled"])
        print(f"   ratio hotfix/disabled (p50): {ratio:.2f}")
    finally:
        for server in started.values():
            server.stop()


def main() -> None:
    hot_path()
    collector_cost()
    engine_steps()
    if "--no-servers" not in sys.argv:
        servers()


if __name__ == "__main__":
    main()
