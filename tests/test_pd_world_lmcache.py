"""The P/D world with the bug report's decode stack exactly: ``MultiConnector[NixlConnector
(kv_consumer), LMCacheMPConnector (kv_both)]``, the second child LMCache's own connector
talking to a real ``lmcache server`` (one per lmcache release, for the module).

Each decode engine serves one two-turn session, the way an agent's conversation arrives:
turn 1 (a short prompt, a long answer) goes P → D, and D's LMCache stores the first
256-token chunk of the conversation while D decodes it; D's own prefix cache then drops
turn 1 (``reset_prefix_cache()``, what a busy engine's eviction does; LMCache's far larger
pool keeps it); turn 2 is turn 1's prompt + answer + new text, so D's LMCache has a hit on
its first chunk while NIXL pulls the whole prompt from P. MultiConnector chooses NIXL (the first child that claims tokens) and gives LMCache 0.
lmcache 0.5.4 retrieves its hit anyway and reports long before NIXL's READ, which starts
``READ_DELAY_S`` late here (the GB-scale pull; a real retrieve takes real time, so the delay
is in seconds). Stock then promotes turn 2 on LMCache's report, decodes it over blocks only
NIXL was going to write, and dies on NIXL's late report. lmcache 0.5.6 does not retrieve
what it was not chosen for: the control, where the hotfix must change nothing.

When the LMCache server hangs mid-retrieve (vLLM #49089's ordering: the worker stops the
server right before it sends turn 2's RETRIEVE, ``ServerStoppingLMCacheMPConnector``), the
decode's worker waits inside LMCache's own synchronous retrieve (``prepare_retrieve``, engine-
driven transfers) for ``lmcache.mp.mq_timeout``: the whole engine stalls, stock or hotfix, and
no bound of ours can act (the EngineCore gets no step output). Past that timeout LMCache
reports the retrieve failed (its blocks invalid): ``fail`` ends turn 2 with an error while
NIXL's READ still targets its blocks. Stock frees them and NIXL's late report kills the
EngineCore; the hotfix keeps them until that report and stays alive.

Every expectation is the prefill engine's local greedy decode (prefix caching off there, so
it computes each prompt from scratch); ``test_pd_world`` shows that equals a NIXL-only pull.
Engines: P and four decodes (0.5.4 and 0.5.6, stock and hotfix), started side by side; the
hotfix reaches its decodes through ``PYTHONPATH`` only.
"""
from __future__ import annotations

import json
import math
import random
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import clean_env, install_home, require_release
from hotfix.worlds.lmcache_server import LMCacheServer
from hotfix.worlds.pd_world import (
    VOCAB_SIZE,
    Engine,
    EngineFailure,
    PDWorld,
    Request,
    SecondTurn,
    allocations,
    build_model,
    decode_bug_report_lmcache_config,
    decode_request,
    lmcache_stop_env,
    prefill_config,
    timeline,
    transfer,
    two_turn_conversation,
    warm_up,
)

RELEASES = ("0.5.4", "0.5.6")
CHUNK = 256  # the server's --chunk-size: LMCache stores and retrieves whole chunks
QUESTION_TOKENS = 40
ANSWER_TOKENS = 300  # D computes > CHUNK tokens of turn 1, so its LMCache stores chunk 0
MAX_TOKENS = 8
READ_DELAY_S = 2.0
DEATHS = ("assert req_id in self.requests", "assert RequestStatus.is_finished(req.status)")
HANGS = "-server-hangs"  # variant suffix: the decode's worker stops the server when armed
KILLED = "-server-killed"  # the decode has a server of its own, which its worker kills when armed
MQ_TIMEOUT_S = 10  # lmcache.mp.mq_timeout of those decodes (the world's default is 60 s)
# LMCache's prepare and commit of a retrieve each wait up to MQ_TIMEOUT_S (measured: turn 2
# answered 21 s after the stop); then steps of a loaded 2-core box
STALL_LIMIT_S = 3 * MQ_TIMEOUT_S + 30
# the killed server's tests: the hung server's twins prove the same (the retrieve is never answered)
KILLED_IN_CI = "test_hotfix_when_the_lmcache_server_hangs_mid_retrieve_errors_stays_alive_and_gets_every_block_back"
STOCK_KILLED_IN_CI = "test_stock_when_the_lmcache_server_hangs_or_dies_mid_retrieve_the_late_nixl_report_kills_the_decode[hangs]"


