"""Two network hosts on one machine: a prefill host and a decode host, each a network namespace
of its own, joined by one veth pair. Everything between them (NIXL's side channel, UCX's TCP
READs, the completion notifications, the heartbeats) crosses that link, so the link can be
slowed (a READ then takes seconds, as a long prompt's does over the bug report's ~400 MB/s)
and cut (a partition: packets dropped without a reset, both ways) while a transfer runs.

The link is shaped with a token-bucket qdisc on both ends. This machine's kernel has no netem
and no tc classifiers; a token bucket too small for any packet is a silent drop, which is
what a cut cable or a dead switch does to TCP (no FIN, no RST: the sender retransmits).
Latency is not modelled. Processes join a host by ``ip netns exec`` (:meth:`Host.command`).
Two hosts' monotonic clocks differ by their boot times (``time.perf_counter``, which vLLM's
NIXL leases and the hotfix's are stamped with); a host made with a clock offset runs its
processes in a time namespace of its own whose monotonic clock reads that many seconds ahead
(or behind). Wall clocks (``time.time``) are the machine's: nothing on the lease path reads
them when both engines are of this release.
Every namespace is named after the pid that made it, so :func:`reap_orphan_namespaces` deletes
those of a run that was killed (its processes are reaped by ``home.reap_orphans``).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

from hotfix.status import pid_alive

PREFIX = "hfw"  # namespace names: hfw<owner pid><role>
SUBNET = "10.77.0"  # each pair's own: namespaces do not share addresses
PROBE_TIMEOUT_S = 60  # a probe of the clock offset that does not answer (a python start on a busy box: seconds)
RATE_CUT = "8bit"  # no packet ever fits the bucket: everything is dropped, silently
_NAME = re.compile(rf"^{PREFIX}(\d+)([a-z])$")


class NoNetworkNamespaces(RuntimeError):
    """This machine cannot make network namespaces (not root, no iproute2)."""


@dataclass(frozen=True)
class Host:
    netns: str
    device: str
    ip: str
    clock_offset_s: int = 0  # this host's CLOCK_MONOTONIC (and BOOTTIME) minus the machine's

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host (in its time namespace if its clock is offset)."""
        clock = (["unshare", "--time", f"--monotonic={self.clock_offset_s}", f"--boottime={self.clock_offset_s}",
                  "--fork", "--kill-child", "--"] if self.clock_offset_s else [])
        return ["ip", "netns", "exec", self.netns, *clock, *argv]

    def env(self) -> dict:
        """What a vLLM engine on this host binds and announces: its side channel, its internal
        ports and UCX over this host's link only (no shared memory across the hosts)."""
        return {"VLLM_NIXL_SIDE_CHANNEL_HOST": self.ip, "VLLM_HOST_IP": self.ip,
                "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": self.device}


class TwoHosts:
    """``prefill`` and ``decode``, made on enter and deleted on exit (links with them); the
    prefill host's monotonic clock ``prefill_clock_offset_s`` ahead of the decode host's."""

    def __init__(self, prefill_clock_offset_s: int = 0) -> None:
        if shutil.which("ip") is None or shutil.which("tc") is None or os.geteuid() != 0:
            raise NoNetworkNamespaces("needs root and iproute2 (ip, tc)")
        if prefill_clock_offset_s and (shutil.which("unshare") is None or subprocess.run(
                ["unshare", "--time", "--monotonic=1", "--fork", "true"], capture_output=True,
                timeout=PROBE_TIMEOUT_S).returncode):
            raise NoNetworkNamespaces("a clock offset needs unshare (util-linux) and time namespaces")
        owner = os.getpid()
        self.prefill = Host(f"{PREFIX}{owner}p", f"{PREFIX}{owner}p", f"{SUBNET}.1", prefill_clock_offset_s)
        self.decode = Host(f"{PREFIX}{owner}d", f"{PREFIX}{owner}d", f"{SUBNET}.2")
        self.rate = None

    def __enter__(self) -> "TwoHosts":
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        p, d = self.prefill, self.decode
        for host in (p, d):
            _ip("netns", "add", host.netns)
        _ip("link", "add", p.device, "netns", p.netns, "type", "veth", "peer", "name", d.device,
            "netns", d.netns)
        for host in (p, d):
            _ip("-n", host.netns, "addr", "add", f"{host.ip}/30", "dev", host.device)
            _ip("-n", host.netns, "link", "set", host.device, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        if p.clock_offset_s:
            _check_clock_offset(p)

    def shape(self, rate: str | None) -> None:
        """Limit each direction to ``rate`` (tc's units: ``200kbit``); None: unlimited."""
        for host in (self.prefill, self.decode):
            if rate is None:
                subprocess.run(["tc", "-n", host.netns, "qdisc", "del", "dev", host.device, "root"],
                               capture_output=True)
            else:
                # burst: one full-size frame at least, or nothing ever passes
                burst = "1b" if rate == RATE_CUT else "16kb"
                _tc(host, "qdisc", "replace", "dev", host.device, "root", "tbf", "rate", rate,
                    "burst", burst, "latency", "2s")
        self.rate = rate

    def cut(self) -> str | None:
        """Partition the hosts (both directions drop everything, no reset); returns the rate
        the link had, for :meth:`restore`."""
        rate = self.rate
        self.shape(RATE_CUT)
        return rate

    def restore(self, rate: str | None) -> None:
        self.shape(rate)

    def close(self) -> None:
        for host in (self.prefill, self.decode):
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)


def reap_orphan_namespaces() -> list[str]:
    """Delete the namespaces of runs that no longer exist (a killed run's hosts); returns
    their names. Deleting a namespace deletes its end of the link, and so the link."""
    if shutil.which("ip") is None:
        return []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    gone = []
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAME.match(name)
        if match and not pid_alive(int(match.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            gone.append(name)
    return gone


def _check_clock_offset(host: Host) -> None:
    """The host's monotonic clock reads its offset ahead of this process's (read while the
    probe ran, give or take 0.5 s), or the world would run with both hosts on one clock and say
    otherwise."""
    before = time.monotonic()
    read = float(subprocess.run(host.command([sys.executable, "-c", "import time; print(time.monotonic())"]),
                                check=True, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S).stdout)
    after = time.monotonic()
    if not read - after - 0.5 <= host.clock_offset_s <= read - before + 0.5:
        raise NoNetworkNamespaces(f"the prefill host's clock reads {read - after:+.1f}..{read - before:+.1f} s "
                                  f"ahead, not {host.clock_offset_s:+d} s")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _tc(host: Host, *args: str) -> None:
    subprocess.run(["tc", "-n", host.netns, *args], check=True, capture_output=True, text=True)
