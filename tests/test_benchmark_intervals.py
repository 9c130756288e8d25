"""The serving benchmark's figures (issue #30): the overhead interval (a percentile bootstrap of
the ratio of two variants' means over their rounds, seeded, so a report is reproducible), and
what the box's CPUs did during an engine's wait."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from _common import ratio_ci95  # noqa: E402


def test_identical_rounds_give_an_interval_of_exactly_one():
    assert ratio_ci95([2.0, 2.0, 2.0], [2.0, 2.0, 2.0]) == [1.0, 1.0]


def test_the_interval_holds_the_ratio_of_the_means_and_narrows_with_more_rounds():
    few_fixed, few_stock = [1.02, 1.10, 0.98, 1.05], [1.00, 0.95, 1.04, 1.01]
    lo, hi = ratio_ci95(few_fixed, few_stock)
    ratio = (sum(few_fixed) / 4) / (sum(few_stock) / 4)
    assert lo < ratio < hi
    wide = hi - lo
    lo, hi = ratio_ci95(few_fixed * 9, few_stock * 9)
    assert lo < ratio < hi and hi - lo < wide / 2


def test_a_slower_variant_is_outside_one_and_the_same_seed_gives_the_same_interval():
    fixed, stock = [1.30, 1.32, 1.29, 1.31, 1.33], [1.00, 1.02, 0.99, 1.01, 0.98]
    assert ratio_ci95(fixed, stock)[0] > 1.2
    assert ratio_ci95(fixed, stock, seed=3) == ratio_ci95(fixed, stock, seed=3)


def test_fewer_than_two_rounds_a_side_give_no_interval():
    assert ratio_ci95([1.0], [1.0, 1.1]) is None


def test_a_waits_box_cpu_is_the_share_of_busy_idle_and_steal_time_over_its_window():
    from serving import BoxCpu, wait_windows

    box = BoxCpu()  # not started: samples given (user nice system idle iowait irq softirq steal)
    box.samples = [(100.0, [0] * 8), (101.0, [50, 0, 10, 30, 0, 0, 0, 10]), (104.0, [120, 0, 20, 50, 10, 0, 0, 40]),
                   (120.0, [500] * 8)]
    assert box.during(101.0, 103.0) == {"busy": 0.583, "idle": 0.25, "steal": 0.167}  # 100 s .. 104 s
    assert box.during(110.0, 111.0) is None  # no two samples in it
    line = "(EngineCore pid=7) INFO 12-07 10:00:{:02d} [shm_broadcast.py:801] No available shared memory broadcast block found"
    log = "\n".join(line.format(s) for s in (1, 2, 3, 7, 8))
    assert [n for n, _, _ in wait_windows(log)] == [3, 2]


def test_a_py_spy_dump_is_summed_up_by_its_main_threads_innermost_frames():
    from serving import innermost

    dump = """Process 7: VLLM::EngineCore
Python v3.11.7

Thread 7 (idle): "MainThread"
    Poller.poll (zmq/sugar/poll.py:106)
    _GeneratorContextManager.__enter__ (contextlib.py:137)
    MessageQueue.dequeue (vllm/distributed/device_communicators/shm_broadcast.py:890)
    EngineCore.step (vllm/v1/engine/core.py:602)
Thread 9 (idle): "nixl_handshake_listener"
    Socket.recv_multipart (zmq/sugar/socket.py:813)
"""
    assert innermost(dump, frames=2) == "[idle] Poller.poll < MessageQueue.dequeue"
    assert innermost("Error: no such process") == "(no main thread)"
