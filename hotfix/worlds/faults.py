"""The faults world: the P/D world on two network hosts (``two_hosts``), a prefill on one and a
stock and a hotfix decode side by side on the other, and one fault at a time injected while
both decodes' READs cross the link. With ``hotfix_prefill`` the prefill host runs two prefills,
a stock one for the stock decode and one with the hotfix for the hotfix decode (the hotfix on
both engines, as a fleet rolls it out); a fault then strikes both. Each run yields one row per decode, the fault table's
(``benchmarks/faults.py``; the CI's bounded variant is ``tests/test_faults_world.py``).

A row says what the fault did to the request in flight and to the decode engine:
- ``engine_deaths``: the decode engine is gone;
- ``wrong_tokens``: the request answered with tokens other than P's local greedy decode and no
  error (garbage, the worst outcome);
- ``not_terminal``: the request had no answer ``bound_s`` + ``slack_s`` after the fault began
  (a hung request: its client waits);
- ``leaked_blocks``: once the fault cleared and the engine settled, blocks it still holds
  (``reset_prefix_cache()`` refused; the count is load-bound's quarantine gauge where it has
  one, else 1: held, count unknown);
- ``recover_s``: seconds from the fault's start until the request's answer (an error counts:
  it is terminal), ``None`` without one.
"""
from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hotfix.status import FLUSH_INTERVAL_S
from hotfix.worlds.pd_world import (
    RINGBUFFER_RECHECK_S,
    VOCAB_SIZE,
    WORKER_RECHECK_VAR,
    Completion,
    Engine,
    EngineFailure,
    PDWorld,
    MAX_MODEL_LEN,
    Request,
    build_model,
    decode_nixl_config,
    decode_request,
    kv_pool_bytes,
    prefill_config,
    remove_unmapped_psm,
    transfer,
    warm_up,
)
from hotfix.worlds.two_hosts import TwoHosts

PROMPT_TOKENS = 480  # 15 blocks, 480 KiB of the tiny model's KV
# The link's rate: the prompt's READ takes ~4 s, a long prompt's over the bug report's 400 MB/s
# in miniature (the tiny model's KV is 1 KiB a token).
LINK_RATE = "1mbit"
INJECT_AFTER_S = 1.5  # after the decodes got their requests: their READs are under way
MAX_TOKENS = 8
RECOMPUTED = "Recovered from KV load failure"  # vLLM's scheduler, when it reschedules a failed load
SETTLE_TIMEOUT_S = 120.0


@dataclass
class Row:
    fault: str
    phase: str
    variant: str
    engine_deaths: int
    wrong_tokens: int
    not_terminal: int
    leaked_blocks: int
    recover_s: float | None
    # "tokens" (READ), "recomputed" (a failed load, then kv_load_failure_policy=recompute),
    # "error" (finish_reason), "none" (no answer at all), or the driver's failure
    answer: str
    nixl_failures: list  # NIXL's own failure reports on the decode during the run, by type
    next_read_ok: bool  # once it cleared, a fresh request READ from the prefill and answered right
    prefill_clock_offset_s: int = 0  # the prefill host's monotonic clock minus the decode host's
    lease_confirm: bool = True  # the hotfix decode asked P whether it still held the blocks (stock: False)
    # the hotfix decode's lease-guard counts during the run, its next READ's included (``{}``
    # for stock): how it judged the lease (refused by the deadline, unconfirmed by P...)
    lease_guard: dict = field(default_factory=dict)


BEFORE_READ = "before-READ"  # after P's prefill handed its params over, before D has the request
MID_READ = "mid-READ"  # INJECT_AFTER_S after D got the request: its READ is crossing the link
# D READ the request and answered, and died before the router heard: the router retries the
# request (the same kv_transfer_params) on a new decode, after P reused the blocks
AFTER_READ = "after-READ"
PREFILL_POOL_REQUESTS = 4  # with two prefills: P's KV pool holds this many max-length requests
LEASE_PAST_S = 3  # P frees an expired lease at its next step; it steps at least every second here


@dataclass
class Fault:
    """What is done at ``phase``, and how it clears ``clear_after_s`` after that."""

    name: str
    phase: str
    inject: object  # (FaultsWorld) -> token for clear
    clear: object  # (FaultsWorld, token) -> None
    clear_after_s: float


