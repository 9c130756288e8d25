"""D9 in the P/D world (issue #27): a tiny hybrid model served by a prefill and decode engines
over vLLM's real NixlConnector, the hybrid KV cache manager on (vLLM 0.27's NixlConnector
supports it, and so does the CPU platform).

The model's first layer has a sliding window, its second full attention (``build_model``), so
each engine's KV cache has two groups, and NIXL's worker sets ``_is_hma_required``. The
prefill hands its params over and is SIGKILLed before the decodes READ: every READ fails.
Stock 0.27-0.29 reports no invalid block for a failed READ on such a cache ("TODO handle
failed transfer for HMA") and takes the request as loaded: it decodes over blocks nobody
wrote and answers wrong tokens without an error, and those blocks enter its prefix cache (the
red, asserted). With the hotfix (hybrid-fail): the blocks of both groups are reported invalid,
``recompute`` answers P's tokens, ``fail`` an error, the engines live and every block is back.
vLLM 0.30+ reports such a READ as failed itself (``tests/test_hybrid_fail_world.py`` shows
it); this world runs where the fix applies.
"""
from __future__ import annotations

import json
import os
import random
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import clean_env, install_home, settled_status
from hotfix import registry
from hotfix.fixes import hybrid_fail
from hotfix.worlds.pd_world import (
    VOCAB_SIZE,
    Completion,
    Engine,
    PDWorld,
    Request,
    build_model,
    decode_nixl_config,
    decode_request,
    prefill_config,
    transfer,
    warm_up,
)

if registry.decide(hybrid_fail.SPEC, mode="on").reason != "known_shape":
    # not a missing test: on 0.30+ stock already fails such a READ through failed_recving, which
    # tests/test_hybrid_fail_world.py::test_from_030_stock_* assert on every 0.30+ leg
    pytest.skip("vLLM 0.30+ reports a failed hybrid READ as failed itself (hybrid-fail is "
                "fixed_upstream; tests/test_hybrid_fail_world.py shows it)", allow_module_level=True)

SLIDING_WINDOW = 64  # tokens the first layer sees: fewer than a prompt
PROMPT_LEN = 200
MAX_TOKENS = 8
HYBRID = {"disable_hybrid_kv_cache_manager": False}  # the P/D world's engines turn it off


@dataclass
class HybridWorld:
    root: Path
    prefill: Engine
    decodes: dict  # "stock" and "hotfix" (recompute), "hotfix_fail" (fail)
    status: Path  # the hotfix decodes' status files


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd-hybrid")
    home = install_home(root / "hotfix-home", fixes=())
    status = root / "status"
    recompute = {**decode_nixl_config(), "kv_load_failure_policy": "recompute"}
    hotfix_env = {"HOTFIX_STATUS_DIR": str(status)}
    with PDWorld(root, build_model(root / "model", sliding_window=SLIDING_WINDOW), clean_env()) as pd:
        prefill = pd.start("prefill", prefill_config(), engine_args={**HYBRID, "enable_prefix_caching": False})
        decodes = {
            "stock": pd.start("decode-stock", recompute, engine_args=HYBRID),
            "hotfix": pd.start("decode-hotfix", recompute, engine_args=HYBRID, hotfix_home=home, env=hotfix_env),
            "hotfix_fail": pd.start("decode-hotfix-fail", decode_nixl_config(), engine_args=HYBRID,
                                    hotfix_home=home, env=hotfix_env),
        }
        for engine in pd.engines:
            engine.wait_ready()
        for decode in decodes.values():
            warm_up(prefill, decode)
        yield HybridWorld(root, prefill, decodes, status)


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(PROMPT_LEN)]


def reference(world: HybridWorld, tokens: list[int]) -> list[int]:
    (out,) = world.prefill.generate([Request(tokens, MAX_TOKENS)])
    return out.token_ids


