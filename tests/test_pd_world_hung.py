"""A hung prefill (D8, load-bound) in the P/D world: real NIXL/UCX over loopback.

After P computed the prompt and handed its ``kv_transfer_params`` over, the whole prefill
engine is SIGSTOPped (a hung host: its sockets stay open, so D's READ neither ends nor
fails). Three decode engines (NIXL only, the hotfix on each) get a request each:
- ``unbounded`` (``HOTFIX_LOAD_BOUND=off``: today's main, and stock) waits for as long as P
  is stopped: no answer past the bound (the red, asserted);
- ``fail`` ends its request with an error within the bound (vLLM's default policy);
- ``recompute`` prefills it locally within the bound and decodes the reference's tokens.
Then P is continued: every READ ends, the bounded decodes absorb the late report (logged,
counted), get every block back (``reset_prefix_cache()``) and serve the next request right.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from conftest import clean_env, install_home, settled_status
from hotfix.worlds.pd_world import (
    VOCAB_SIZE,
    RINGBUFFER_RECHECK_S,
    PDWorld,
    Request,
    build_model,
    decode_nixl_config,
    decode_request,
    prefill_config,
    transfer,
    warm_up,
)

BOUND_S = 15.0  # HOTFIX_LOAD_TIMEOUT_S on the bounded decodes; a warm READ here takes < 1 s
# The engine notices the bound at its next step, and a step can take seconds here: vLLM's worker
# re-reads the EngineCore's ring buffer only every 5 s after a lost wake-up (py-spy: EngineCore
# and worker both waiting to read; 4-12 s steps while P was stopped, 1 in ~4 runs); recompute then
# prefills and decodes on a loaded 2-core box.
SLACK_S = 30.0
MAX_TOKENS = 8
LATE_REPORT_TIMEOUT_S = 120.0
KINDS = ("timed_out_nixl", "late_report")


def prompt(seed: int, length: int = 90) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(length)]


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd-hung")
    home = install_home(root / "hotfix-home", fixes=())
    # the EngineCore's side of a lost wake-up re-reads after 1 s instead of 5 s (the worker's
    # side stays 5 s: vLLM's SHM_READER_RECHECK_INTERVAL_MS)
    bounded = {"HOTFIX_LOAD_TIMEOUT_S": str(BOUND_S), "VLLM_RINGBUFFER_WARNING_INTERVAL": RINGBUFFER_RECHECK_S}
    with PDWorld(root, build_model(root / "model"), clean_env()) as world:
        prefill = world.start("prefill", prefill_config(), engine_args={"enable_prefix_caching": False})
        decodes = {
            "unbounded": world.start("decode-unbounded", decode_nixl_config(), hotfix_home=home,
                                     env={"HOTFIX_LOAD_BOUND": "off"}),
            "fail": world.start("decode-fail", decode_nixl_config(), hotfix_home=home,
                                env={**bounded, "HOTFIX_STATUS_DIR": str(root / "status-fail")}),
            "recompute": world.start(
                "decode-recompute", {**decode_nixl_config(), "kv_load_failure_policy": "recompute"},
                hotfix_home=home, env={**bounded, "HOTFIX_STATUS_DIR": str(root / "status-recompute")}),
        }
        for engine in world.engines:
            engine.wait_ready()
        for decode in decodes.values():
            warm_up(prefill, decode)
        for name in ("fail", "recompute"):  # a first contact slower than the bound timed out:
            wait_until_every_timed_out_load_reported(root, name)  # its READ ends, blocks back
        yield root, prefill, decodes


def wait_until_every_timed_out_load_reported(root: Path, name: str) -> None:
    counts, held = settled_status(
        lambda: load_bound_state(root, name),
        lambda now: now[0]["timed_out_nixl"] == now[0]["late_report"] and now[1] == 0,
        timeout_s=LATE_REPORT_TIMEOUT_S)
    assert counts["timed_out_nixl"] == counts["late_report"] and held == 0, (name, counts, held)


def load_bound_state(root: Path, name: str) -> tuple[dict, int]:
    """load-bound's counts of ``KINDS`` and its quarantine gauge, summed over the decode's
    status files."""
    records = [json.loads(p.read_text()) for p in (root / f"status-{name}").glob("*.json")]
    counts = {kind: sum(r["counters"].get("load-bound", {}).get(kind, 0) for r in records) for kind in KINDS}
    return counts, sum(r["gauges"].get("load-bound", {}).get("blocks_quarantined_now", 0) for r in records)


def test_a_hung_prefill_ends_each_bounded_request_within_the_bound_and_every_block_comes_back(pd):
    root, prefill, decodes = pd
    tokens = {name: prompt(seed) for seed, name in enumerate(decodes, start=71)}
    expected = {name: prefill.generate([Request(t, MAX_TOKENS)])[0].token_ids for name, t in tokens.items()}
    requests = {name: decode_request(prefill, t, MAX_TOKENS, False) for name, t in tokens.items()}

    # the counts so far: on a busy box a warm-up's first contact can take longer than the bound
    before = {name: settled_status(lambda: load_bound_state(root, name))[0] for name in ("fail", "recompute")}
    prefill.hang()
    try:
        began = time.monotonic()
        for name, decode in decodes.items():
            decode.submit([requests[name]])
        took = {}
        while len(took) < 2 and time.monotonic() - began < BOUND_S + SLACK_S:
            for name in ("fail", "recompute"):
                if name not in took and decodes[name].answered(0.2):
                    took[name] = time.monotonic() - began
        assert set(took) == {"fail", "recompute"}, (took, decodes["fail"].log_tail())
        (failed,) = decodes["fail"].completions()
        (recomputed,) = decodes["recompute"].completions()
        # the red: without the bound the request still waits for the hung prefill
        assert not decodes["unbounded"].answered(0), "the unbounded decode answered while P was stopped"
    finally:
        prefill.resume()
    print(f"load-bound: bound {BOUND_S:.0f} s; fail answered after {took['fail']:.1f} s, "
          f"recompute after {took['recompute']:.1f} s; unbounded still waiting at "
          f"{time.monotonic() - began:.1f} s")

    assert BOUND_S <= took["fail"] < BOUND_S + SLACK_S
    assert (failed.token_ids, failed.finish_reason) == ([], "error")
    assert BOUND_S <= took["recompute"] < BOUND_S + SLACK_S
    assert recomputed.token_ids == expected["recompute"]
    (waited,) = decodes["unbounded"].completions()  # P continued: the READ ended
    assert waited.token_ids == expected["unbounded"]

    for name in ("fail", "recompute"):
        decode = decodes[name]
        deadline = time.monotonic() + LATE_REPORT_TIMEOUT_S
        late_reported = before[name]["late_report"] + 1  # (its log line is rate-limited: counted)
        while load_bound_state(root, name)[0]["late_report"] < late_reported \
                or not decode.reset_prefix_cache():
            assert time.monotonic() < deadline, f"{name}: late report or blocks missing\n{decode.log_tail()}"
            time.sleep(2)
        assert "hotfix.load.late_report" in decode.log()
        assert decode.alive() and "AssertionError" not in decode.log()
        after = prompt(90 + len(name))
        assert transfer(prefill, decode, after, MAX_TOKENS) == \
            prefill.generate([Request(after, MAX_TOKENS)])[0].token_ids
        want = {kind: before[name][kind] + 1 for kind in KINDS}, 0  # one timeout, one late report
        found = settled_status(lambda: load_bound_state(root, name), lambda now: now == want)
        assert found == want, (name, before[name], found)