def _cut(world: "FaultsWorld"):
    return world.net.cut()


def _restore(world: "FaultsWorld", rate) -> None:
    world.net.restore(rate)


def _hang_prefill(world: "FaultsWorld"):
    for prefill in world.prefill_engines():
        prefill.hang()


def _resume_prefill(world: "FaultsWorld", _token) -> None:
    for prefill in world.prefill_engines():
        prefill.resume()


def _kill_prefill(world: "FaultsWorld"):
    for prefill in world.prefill_engines():
        os.killpg(prefill.process.pid, signal.SIGKILL)


def _restart_prefill(world: "FaultsWorld", _token) -> None:
    world.restart_prefill()


def _kill_decodes_and_reuse_the_blocks(world: "FaultsWorld"):
    """Each decode SIGKILLed after it READ its request (P got its completion notification and
    freed the blocks); a new decode in its place; then each prefill prefills enough max-length
    prompts to fill its pool, so the freed blocks hold other KV when the retry READs them."""
    for decode in world.decodes.values():
        os.killpg(decode.process.pid, signal.SIGKILL)
    world.restart_decodes()
    _fill_the_prefill_pools(world)


def _fill_the_prefill_pools(world: "FaultsWorld") -> None:
    """Each prefill prefills enough max-length prompts to fill its pool: every block it freed
    now holds other KV."""
    for prefill in world.prefill_engines():
        prefill.generate([Request(world.next_prompt(MAX_MODEL_LEN - 12), 1) for _ in range(PREFILL_POOL_REQUESTS)])


def _deliver_after_the_lease(world: "FaultsWorld"):
    """The router holds the request (a queue, a retry) until P's lease ran out; P frees the
    blocks at its next step and reuses them; then the decode gets the request."""
    time.sleep(world.lease_s + LEASE_PAST_S)
    _fill_the_prefill_pools(world)


def _restore_after_the_prefill_reused_the_blocks(world: "FaultsWorld", rate) -> None:
    """The partition outlived P's lease (``clear_after_s``): P freed and reused the blocks
    while cut off; then the link comes back and a READ still in flight completes."""
    _fill_the_prefill_pools(world)
    world.net.restore(rate)


def _replace_prefill_at_its_address(world: "FaultsWorld"):
    """P killed and a new one started on the same NIXL side-channel address, no handshake
    made with it yet: the decodes still hold the dead P's agent, and the requests P handed
    over name the dead P's engine id."""
    _kill_prefill(world)
    world.restart_prefill(same_address=True, handshake=False)


def _nothing(world: "FaultsWorld", _token) -> None:
    pass


def faults(bound_s: float, slack_s: float) -> dict[tuple[str, str], Fault]:
    """The table's faults by (name, phase). Each lasts the whole window in which a request
    must be terminal (``bound_s`` + ``slack_s``), so an answer in it came despite the fault;
    the hotfix's late report comes after it cleared."""
    clear = bound_s + slack_s
    table = {}
    for phase in (BEFORE_READ, MID_READ):
        table["partition", phase] = Fault("partition", phase, _cut, _restore, clear)
        table["prefill_hung", phase] = Fault("prefill_hung", phase, _hang_prefill, _resume_prefill, clear)
    table["prefill_killed", MID_READ] = Fault("prefill_killed", MID_READ, _kill_prefill, _restart_prefill, clear)
    table["prefill_replaced_same_address", BEFORE_READ] = Fault(
        "prefill_replaced_same_address", BEFORE_READ, _replace_prefill_at_its_address, _nothing, 0.0)
    table["decode_killed_retried", AFTER_READ] = Fault(
        "decode_killed_retried", AFTER_READ, _kill_decodes_and_reuse_the_blocks, _nothing, 0.0)
    return table


