"""Network namespaces for fault tests: a server namespace joined to the test's own by a veth pair.

Partitions are iptables DROP rules in the server namespace. Shaped links (delay, rate) come from
`testbed.netns.Network`: `tc netem` where the kernel has it, else a TUN delay line.

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
        # A subnet no other pair on this host uses (test processes run side by side: `make test`).
        used = _ip("ip", "-o", "-4", "addr", "show", check=False).stdout
        n = random.choice([i for i in range(1, 251) if f" 10.233.{i}." not in used] or [random.randint(1, 250)])
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
    for attempt in range(3):  # another test process took the same subnet at the same moment: another one
        pair = NetPair()
        try:
            pair.up()
            break
        except subprocess.CalledProcessError:
            pair.down()
            if attempt == 2:
                raise
    try:
        yield pair
    finally:
        pair.down()


# -- a LAN of namespaces (no address outside the namespaces created here) ------------------------


def lan_unavailable_reason() -> str | None:
    """Why a `Lan` cannot be built here (None: it can). Needs root and iproute2 (ip, tc, ss), not iptables."""
    for tool in ("ip", "tc", "ss"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"lzprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


class LanMember:
    """One host of a `Lan`: namespace `ns` at `ip`, plugged into the switch by `switch_if`."""

    def __init__(self, lan: Lan, name: str, index: int) -> None:
        self.name = name
        self.ns = f"{lan.tag}{name}"
        self.ip = f"10.234.{lan.subnet}.{index}"
        self.iface = f"{lan.tag}{index}m"
        self.switch_if = f"{lan.tag}{index}s"
        self._lan = lan

    def up(self) -> LanMember:
        sw = self._lan.switch_ns
        _ip("ip", "netns", "add", self.ns)
        _ip("ip", "link", "set", "lo", "up", ns=self.ns)
        _ip("ip", "link", "add", self.iface, "netns", self.ns, "type", "veth", "peer", "name", self.switch_if,
            "netns", sw, ns=sw)
        _ip("ip", "link", "set", self.switch_if, "master", "br0", ns=sw)
        _ip("ip", "link", "set", self.switch_if, "up", ns=sw)
        _ip("ip", "addr", "add", f"{self.ip}/24", "dev", self.iface, ns=self.ns)
        _ip("ip", "link", "set", self.iface, "up", ns=self.ns)
        # multicast scouting (224.0.0.224) needs a route out of the LAN interface
        _ip("ip", "route", "add", "224.0.0.0/4", "dev", self.iface, ns=self.ns)
        return self

    def run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns, *cmd], capture_output=True, text=True, **kw)

    def popen(self, cmd: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns, *cmd], **kw)

    def freeze(self) -> None:
        """Every packet to and from this host is lost (a dead radio link); TCP keeps its connections."""
        for ns, dev in ((self._lan.switch_ns, self.switch_if), (self.ns, self.iface)):
            # tbf drops any packet larger than its bucket: a 1-byte bucket drops everything
            _ip("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", "8bit", "burst", "1", "limit", "1", ns=ns)

    def freeze_downlink(self) -> None:
        """Data to this host is lost, its own packets and the ACKs for them still flow (a congested
        downlink): it keeps sending, and whatever is sent to it piles up at the sender."""
        _ip("tc", "qdisc", "replace", "dev", self.switch_if, "root", "tbf", "rate", "8kbit", "burst", "100",
            "limit", "100", ns=self._lan.switch_ns)

    def thaw(self) -> None:
        for ns, dev in ((self._lan.switch_ns, self.switch_if), (self.ns, self.iface)):
            _ip("tc", "qdisc", "del", "dev", dev, "root", ns=ns, check=False)

    def sockets(self, *flags: str) -> list[str]:
        """`ss` lines (header dropped) of this namespace, e.g. sockets("-ltnp") for TCP listeners."""
        out = self.run(["ss", "-H", *flags]).stdout
        return [line for line in out.splitlines() if line.strip()]


class Lan:
    """Hosts on one Ethernet segment: a bridge in a switch namespace, one namespace per member.

    Addresses (10.234.<n>.x/24) exist only inside the member namespaces; nothing is added to the
    namespace the tests run in. Multicast flows between members (snooping off).
    """

    def __init__(self) -> None:
        self.subnet = random.randint(1, 250)
        self.tag = f"lz{os.getpid() % 1000}{self.subnet}"
        self.switch_ns = f"{self.tag}sw"
        self.members: dict[str, LanMember] = {}

    def up(self) -> Lan:
        _ip("ip", "netns", "add", self.switch_ns)
        _ip("ip", "link", "add", "br0", "type", "bridge", "mcast_snooping", "0", ns=self.switch_ns)
        _ip("ip", "link", "set", "br0", "up", ns=self.switch_ns)
        return self

    def add(self, name: str) -> LanMember:
        member = LanMember(self, name, len(self.members) + 1).up()
        self.members[name] = member
        return member

    def down(self) -> None:
        for member in self.members.values():
            _ip("ip", "netns", "del", member.ns, check=False)
        _ip("ip", "netns", "del", self.switch_ns, check=False)


@contextmanager
def lan(*names: str):
    """A LAN with one member per name: `with lan("server", "robot") as (server, robot): ...`."""
    network = Lan()
    try:
        network.up()
        yield tuple(network.add(n) for n in names)
    finally:
        network.down()