@dataclass
class Decode:
    engine: Engine
    status_dir: Path | None  # the hotfix's per-process status files; None on stock
    arm: Path | None = None  # its worker stops the LMCache server while this file exists
    server: LMCacheServer | None = None  # its own server (KILLED), else the release's shared one


@dataclass
class LMCacheWorld:
    prefill: Engine
    decodes: dict[tuple[str, str], Decode]  # (lmcache release, "stock" | "hotfix")
    servers: dict[str, LMCacheServer]


def uses(version: str, *variants: str):
    """The decode engines a test drives (release, variant); the fixture starts only those."""
    return pytest.mark.pd_engines(*((version, variant) for variant in variants))


@pytest.fixture(scope="module")
def world(request, tmp_path_factory):
    wanted = {name for item in request.session.items if item.module is request.module
              for mark in item.iter_markers("pd_engines") for name in mark.args}
    releases = {version: require_release(version) for version in sorted({v for v, _ in wanted})}
    root = tmp_path_factory.mktemp("pd-lmcache")
    home = install_home(root / "hotfix-home", fixes=())
    with ExitStack() as stack:
        servers = {version: stack.enter_context(LMCacheServer(path, root / f"lmcache-{version}.log", clean_env(),
                                                              transfer_mode="engine_driven"))
                   for version, path in releases.items()}
        # a killed variant's own server (entered before the engines, so it outlives them)
        own_servers = {(version, variant): stack.enter_context(LMCacheServer(
            releases[version], root / f"lmcache-decode-{version}-{variant}.log", clean_env(),
            transfer_mode="engine_driven")) for version, variant in sorted(wanted) if variant.endswith(KILLED)}
        pd = stack.enter_context(PDWorld(root, build_model(root / "model"), clean_env()))
        prefill = pd.start("prefill", prefill_config(), engine_args={"enable_prefix_caching": False})
        decodes = {}
        for version, variant in sorted(wanted):
            path, name = releases[version], f"decode-{version}-{variant}"
            own = own_servers.get((version, variant))
            server = own or servers[version]
            lmcache, env, arm = server.connector_config(), {}, None
            if variant.endswith((HANGS, KILLED)):
                arm = root / f"arm-{name}"
                lmcache = {**lmcache, "lmcache.mp.mq_timeout": MQ_TIMEOUT_S}
                env = lmcache_stop_env(server.process.pid, arm)
            config = decode_bug_report_lmcache_config(READ_DELAY_S, lmcache, stops_server=arm is not None)
            if variant.startswith("stock"):
                decodes[version, variant] = Decode(pd.start(name, config, extra_path=(path,), env=env), None, arm, own)
            else:
                status_dir = root / f"status-{name}"
                decodes[version, variant] = Decode(pd.start(
                    name, config, extra_path=(path,), hotfix_home=home,
                    env={**env, "HOTFIX_STATUS_DIR": str(status_dir)}), status_dir, arm, own)
        for engine in pd.engines:
            engine.wait_ready()
        for decode in decodes.values():
            warm_up(prefill, decode.engine)
        yield LMCacheWorld(prefill, decodes, servers)


def tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(length)]


def local_decode(world: LMCacheWorld, prompt: list[int], max_tokens: int) -> list[int]:
    (out,) = world.prefill.generate([Request(prompt, max_tokens)])
    return out.token_ids


def two_turn_session(world: LMCacheWorld, decode: Engine, seed: int) -> SecondTurn:
    turn = two_turn_conversation(world.prefill, decode, tokens(seed, QUESTION_TOKENS),
                                 tokens(seed + 1, QUESTION_TOKENS), ANSWER_TOKENS, MAX_TOKENS)
    assert turn.answer_ok, "turn 1 (no LMCache hit yet) decodes like a single engine"
    return turn


def counters(decode: Decode) -> dict[str, int]:
    """recv-barrier's counters, summed over the decode engine's processes."""
    total: dict[str, int] = {}
    for path in decode.status_dir.glob("*.json"):
        for kind, n in json.loads(path.read_text())["counters"].get("recv-barrier", {}).items():
            total[kind] = total.get(kind, 0) + n
    return total


