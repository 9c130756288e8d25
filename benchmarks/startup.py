"""Start-up cost of the PYTHONPATH shim, measured side by side with stock in one run.

    python benchmarks/startup.py [--runs 41] [--vllm-runs 5]

Prints the median wall time of ``python -c pass`` and ``python -c "import vllm"`` without
and with our directory on PYTHONPATH (runs interleaved, so drift hits both), the added
milliseconds and the ratio. Goal: under 3 ms added for a process that never imports vLLM.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(with_hotfix: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOTFIX_") and k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # measure with .pyc files, as an image has them
    env["HOTFIX_STATUS_DIR"] = os.path.join(REPO, ".ci-out", "bench-status")
    if with_hotfix:
        env["PYTHONPATH"] = REPO
    return env


def _once(code: str, env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd="/",
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def compare(code: str, runs: int) -> tuple:
    stock, patched = [], []
    for _ in range(runs):
        stock.append(_once(code, _env(False)))
        patched.append(_once(code, _env(True)))
    return statistics.median(stock), statistics.median(patched)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=41)
    parser.add_argument("--vllm-runs", type=int, default=5)
    args = parser.parse_args()
    rows = [("python -c pass", "pass", args.runs),
            ("python -c 'import vllm'", "import vllm", args.vllm_runs)]
    print(f"{'command':28} {'stock ms':>10} {'hotfix ms':>10} {'added ms':>9} {'ratio':>7}  runs")
    for label, code, runs in rows:
        _once(code, _env(False))  # warm the page cache and .pyc files for both sides
        _once(code, _env(True))
        stock, patched = compare(code, runs)
        print(f"{label:28} {stock * 1e3:10.1f} {patched * 1e3:10.1f} {(patched - stock) * 1e3:9.1f}"
              f" {patched / stock:7.3f}  {runs}")


if __name__ == "__main__":
    main()