def hybrid_failed_loads(world: HybridWorld) -> int:
    return sum(json.loads(p.read_text())["counters"].get(hybrid_fail.FIX, {}).get("hybrid_failed_load", 0)
               for p in world.status.glob("*.json"))


@dataclass
class FailedRead:
    tokens: list[int]  # the prompt
    expected: list[int]  # P's own greedy decode of it
    completion: Completion
    log: str  # the decode's log from the request on


@pytest.fixture(scope="module")
def failed_reads(world) -> dict[str, FailedRead]:
    """Each decode's request whose prefill was SIGKILLed after it handed the params over and
    before the READ; P is then started again (fresh ports, a new engine id)."""
    tokens = {name: prompt(100 + n) for n, name in enumerate(world.decodes)}
    expected = {name: reference(world, t) for name, t in tokens.items()}
    requests = {name: decode_request(world.prefill, t, MAX_TOKENS, False) for name, t in tokens.items()}
    logged = {name: len(decode.log()) for name, decode in world.decodes.items()}
    os.killpg(world.prefill.process.pid, signal.SIGKILL)
    for name, decode in world.decodes.items():
        decode.submit([requests[name]])
    out = {}
    for name, decode in world.decodes.items():
        (completion,) = decode.completions()
        out[name] = FailedRead(tokens[name], expected[name], completion, decode.log()[logged[name]:])
    world.prefill.relaunch()
    world.prefill.wait_ready()
    return out


def test_a_healthy_read_of_a_hybrid_kv_cache_decodes_like_the_prefill(world):
    tokens = prompt(1)
    expected = reference(world, tokens)
    for name, decode in world.decodes.items():
        assert transfer(world.prefill, decode, tokens, MAX_TOKENS) == expected, name
    assert "Turning off hybrid kv cache manager" not in world.decodes["stock"].log()


def test_stock_takes_a_failed_hybrid_read_as_loaded_answers_wrong_tokens_and_caches_them(world, failed_reads):
    read = failed_reads["stock"]
    assert read.completion.finish_reason != "error" and read.completion.token_ids, read.completion
    assert read.completion.token_ids != read.expected  # decoded over blocks nobody wrote
    assert "KV load failure" not in read.log  # nothing failed, as far as vLLM knows
    decode = world.decodes["stock"]
    assert decode.alive()
    # the unwritten blocks are in its prefix cache: the same prompt, computed locally, hits them
    (again,) = decode.generate([Request(read.tokens, MAX_TOKENS)])
    assert again.token_ids != read.expected


def test_hotfix_recomputes_a_failed_hybrid_read_and_caches_only_what_it_computed(world, failed_reads):
    read = failed_reads["hotfix"]
    assert read.completion.token_ids == read.expected, read.log[-3000:]
    assert "hotfix.hybrid.failed_load" in read.log and "action='recompute'" in read.log
    decode = world.decodes["hotfix"]
    (again,) = decode.generate([Request(read.tokens, MAX_TOKENS)])
    assert again.token_ids == read.expected
    assert settled_status(lambda: hybrid_failed_loads(world), lambda n: n >= 2) >= 2  # and the fail decode's


def test_hotfix_with_the_fail_policy_ends_a_failed_hybrid_read_with_an_error(world, failed_reads):
    read = failed_reads["hotfix_fail"]
    assert read.completion.token_ids == [] or read.completion.finish_reason == "error", read.completion
    assert "hotfix.hybrid.failed_load" in read.log and "action='fail'" in read.log


def test_after_the_failed_reads_the_hotfix_decodes_hold_no_block_and_read_the_next_request_right(world, failed_reads):
    tokens = prompt(2)
    expected = reference(world, tokens)
    for name in ("hotfix", "hotfix_fail"):
        decode = world.decodes[name]
        assert decode.alive() and decode.reset_prefix_cache(), name
        assert transfer(world.prefill, decode, tokens, MAX_TOKENS) == expected, name