def drained(engine: Engine, timeout: float = 60.0) -> bool:
    """vLLM's own reset_prefix_cache() succeeds only when no block is in use: every block back."""
    deadline = time.monotonic() + timeout
    while not engine.reset_prefix_cache():
        if time.monotonic() > deadline:
            return False
        time.sleep(2)
    return True


def server_log(world: LMCacheWorld, version: str) -> str:
    return world.servers[version].log_path.read_text(errors="replace")


def retrieves(world: LMCacheWorld, version: str) -> int:
    return server_log(world, version).count(f"Retrieved {CHUNK} tokens")


@uses("0.5.4", "stock")
def test_stock_with_lmcache_0_5_4_promotes_on_lmcaches_retrieve_decodes_wrong_tokens_then_dies(world):
    """Usually turn 2 finishes over blocks NIXL has not written (wrong tokens) and NIXL's late
    report for it kills the EngineCore at the next request. On a slow box turn 2 is still
    decoding when NIXL's READ lands, and the same report kills it then (the other assert):
    promoted on LMCache's retrieve before NIXL's report, in both orders."""
    decode = world.decodes["0.5.4", "stock"].engine
    before = retrieves(world, "0.5.4")
    try:
        turn = two_turn_session(world, decode, seed=101)
    except EngineFailure as died_in_turn_2:
        assert died_in_turn_2.kind == "EngineDeadError", died_in_turn_2
        log = decode.log()
        assert "assert RequestStatus.is_finished(req.status)" in log, decode.log_tail()
        turn_2 = allocations(log)[-1][1]  # the last request D allocated: turn 2, promoted
        promoted = sorted(step for step, owner, _ in allocations(log) if owner == turn_2)[1]
        # scheduled in a step before the one whose output carried NIXL's report: promoted on
        # LMCache's (on a loaded box the READ has started in the very step of the promotion)
        assert promoted <= timeline(log)[turn_2].get("nixl_reported", math.inf), timeline(log)[turn_2]
        assert retrieves(world, "0.5.4") == before + 1, "LMCache loaded turn 2 although NIXL was chosen"
        return
    assert "Using external LMCacheMPConnector" in decode.log()
    assert retrieves(world, "0.5.4") == before + 1, "LMCache loaded turn 2 although NIXL was chosen"
    # LMCache's report promoted it before NIXL's READ began (usually it finished before, too)
    assert turn.promoted < turn.steps.get("read_started", math.inf), turn
    assert turn.tokens != turn.expected, "decoded over blocks NIXL had not written"

    with pytest.raises(EngineFailure) as dead:
        transfer(world.prefill, decode, tokens(102, 70), MAX_TOKENS)
    assert dead.value.kind == "EngineDeadError"
    assert any(death in decode.log() for death in DEATHS), decode.log_tail()


@uses("0.5.4", "hotfix")
def test_hotfix_with_lmcache_0_5_4_computes_only_after_nixls_read_and_returns_every_block(world):
    decode = world.decodes["0.5.4", "hotfix"]
    before = retrieves(world, "0.5.4")
    turn = two_turn_session(world, decode.engine, seed=201)
    assert retrieves(world, "0.5.4") == before + 1  # the same defect, absorbed
    assert turn.tokens == turn.expected
    assert turn.promoted > turn.steps["nixl_reported"], turn  # no compute before NIXL wrote R
    assert transfer(world.prefill, decode.engine, tokens(202, 70), MAX_TOKENS) == \
        local_decode(world, tokens(202, 70), MAX_TOKENS)

    log = decode.engine.log()
    assert decode.engine.alive() and "AssertionError" not in log and "hotfix.runtime.error" not in log
    assert drained(decode.engine), "a block is still held at idle\n" + decode.engine.log_tail()


