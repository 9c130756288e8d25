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

Then the lease's faults, in worlds whose prefills lease blocks for ``--lease`` seconds: the
router delivering a request after P's lease ran out (P reused the blocks), and a partition
restored only after the lease; and the late delivery again with the prefill host's monotonic
clock offset by each ``--skew`` (seconds; a time namespace: another boot time), the hotfix
decode judging the lease by its deadline on P's clock (no confirmation asked), the path an
offset could fool (``--skew=-60,60``: the ``=`` form, or argparse reads a leading minus as an
option). Each of those worlds starts anew (~2.5 min with its rows).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (puts the checkout on sys.path)

from hotfix.worlds.faults import BEFORE_READ, FaultsWorld, faults, lease_faults, table
from hotfix.worlds.home import clean_env, hotfix_home

COLUMNS = ("fault", "phase", "variant", "engine_deaths", "wrong_tokens", "not_terminal",
           "leaked_blocks", "recover_s", "answer", "nixl_failures", "next_read_ok", "prefill_clock_offset_s",
           "lease_confirm", "lease_guard")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the CI variant's fault only")
    parser.add_argument("--json", action="store_true", help="print the table as one JSON object")
    parser.add_argument("--bound", type=float, default=15.0, help="HOTFIX_LOAD_TIMEOUT_S (s)")
    parser.add_argument("--slack", type=float, default=30.0, help="the window past the bound (s)")
    parser.add_argument("--keep", type=Path, help="run in this directory and keep the engines' logs")
    parser.add_argument("--fault", action="append", metavar="NAME:PHASE",
                        help="only this row (repeatable), e.g. partition:mid-READ")
    parser.add_argument("--lease", type=int, default=20, help="the lease worlds' kv_lease_duration (s)")
    parser.add_argument("--skew", default="10,-10,60,-60",
                        help="prefill clock offsets (s, comma-separated; '' for none) of the late delivery")
    args = parser.parse_args()

    first = faults(args.bound, args.slack)  # prefill_killed last: it restarts the prefill
    leased = lease_faults(args.lease)
    # (world's keyword arguments, its faults)
    plans = [({"hotfix_prefill": not args.quick}, first)]
    if args.quick:
        plans = [({}, {("prefill_hung", BEFORE_READ): first["prefill_hung", BEFORE_READ]})]
    else:
        plans.append(({"hotfix_prefill": True, "lease_s": args.lease}, leased))
        for offset in (int(o) for o in args.skew.split(",") if o.strip()):
            plans.append(({"hotfix_prefill": True, "lease_s": args.lease, "prefill_clock_offset_s": offset,
                           "confirm": False}, {("router_late", BEFORE_READ): leased["router_late", BEFORE_READ]}))
    if args.fault:
        wanted = [tuple(f.split(":", 1)) for f in args.fault]
        known = {key for _, chosen in plans for key in chosen}
        unknown = [f for f in wanted if f not in known]
        if unknown:
            parser.error(f"--fault {unknown}: want one of {[':'.join(k) for k in sorted(known)]}")
        plans = [(kw, {k: f for k, f in chosen.items() if k in wanted}) for kw, chosen in plans]
        plans = [(kw, chosen) for kw, chosen in plans if chosen]
    rows, began = [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        for n, (kwargs, chosen) in enumerate(plans):
            root = (args.keep or Path(tmp)) / f"world-{n}"
            root.mkdir(parents=True, exist_ok=True)
            home = hotfix_home(root / "hotfix-home")
            with FaultsWorld(root, clean_env(), home, args.bound, args.slack, **kwargs) as world:
                for fault in chosen.values():
                    rows.extend(world.run(fault))
                    print(f"faults: {fault.name} {fault.phase} {kwargs} done at {time.monotonic() - began:.0f} s",
                          file=sys.stderr)
    result = {**table(rows), "bound_s": args.bound, "slack_s": args.slack, "lease_s": args.lease,
              "wall_s": round(time.monotonic() - began)}
    if args.json:
        print(json.dumps(result))
        return
    print(" | ".join(COLUMNS))
    for row in result["rows"]:
        print(" | ".join(str(row[c]) for c in COLUMNS))


if __name__ == "__main__":
    main()
