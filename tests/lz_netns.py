"""Network namespaces for fault tests: a server namespace joined to the test's own by a veth pair.

Partitions are iptables DROP rules in the server namespace. Shaped links (delay, rate) come from
`benchmarks.netns.Network`: `tc netem` where the kernel has it, else a TUN delay line.

Only addresses created here are used (10.233.<n>.0/24). Everything is removed on exit. Tests skip,
with the reason, where namespaces cannot be created (not root, or no CAP_NET_ADMIN).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from contextlib import contextmanager


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def netns_unavailable_reason() -> str | None:
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if shutil.which("iptables") is None:
        return "iptables is not installed (apt-get install iptables)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"lzprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


class NetPair:
    """Namespace `ns` at `peer_ip`, reachable from the test's namespace at `host_ip` over a veth."""

    def __init__(self) -> None:
        n = random.randint(1, 250)
        tag = f"{os.getpid() % 10000}{n}"
        self.ns = f"lzs{tag}"
        self.host_if = f"lzh{tag}"
        self.peer_if = f"lzp{tag}"
        self.host_ip = f"10.233.{n}.1"
        self.peer_ip = f"10.233.{n}.2"

    def up(self) -> NetPair:
        _ip("ip", "netns", "add", self.ns)
        _ip("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.peer_if)
        _ip("ip", "link", "set", self.peer_if, "netns", self.ns)
        _ip("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
        _ip("ip", "link", "set", self.host_if, "up")
        _ip("ip", "addr", "add", f"{self.peer_ip}/24", "dev", self.peer_if, ns=self.ns)
        _ip("ip", "link", "set", self.peer_if, "up", ns=self.ns)
        _ip("ip", "link", "set", "lo", "up", ns=self.ns)
        return self

    def down(self) -> None:
        _ip("ip", "link", "del", self.host_if, check=False)
        _ip("ip", "netns", "del", self.ns, check=False)

    def partition(self) -> None:
        """Drop every packet between the two namespaces (the link stays up, as with a dead switch)."""
        _ip("iptables", "-I", "INPUT", "-i", self.peer_if, "-j", "DROP", ns=self.ns)
        _ip("iptables", "-I", "OUTPUT", "-o", self.peer_if, "-j", "DROP", ns=self.ns)

    def clear(self) -> None:
        """Heal a partition."""
        _ip("iptables", "-F", ns=self.ns, check=False)

    def popen(self, cmd: list[str], **kw) -> subprocess.Popen:
        """Start `cmd` inside the namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns, *cmd], **kw)


@contextmanager
def net_pair():
    pair = NetPair()
    try:
        yield pair.up()
    finally:
        pair.down()
