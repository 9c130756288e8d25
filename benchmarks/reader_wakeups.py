"""Does vLLM's ring-buffer notification wake a reader in a real API server? (issue #30)

One vLLM API server (``python -m vllm.entrypoints.openai.api_server``, the serving world's
tiny model), no P/D and no NIXL agent (a no-op test connector only loads the world's connectors
module, which applies the knobs below in the EngineCore and the worker), one request at a time:
  itl_p50_ms      inter-token time of a streamed 100-token answer (the engine stepping);
  after_idle_s    time to the first token of a request sent ``--idle-s`` after the last one
                  ended (every ring-buffer reader is past its busy loop: it waits in ZMQ poll).
Configurations, each a fresh server:
  vllm            vLLM's readers as they are: they spin (``sched_yield``) for 1 s after each
                  read (``SpinCondition(busy_loop_s=1)``), then poll the writer's ZMQ
                  notification, re-reading the buffer every 5 s (``SHM_READER_RECHECK_INTERVAL_MS``)
                  (1 s for the EngineCore with ``VLLM_RINGBUFFER_WARNING_INTERVAL=1``, set here
                  as in the worlds);
  no_spin         the spin off (``PD_WORLD_READER_BUSY_LOOP_S=0``): every read waits on the
                  notification, or the recheck (``--recheck-ms``, ``PD_WORLD_WORKER_RECHECK_MS``).
If the notification woke readers, ``no_spin``'s inter-token time would stay near ``vllm``'s;
if each step is found only at the recheck, it equals the recheck.

``HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/reader_wakeups.py [--recheck-ms 100] [--json]``
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import _common  # noqa: F401  (puts the checkout on sys.path)

from hotfix.worlds.pd_world import CONNECTORS_MODULE, READER_BUSY_LOOP_VAR, WORKER_RECHECK_VAR
from hotfix.worlds.serving_world import launch, model_dir, modules_dir

NO_OP_CONNECTOR = {"kv_connector": "EagerRetrieveConnector", "kv_connector_module_path": CONNECTORS_MODULE,
                   "kv_role": "kv_both"}


def streamed(server, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of a streamed greedy answer's chunks, from the request's start."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    request = urllib.request.Request(server.url("/v1/completions"), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    began, stamps = time.monotonic(), []
    with urllib.request.urlopen(request, timeout=600) as reply:
        for line in reply:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                stamps.append(time.monotonic() - began)
    return stamps


def measure(server, requests: int, idle_s: float) -> dict:
    itl, after_idle = [], []
    for n in range(requests):
        stamps = streamed(server, [5 + n, 6, 7, 8], 100)
        itl.append(statistics.median(b - a for a, b in zip(stamps, stamps[1:])))
        time.sleep(idle_s)
        after_idle.append(streamed(server, [9 + n, 10, 11], 2)[0])
    return {"itl_p50_ms": round(1000 * statistics.median(itl), 1),
            "after_idle_s": [round(s, 3) for s in after_idle]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recheck-ms", type=int, default=100)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--idle-s", type=float, default=2.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    configs = {"vllm": {}, "no_spin": {READER_BUSY_LOOP_VAR: "0", WORKER_RECHECK_VAR: str(args.recheck_ms)}}
    result: dict = {"recheck_ms": args.recheck_ms, "idle_s": args.idle_s}
    with tempfile.TemporaryDirectory(prefix="hotfix-wakeups-") as tmp:
        root = Path(tmp)
        model, modules = model_dir(root / "model"), modules_dir(root / "modules")
        for name, env in configs.items():
            server = launch(root / name, "server", model, NO_OP_CONNECTOR, modules=modules, hotfix_home=None, env=env)
            try:
                server.wait_ready()
                streamed(server, [3, 4], 4)  # warm-up
                result[name] = measure(server, args.requests, args.idle_s)
                result[name]["knobs_applied"] = sum(1 for line in server.log().splitlines()
                                                    if "pd_world: ring buffer" in line)
            finally:
                server.stop()
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for name in configs:
            print(f"{name:8} {result[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