@pytest.mark.parametrize("variant", [
    pytest.param("stock", marks=[uses("0.5.6", "stock"), pytest.mark.beyond_ci_budget(
        "the [hotfix] variant: the same session, P's tokens, and the server's log shows 0.5.6 "
        "retrieved nothing (what LMCache does, whoever runs the decode)")]),
    pytest.param("hotfix", marks=uses("0.5.6", "hotfix")),
])
def test_lmcache_0_5_6_retrieves_nothing_and_the_hotfix_changes_nothing(world, variant):
    decode = world.decodes["0.5.6", variant]
    turn = two_turn_session(world, decode.engine, seed=301)  # the same session on both
    assert turn.tokens == turn.expected
    assert turn.promoted == turn.steps["nixl_reported"] + 1, turn  # promoted on NIXL's report
    log = server_log(world, "0.5.6")
    assert f"Stored {CHUNK} tokens" in log and "Retrieved" not in log
    assert decode.engine.alive() and drained(decode.engine)
    if decode.status_dir is not None:
        log = decode.engine.log()
        assert "hotfix.patch.applied" in log and "hotfix.recv." not in log and "hotfix.runtime.error" not in log
        assert counters(decode) == {}, counters(decode)


@dataclass
class TurnTwo:
    took: float  # seconds from turn 2's submission to its answer (inf: none)
    tokens: list[int]  # empty: an error or a dead engine
    expected: list[int]
    until_restart: bool = False  # a killed server: no answer came before the test restarted it
    server_log_at_restart: int = 0  # a killed server: its log's length when it was restarted


def turn_2_while_the_server_fails(world: LMCacheWorld, decode: Decode, seed: int, kill: bool = False) -> TurnTwo:
    """Turn 1, then turn 2 with the server stopped (``kill``: killed) right before turn 2's
    RETRIEVE. A stopped server is continued once turn 2 was answered (or ``STALL_LIMIT_S``
    passed). A killed one is restarted at its address once turn 2 was answered, or at
    ``STALL_LIMIT_S``: LMCache's client may block on a server that is gone (ZMQ holds a send
    while it has no peer) until one is back, and then turn 2 is waited for again."""
    question = tokens(seed, QUESTION_TOKENS)
    answer = transfer(world.prefill, decode.engine, question, ANSWER_TOKENS)
    assert decode.engine.reset_prefix_cache(), "blocks still held after turn 1"
    follow_up = question + answer + tokens(seed + 1, QUESTION_TOKENS)
    (expected,) = world.prefill.generate([Request(follow_up, MAX_TOKENS)])
    request = decode_request(world.prefill, follow_up, MAX_TOKENS, False)
    decode.arm.write_text(f"{'kill' if kill else 'stop'} the server before the next RETRIEVE")
    began = time.monotonic()
    turn = TurnTwo(math.inf, [], expected.token_ids)
    try:
        decode.engine.submit([request])
        answered = decode.engine.answered(STALL_LIMIT_S)
        turn.took = time.monotonic() - began if answered else math.inf
        done = "killed" if kill else "stopped"
        assert f"LMCache server {done} before the RETRIEVE" in decode.engine.log(), decode.engine.log_tail()
    finally:
        if not kill:
            world.servers["0.5.4"].resume()
    if kill:
        turn.server_log_at_restart = len(decode.server.log_path.read_text(errors="replace"))
        decode.server.restart()
        if not answered:
            turn.until_restart = True
            answered = decode.engine.answered(STALL_LIMIT_S)
            turn.took = time.monotonic() - began if answered else math.inf
    if turn.took == math.inf:
        return turn
    try:
        (out,) = decode.engine.completions()
        turn.tokens = out.token_ids
    except EngineFailure as died:
        assert died.kind == "EngineDeadError", died
    return turn


def _verdict(turn: TurnTwo) -> str:
    return "right" if turn.tokens == turn.expected else "no" if not turn.tokens else "wrong"