def lease_faults(lease_s: float) -> dict[tuple[str, str], Fault]:
    """The faults of a world whose prefills lease blocks for ``lease_s`` (``FaultsWorld(lease_s=)``,
    with ``hotfix_prefill``: small pools that the reuse fills)."""
    return {
        ("router_late", BEFORE_READ): Fault("router_late", BEFORE_READ, _deliver_after_the_lease, _nothing, 0.0),
        ("partition_past_lease", BEFORE_READ): Fault(
            "partition_past_lease", BEFORE_READ, _cut, _restore_after_the_prefill_reused_the_blocks,
            lease_s + LEASE_PAST_S),
    }


def prompt(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(length)]


class FaultsWorld:
    """The two hosts, the prefill(s) and the two decodes (``stock``: no hotfix; ``hotfix``: every
    fix, ``HOTFIX_LOAD_TIMEOUT_S=bound_s``), both with ``kv_load_failure_policy=recompute`` so
    a request that survives a fault answers P's tokens. Warmed up (handshakes made) before the
    link is shaped. ``prefills`` maps each decode to the prefill it READs from.

    ``lease_s``: the prefills' ``kv_lease_duration`` (default the P/D world's 120 s, longer than
    any fault here). ``prefill_clock_offset_s``: the prefill host's monotonic clock that far
    ahead of the decode host's (another boot time; negative: behind). ``confirm=False``: the
    hotfix decode does not ask P (``HOTFIX_LEASE_CONFIRM_TIMEOUT_S=0``) and judges leases by
    their deadline on P's clock, the path a clock offset could fool."""

    def __init__(self, root: Path, base_env: dict, hotfix_home: Path, bound_s: float,
                 slack_s: float, hotfix_prefill: bool = False, lease_s: int | None = None,
                 prefill_clock_offset_s: int = 0, confirm: bool = True) -> None:
        self.root, self.bound_s, self.slack_s = root, bound_s, slack_s
        self.lease_s, self.confirm = lease_s, confirm
        self.prefill_clock_offset_s = prefill_clock_offset_s
        self.net = TwoHosts(prefill_clock_offset_s)
        # every engine re-reads vLLM's ring buffer after a lost wake-up within 1 s (pd_world)
        recheck = {"VLLM_RINGBUFFER_WARNING_INTERVAL": RINGBUFFER_RECHECK_S,
                   WORKER_RECHECK_VAR: str(int(float(RINGBUFFER_RECHECK_S) * 1000))}
        self.world = PDWorld(root, build_model(root / "model"), {**base_env, **recheck})
        self.status_dir = root / "status-hotfix"
        self._seed = 1000
        self.prefills = self.decodes = None
        self._relaunch = {}  # engine name -> its relaunch (wait_ready may drop the engine's own)
        self._start(hotfix_home, hotfix_prefill)

    def _start(self, home: Path, hotfix_prefill: bool) -> None:
        self.net.__enter__()
        try:
            recompute = {**decode_nixl_config(), "kv_load_failure_policy": "recompute"}
            leased = prefill_config()
            if self.lease_s is not None:
                leased["kv_connector_extra_config"] = {"kv_lease_duration": self.lease_s}
            if hotfix_prefill:  # a small pool: the after-READ fault's prompts reuse freed blocks
                pool = {"enable_prefix_caching": False, "kv_cache_memory_bytes": kv_pool_bytes(PREFILL_POOL_REQUESTS)}
                self.prefills = {
                    "stock": self.world.start("prefill-stock", leased, host=self.net.prefill, engine_args=pool),
                    "hotfix": self.world.start("prefill-hotfix", leased, host=self.net.prefill,
                                               engine_args=pool, hotfix_home=home),
                }
            else:
                prefill = self.world.start("prefill", leased, host=self.net.prefill,
                                           engine_args={"enable_prefix_caching": False})
                self.prefills = {"stock": prefill, "hotfix": prefill}
            self.decodes = {
                "stock": self.world.start("decode-stock", recompute, host=self.net.decode),
                "hotfix": self.world.start(
                    "decode-hotfix", recompute, host=self.net.decode, hotfix_home=home,
                    env={"HOTFIX_LOAD_TIMEOUT_S": str(self.bound_s), "HOTFIX_STATUS_DIR": str(self.status_dir),
                         **({} if self.confirm else {"HOTFIX_LEASE_CONFIRM_TIMEOUT_S": "0"})}),
            }
            self._relaunch = {engine.name: engine.relaunch for engine in self.world.engines}
            for engine in self.world.engines:
                engine.wait_ready()
            for name, decode in self.decodes.items():
                warm_up(self.prefills[name], decode)
            self.net.shape(LINK_RATE)
        except BaseException:
            self.close()
            raise

    def prefill_engines(self) -> list[Engine]:
        return list({id(p): p for p in self.prefills.values()}.values())

    def restart_prefill(self, same_address: bool = False, handshake: bool = True) -> None:
        """New prefills on the same host, on fresh ports (or their NIXL side channels on the
        old ones', ``same_address``), with their handshakes with the decodes made over the
        unshaped link (or left to the next request, ``handshake=False``)."""
        self._restart(self.prefill_engines(), same_address, handshake)

    def restart_decodes(self) -> None:
        """New decodes in place of the (killed) ones, handshaken with their prefills."""
        self._restart(list(self.decodes.values()), False, True)

    def _restart(self, engines: list[Engine], same_address: bool, handshake: bool) -> None:
        rate = self.net.rate
        self.net.shape(None)
        for engine in engines:
            self._relaunch[engine.name](same_address=same_address)
        for engine in engines:
            engine.wait_ready()
        remove_unmapped_psm()  # a killed tree's /dev/shm/psm_* (nothing is starting now)
        for name, decode in self.decodes.items() if handshake else ():
            warm_up(self.prefills[name], decode)
        self.net.shape(rate)

    def close(self) -> None:
        self.world.close()
        self.net.close()

    def __enter__(self) -> "FaultsWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def next_prompt(self, length: int = PROMPT_TOKENS) -> list[int]:
        self._seed += 1
        return prompt(self._seed, length)

    def run(self, fault: Fault) -> list[Row]:
        """Both decodes get a request, the fault strikes at its phase and clears; one row each."""
        leases_before = self._settled(self.lease_counts)  # a warm-up's READ counted too
        prompts = {name: self.next_prompt() for name in self.decodes}
        expected = {name: self.prefills[name].generate([Request(t, MAX_TOKENS)])[0].token_ids
                    for name, t in prompts.items()}
        requests = {name: decode_request(self.prefills[name], t, MAX_TOKENS, False) for name, t in prompts.items()}
        if fault.phase == AFTER_READ:  # each decode READs and answers; the router never hears
            for name, decode in self.decodes.items():
                decode.generate([requests[name]])
        logged = {name: len(decode.log()) for name, decode in self.decodes.items()}
        if fault.phase in (BEFORE_READ, AFTER_READ):  # (the clock starts once it is in place)
            token = fault.inject(self)
            if fault.phase == AFTER_READ:  # the new decodes' logs
                logged = {name: len(decode.log()) for name, decode in self.decodes.items()}
            began = time.monotonic()
        for name, decode in self.decodes.items():
            decode.submit([requests[name]])
        if fault.phase == MID_READ:
            time.sleep(INJECT_AFTER_S)
            began, token = time.monotonic(), fault.inject(self)
        answered = self._answers_until(began, fault, token)
        rows = []
        for name, decode in self.decodes.items():
            got = answered.get(name)
            completion = got[1] if got else self._late_completion(decode)
            ok = isinstance(completion, Completion) and completion.finish_reason != "error"
            wrong = int(ok and completion.token_ids != expected[name])
            rows.append(Row(fault.name, fault.phase, name, 0, wrong, int(got is None), 0,
                            round(got[0], 1) if got else None, _answer(completion), [], False,
                            self.prefill_clock_offset_s, self.confirm and name == "hotfix"))
        for row, (name, decode) in zip(rows, self.decodes.items()):
            row.engine_deaths = int(not decode.alive())
            row.leaked_blocks = 0 if row.engine_deaths else self._held_blocks(decode)
            row.nixl_failures = decode.nixl_failures(logged[name])
            if row.answer == "tokens" and RECOMPUTED in decode.log()[logged[name]:]:
                row.answer = "recomputed"
        for row, name in zip(rows, self.decodes):
            row.next_read_ok = not row.engine_deaths and self.reads_right(name)
        leases = self._settled(self.lease_counts)
        rows[list(self.decodes).index("hotfix")].lease_guard = {
            k: n - leases_before.get(k, 0) for k, n in leases.items() if n != leases_before.get(k, 0)}
        if not all(row.next_read_ok for row in rows):
            self.restart_prefill()  # the next fault starts from fresh NIXL endpoints
        return rows

    def _answers_until(self, began: float, fault: Fault, token) -> dict:
        """Each decode's (seconds after ``began``, completion), as they come, until both
        answered and the fault cleared (or the window for a terminal answer passed)."""
        answered, cleared = {}, False
        window = self.bound_s + self.slack_s
        while True:
            elapsed = time.monotonic() - began
            if not cleared and elapsed >= fault.clear_after_s:
                fault.clear(self, token)
                cleared = True
            if cleared and (len(answered) == len(self.decodes) or elapsed >= window):
                return answered
            for name, decode in self.decodes.items():
                if name not in answered and decode.alive() and decode.answered(0.1):
                    answered[name] = (time.monotonic() - began, self._completion(decode))

    @staticmethod
    def _completion(decode: Engine):
        try:
            (completion,) = decode.completions(timeout=5)
            return completion
        except EngineFailure as exc:
            return f"{exc.kind}: {exc.message}"[:200]

    def _late_completion(self, decode: Engine):
        """The answer of a request that was not terminal in time, once the fault cleared (so
        the next run starts clean), or None if it never comes."""
        if not decode.alive():
            return None
        try:
            (completion,) = decode.completions(timeout=SETTLE_TIMEOUT_S)
            return completion
        except EngineFailure as exc:
            return f"{exc.kind}: {exc.message}"[:200]

    def _held_blocks(self, decode: Engine) -> int:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            if decode.reset_prefix_cache():
                return 0
            time.sleep(2)
        return max(1, self._quarantined()) if decode is self.decodes["hotfix"] else 1

    def _quarantined(self) -> int:
        return sum(r["gauges"].get("load-bound", {}).get("blocks_quarantined_now", 0) for r in self._records())

    def load_bound_counts(self) -> dict:
        """The hotfix decode's load-bound counters (timed-out loads, late reports)."""
        kinds = ("timed_out_nixl", "late_report")
        return {k: sum(r["counters"].get("load-bound", {}).get(k, 0) for r in self._records()) for k in kinds}

    def lease_counts(self) -> dict:
        """The hotfix decode's lease-guard counters (refused, declined, confirmed READs...)."""
        counts: dict = {}
        for record in self._records():
            for kind, n in record["counters"].get("lease-guard", {}).items():
                counts[kind] = counts.get(kind, 0) + n
        return counts

    @staticmethod
    def _settled(read, timeout_s: float = 20.0) -> dict:
        """``read()`` once two reads a flush interval and a half apart agree (or at the deadline):
        a count is written by a timer up to a flush interval after it changed, later on a busy box."""
        deadline, last = time.monotonic() + timeout_s, read()
        while True:
            time.sleep(FLUSH_INTERVAL_S * 1.5)
            now = read()
            if now == last or time.monotonic() > deadline:
                return now
            last = now

    def _records(self) -> list[dict]:
        records = []
        for path in self.status_dir.glob("*.json"):
            try:  # a process's record may be pruned between the listing and the read
                records.append(json.loads(path.read_text()))
            except (FileNotFoundError, json.JSONDecodeError):
                continue
        return records

    def reads_right(self, name: str) -> bool:
        """A fresh request READs its KV from the prefill across the link (no NIXL failure, no
        recompute) and answers P's tokens."""
        decode, prefill = self.decodes[name], self.prefills[name]
        tokens, logged = self.next_prompt(), len(decode.log())
        expected = prefill.generate([Request(tokens, MAX_TOKENS)])[0].token_ids
        got = transfer(prefill, decode, tokens, MAX_TOKENS)
        log = decode.log()[logged:]
        return got == expected and not decode.nixl_failures(logged) and RECOMPUTED not in log


def _answer(completion) -> str:
    if completion is None:
        return "none"
    if isinstance(completion, Completion):
        return "error" if completion.finish_reason == "error" else "tokens"
    return completion


def table(rows: list[Row]) -> dict:
    return {"rows": [asdict(r) for r in rows]}
