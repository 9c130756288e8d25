"""The fault table (issue #28): what happens to a request in flight, stock vs hotfix, when a
component hangs, dies or is cut off while prefill and decode are two network hosts.

``hotfix.worlds.faults``: two prefills on one host (stock, and one with the hotfix), a stock
and a hotfix decode on the other, each decode READing from its own kind of prefill (the
hotfix on both engines), NIXL/UCX over TCP across a veth link shaped so a 480-token prompt's
READ takes seconds. Each fault hits
both decodes' requests at once, at its phase (before the READ, or mid-READ), and lasts the
window a request must be terminal in (``--bound`` + ``--slack``). One row per fault, phase and
variant: engine deaths, wrong tokens, requests not terminal in the window, blocks still held
once the fault cleared, seconds to the request's answer, and what the answer was.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/faults.py [--quick] [--fault NAME:PHASE] [--json]

``--quick``: the CI variant (``tests/test_faults_world.py``): its fault only, one stock prefill
for both decodes. Needs root and iproute2 (network namespaces).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (puts the checkout on sys.path)

from hotfix.worlds.faults import BEFORE_READ, FaultsWorld, faults, table
from hotfix.worlds.home import clean_env, hotfix_home

COLUMNS = ("fault", "phase", "variant", "engine_deaths", "wrong_tokens", "not_terminal",
           "leaked_blocks", "recover_s", "answer", "nixl_failures", "next_read_ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the CI variant's fault only")
    parser.add_argument("--json", action="store_true", help="print the table as one JSON object")
    parser.add_argument("--bound", type=float, default=15.0, help="HOTFIX_LOAD_TIMEOUT_S (s)")
    parser.add_argument("--slack", type=float, default=30.0, help="the window past the bound (s)")
    parser.add_argument("--keep", type=Path, help="run in this directory and keep the engines' logs")
    parser.add_argument("--fault", action="append", metavar="NAME:PHASE",
                        help="only this row (repeatable), e.g. partition:mid-READ")
    args = parser.parse_args()

    chosen = faults(args.bound, args.slack)  # prefill_killed last: it restarts the prefill
    if args.quick:
        chosen = {("prefill_hung", BEFORE_READ): chosen["prefill_hung", BEFORE_READ]}
    if args.fault:
        wanted = [tuple(f.split(":", 1)) for f in args.fault]
        unknown = [f for f in wanted if f not in chosen]
        if unknown:
            parser.error(f"--fault {unknown}: want one of {[':'.join(k) for k in chosen]}")
        chosen = {key: chosen[key] for key in wanted}
    rows, began = [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        root = args.keep or Path(tmp)
        home = hotfix_home(root / "hotfix-home")
        with FaultsWorld(root, clean_env(), home, args.bound, args.slack, hotfix_prefill=not args.quick) as world:
            for fault in chosen.values():
                rows.extend(world.run(fault))
                print(f"faults: {fault.name} {fault.phase} done at {time.monotonic() - began:.0f} s",
                      file=sys.stderr)
    result = {**table(rows), "bound_s": args.bound, "slack_s": args.slack,
              "wall_s": round(time.monotonic() - began)}
    if args.json:
        print(json.dumps(result))
        return
    print(" | ".join(COLUMNS))
    for row in result["rows"]:
        print(" | ".join(str(row[c]) for c in COLUMNS))


if __name__ == "__main__":
    main()