@pytest.mark.parametrize("failure", [
    pytest.param(HANGS, marks=uses("0.5.4", "stock" + HANGS), id="hangs"),
    pytest.param(KILLED, marks=[uses("0.5.4", "stock" + KILLED), pytest.mark.beyond_ci_budget(STOCK_KILLED_IN_CI)],
                 id="killed"),
])
def test_stock_when_the_lmcache_server_hangs_or_dies_mid_retrieve_the_late_nixl_report_kills_the_decode(
        world, failure):
    """A killed server (not hung: its socket closes) leaves the decode waiting as a hung one does
    (LMCache's ``mq_timeout``, or until the server is back); then the same death."""
    decode = world.decodes["0.5.4", "stock" + failure]
    turn = turn_2_while_the_server_fails(world, decode, seed=401, kill=failure == KILLED)
    print(f"stock, LMCache server {failure.rsplit('-', 1)[1]} mid-retrieve: turn 2 answered after {turn.took:.1f} s"
          f"{' (once the server was back)' if turn.until_restart else ''}, {_verdict(turn)} tokens")
    if decode.engine.alive():
        with pytest.raises(EngineFailure) as dead:
            transfer(world.prefill, decode.engine, tokens(402, 70), MAX_TOKENS)
        assert dead.value.kind == "EngineDeadError"
    assert any(death in decode.engine.log() for death in DEATHS), decode.engine.log_tail()


@uses("0.5.4", "hotfix" + HANGS)
def test_hotfix_when_the_lmcache_server_hangs_mid_retrieve_errors_stays_alive_and_gets_every_block_back(world):
    """The stall itself is LMCache's (bounded by its mq_timeout, not by HOTFIX_LOAD_TIMEOUT_S);
    what the hotfix changes is what follows: no garbage, no death, every block back."""
    decode = world.decodes["0.5.4", "hotfix" + HANGS]
    turn = turn_2_while_the_server_fails(world, decode, seed=501)
    print(f"hotfix, LMCache server stopped mid-retrieve: turn 2 answered after {turn.took:.1f} s")
    assert turn.took < STALL_LIMIT_S, decode.engine.log_tail()
    assert turn.tokens in ([], turn.expected), "decoded over blocks no transfer finished writing"
    assert decode.engine.alive(), decode.engine.log_tail()
    assert drained(decode.engine), "a block is still held at idle\n" + decode.engine.log_tail()
    assert transfer(world.prefill, decode.engine, tokens(502, 70), MAX_TOKENS) == \
        local_decode(world, tokens(502, 70), MAX_TOKENS)
    log = decode.engine.log()
    assert "AssertionError" not in log and "hotfix.runtime.error" not in log


@uses("0.5.4", "hotfix" + KILLED)
@pytest.mark.beyond_ci_budget(KILLED_IN_CI)
def test_hotfix_when_the_lmcache_server_is_killed_mid_retrieve_errors_stays_alive_and_serves_again_once_restarted(world):
    """Turn 2 fails after LMCache's ``mq_timeout``, or, where LMCache's client blocked on the
    gone server, once the server is back: the whole engine waits meanwhile, stock or hotfix, and
    no bound of ours can act (the worker is inside LMCache's synchronous call). What the hotfix
    changes is what follows (no garbage, no death, every block back); the restarted server is
    LMCache's to rejoin: its client re-registers the KV caches, and the next session stores and
    retrieves there again."""
    decode = world.decodes["0.5.4", "hotfix" + KILLED]
    turn = turn_2_while_the_server_fails(world, decode, seed=701, kill=True)
    print(f"hotfix, LMCache server killed mid-retrieve: turn 2 answered after {turn.took:.1f} s"
          f"{' (once the server was back)' if turn.until_restart else ''}, {_verdict(turn)} tokens")
    assert turn.took < math.inf, decode.engine.log_tail()
    assert turn.tokens in ([], turn.expected), "decoded over blocks no transfer finished writing"
    assert decode.engine.alive(), decode.engine.log_tail()
    assert drained(decode.engine), "a block is still held at idle\n" + decode.engine.log_tail()
    assert transfer(world.prefill, decode.engine, tokens(702, 70), MAX_TOKENS) == \
        local_decode(world, tokens(702, 70), MAX_TOKENS)
    session = two_turn_session(world, decode.engine, seed=703)
    assert session.tokens == session.expected, session
    since = decode.server.log_path.read_text(errors="replace")[turn.server_log_at_restart:]
    assert f"Stored {CHUNK} tokens" in since and f"Retrieved {CHUNK} tokens" in since, since[-2000:]
    assert decode.engine.alive() and drained(decode.engine)
    log = decode.engine.log()
    assert "AssertionError" not in log and "hotfix.runtime.error" not in log