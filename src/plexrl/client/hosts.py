"""Hosts on one machine: Linux network namespaces on a bridge, for multi-host tests and benches.

Each :class:`Host` is a network namespace with its own loopback and one interface (``eth0``) on
a bridge in the root namespace, which holds ``GATEWAY`` so this process (a test, a bench) reaches
every host. A host's link can be cut and restored (``link(False)``) or shaped to a bandwidth
(``shape``) with ``tc``. Needs root (``ip netns``); ``available()`` says whether this machine can.
``plexrl.local(hosts=...)`` runs the coordinator on the first host and the workers on the others.

    with hosts.Network(3) as net:        # net.hosts[0] for the coordinator, [1:] for workers
        async with plexrl.local(workers=2, hosts=net.hosts) as client: ...
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from types import TracebackType

from plexrl.errors import LocalClusterError

SUBNET = "10.77.0"
GATEWAY = f"{SUBNET}.254"


def available() -> str | None:
    """None if this process can make hosts; otherwise why not (for a test's skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the `ip` and `tc` commands (iproute2) are not installed"
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise LocalClusterError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


@dataclass(frozen=True)
class Host:
    """One host: a network namespace and its address on the network."""

    netns: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host (``ip netns exec`` keeps the process id: it execs ``argv``)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def link(self, up: bool) -> None:
        """Connect this host to the network, or cut it off (its processes live on, unreachable)."""
        _ip("-n", self.netns, "link", "set", "eth0", "up" if up else "down")

    def shape(self, mbit_per_s: int) -> None:
        """Cap what this host sends at ``mbit_per_s`` (a token bucket on its interface)."""
        _ip("netns", "exec", self.netns, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
            "rate", f"{mbit_per_s}mbit", "burst", "256kb", "latency", "50ms")  # fmt: skip


class Network:
    """``count`` hosts on a bridge, torn down on exit (and at start, if a crashed run left them)."""

    def __init__(self, count: int, prefix: str = "plexh") -> None:
        if not 1 <= count <= 200:
            raise ValueError(f"count={count}: a network holds 1 to 200 hosts")
        if (why := available()) is not None:
            raise LocalClusterError(f"cannot make hosts on this machine: {why}")
        self.prefix = prefix
        self.bridge = f"{prefix}-br"
        self.hosts = [Host(f"{prefix}{i}", f"{SUBNET}.{i + 1}") for i in range(count)]

    def __enter__(self) -> Network:
        self._teardown()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{GATEWAY}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, host in enumerate(self.hosts):
                outside = f"{self.prefix}v{i}"
                _ip("netns", "add", host.netns)
                _ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
                _ip("link", "set", outside, "master", self.bridge, "up")
                _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
                _ip("-n", host.netns, "link", "set", "lo", "up")
                _ip("-n", host.netns, "link", "set", "eth0", "up")
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._teardown()

    def _teardown(self) -> None:
        for i, host in enumerate(self.hosts):  # a namespace's end of a veth pair goes with it
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, check=False)
            subprocess.run(["ip", "link", "del", f"{self.prefix}v{i}"], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
