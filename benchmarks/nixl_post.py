"""Two bare NIXL agents on two network hosts (``two_hosts``), no vLLM: one READ shaped like
vLLM's at each ``--rate`` of the link (issue #30's stall, issue #28's dead agent).

vLLM's decode worker posts every READ from inside its engine step (``start_load_kv`` ->
``_read_blocks`` -> ``nixl_wrapper.transfer``), so whatever the post blocks, the whole engine
waits for. Each timed READ (480 KiB in 60 descriptors by default: one per block and layer,
prepped lists, ``make_prepped_xfer``, vLLM's ``num_threads=4`` and telemetry) reports the
seconds inside ``transfer()``, the seconds until it ended and how, the longest
``check_xfer_state``, and the post of a second READ made while the first runs. A warm-up
READ over the unshaped link connects the endpoints first. A rate of ``8bit`` cuts the link
(``two_hosts``); the READs after it show whether the agent recovers once the link is back,
and ``--rehandshake`` drops the remote agent after a failed READ and loads its metadata again
(a new endpoint), as a fresh handshake would.

    .venv/bin/python benchmarks/nixl_post.py [--kib 480] [--descs 60] [--rate 1mbit ...]
        [--rehandshake] [--limit 60] [--spin] [--threads 4] [--json]

``--spin``: NIXL's own progress-thread setting (``pthrDelay`` 0, a core per agent); without
it, the 1 ms poll every world here uses. Needs root and iproute2.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (puts the checkout on sys.path)

from hotfix.worlds.two_hosts import TwoHosts

POLL_US = 1000  # hotfix/worlds/pd_connectors.py's NIXL_PROGRESS_POLL_US
WAIT_S = 300.0


def _agent(name: str, spin: bool, threads: int):
    from nixl import _api

    if not spin and not getattr(_api.nixlBind.nixlAgent, "polls", False):
        class PolledAgent(_api.nixlBind.nixlAgent):
            polls = True

            def __init__(self, agent_name, config):
                config.pthrDelay = max(config.pthrDelay, POLL_US)
                super().__init__(agent_name, config)

        _api.nixlBind.nixlAgent = PolledAgent
    # vLLM's own config: kv_connector_extra_config's num_threads (default 4), telemetry on
    return _api.nixl_agent(name, _api.nixl_agent_config(num_threads=threads, capture_telemetry=True))


def _descs(agent, buffer, count: int):
    base, size = buffer.data_ptr(), buffer.numel() // count
    return agent.get_xfer_descs([(base + i * size, size, 0) for i in range(count)], "DRAM"), size


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"nixl_post: {path} never came")
        time.sleep(0.05)


def serve(args) -> None:
    """The prefill's side: a registered buffer, its agent metadata and descriptors in files,
    then nothing to do but keep the agent alive (READs need no call from this side)."""
    import torch

    agent = _agent("prefill", args.spin, args.threads)
    buffer = torch.arange(args.kib * 1024, dtype=torch.uint8)
    agent.register_memory(agent.get_reg_descs(buffer, "DRAM"))
    descs, _ = _descs(agent, buffer, args.descs)
    (args.dir / "prefill.meta").write_bytes(agent.get_agent_metadata())
    (args.dir / "prefill.descs").write_bytes(agent.get_serialized_descs(descs))
    (args.dir / "prefill.ready").touch()
    _wait_for(args.dir / "done")


def read(args) -> None:
    """The decode's side: a warm-up READ, then, at each link rate the orchestrator sets, one
    timed READ: seconds inside ``transfer()`` and seconds until DONE."""
    import torch

    _wait_for(args.dir / "prefill.ready")
    agent = _agent("decode", args.spin, args.threads)
    buffer = torch.zeros(args.kib * 1024, dtype=torch.uint8)
    agent.register_memory(agent.get_reg_descs(buffer, "DRAM"))
    local, _ = _descs(agent, buffer, args.descs)
    metadata = (args.dir / "prefill.meta").read_bytes()
    remote_name = agent.add_remote_agent(metadata)
    remote = agent.deserialize_descs((args.dir / "prefill.descs").read_bytes())
    local_prepped = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local)
    remote_prepped = agent.prep_xfer_dlist(remote_name, remote)
    indices = list(range(args.descs))

    def rehandshake() -> None:
        """What vLLM >= 0.32 does once a failed READ's peer metadata is gone: forget the
        remote agent and load its metadata again (a new endpoint)."""
        nonlocal remote_name, remote_prepped
        agent.release_dlist_handle(remote_prepped)
        agent.remove_remote_agent(remote_name)
        remote_name = agent.add_remote_agent(metadata)
        remote_prepped = agent.prep_xfer_dlist(remote_name, remote)

    def post(tag: str):
        began = time.monotonic()
        try:
            handle = agent.make_prepped_xfer("READ", local_prepped, indices, remote_prepped, indices,
                                             notif_msg=tag.encode())
            began = time.monotonic()
            state = agent.transfer(handle)
        except Exception as exc:  # what vLLM logs as transfer_setup_failed
            return None, f"setup failed: {type(exc).__name__}", time.monotonic() - began
        return handle, state, time.monotonic() - began

    def state_of(handle) -> str:
        try:
            return agent.check_xfer_state(handle)
        except Exception as exc:  # what vLLM logs as transfer_exception
            return f"failed: {type(exc).__name__}"

    def one_read(tag: str) -> dict:
        """One READ; then, while it runs, a second one posted (what the next step does with
        the next request's READ): each call's seconds."""
        buffer.zero_()
        began = time.monotonic()
        handle, state, posted = post(tag)
        polls, second = [], None
        while state == "PROC" and time.monotonic() - began < args.limit:
            time.sleep(0.005)
            if second is None and time.monotonic() - began > 0.2:
                second = post(tag + "-second")
            t = time.monotonic()
            state = state_of(handle)
            polls.append(time.monotonic() - t)
        done = time.monotonic() - began
        if state in ("DONE", "ERR"):  # (one in flight at the limit, or failed, keeps its handle)
            agent.release_xfer_handle(handle)
        right = bool(torch.equal(buffer, torch.arange(args.kib * 1024, dtype=torch.uint8)))
        result = {"post_s": round(posted, 3), "done_s": round(done, 3), "state": state,
                  "poll_max_s": round(max(polls, default=0.0), 3), "data_right": right}
        if second is not None:
            while second[0] is not None and state_of(second[0]) == "PROC" and time.monotonic() - began < args.limit:
                time.sleep(0.005)
            result["second_post_s"] = round(second[2], 3)
        return result

    one_read("warm-up")
    results = []
    failed = False
    for i, rate in enumerate(args.rate):
        (args.dir / f"warm.{i}").touch()
        _wait_for(args.dir / f"shaped.{i}")
        if failed and args.rehandshake:  # once the link is back, as vLLM's next handshake is
            rehandshake()
        result = {"rate": rate, **one_read(f"read-{i}")}
        failed = result["state"] not in ("DONE", "PROC")
        if failed:
            result["peer_metadata_still_loaded"] = agent.check_remote_metadata(remote_name)
        results.append(result)
    (args.dir / "results.json").write_text(json.dumps(results))


def orchestrate(args) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with tempfile.TemporaryDirectory(prefix="nixl-post-") as tmp, TwoHosts() as net:
        root = Path(tmp)
        common = [sys.executable, __file__, "--dir", str(root), "--kib", str(args.kib),
                  "--descs", str(args.descs), "--threads", str(args.threads), "--limit", str(args.limit),
                  *sum((["--rate", r] for r in args.rate), []),
                  *(["--rehandshake"] if args.rehandshake else []), *(["--spin"] if args.spin else [])]
        procs = [subprocess.Popen(host.command([*common, "--role", role]), env={**env, **host.env()})
                 for host, role in ((net.prefill, "serve"), (net.decode, "read"))]
        try:
            for i, rate in enumerate(args.rate):
                _wait_for(root / f"warm.{i}")
                net.shape(None if rate == "none" else rate)
                (root / f"shaped.{i}").touch()
            _wait_for(root / "results.json")
            return json.loads((root / "results.json").read_text())
        finally:
            (root / "done").touch()
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kib", type=int, default=480, help="the READ's size (480: the faults world's prompt)")
    parser.add_argument("--descs", type=int, default=60, help="descriptors (blocks x layers x K/V)")
    parser.add_argument("--rate", action="append", help="link rate per timed READ (tc units; 'none')")
    parser.add_argument("--spin", action="store_true", help="NIXL's own busy progress thread")
    parser.add_argument("--threads", type=int, default=4, help="the UCX backend's threads (vLLM: 4)")
    parser.add_argument("--rehandshake", action="store_true",
                        help="after a failed READ, drop the remote agent and load it again")
    parser.add_argument("--limit", type=float, default=60.0, help="seconds a READ may take before it is left")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--role", choices=("serve", "read"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.rate = args.rate or ["none", "100mbit", "10mbit", "1mbit"]
    if args.role == "serve":
        return serve(args)
    if args.role == "read":
        return read(args)
    results = orchestrate(args)
    if args.json:
        print(json.dumps({"kib": args.kib, "descs": args.descs, "spin": args.spin, "reads": results}))
        return
    print(f"one READ of {args.kib} KiB in {args.descs} descriptors ({'spinning' if args.spin else 'polled'} progress thread)")
    for r in results:
        print(f"  link {r['rate']:>8}: transfer() returned after {r['post_s']:7.3f} s, DONE after "
              f"{r['done_s']:7.3f} s ({r['state']}, data {'right' if r['data_right'] else 'WRONG'}); "
              f"longest check_xfer_state {r['poll_max_s']:.3f} s; a second READ's transfer() "
              f"{r.get('second_post_s', '-')} s"
              + (f"; peer metadata still loaded: {r['peer_metadata_still_loaded']}"
                 if "peer_metadata_still_loaded" in r else ""))


if __name__ == "__main__":
    main()
