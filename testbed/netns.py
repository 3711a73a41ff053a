"""Network namespaces for the tests and the benchmarks: every topology the test bed builds, in one place.

    Network     two namespaces joined by a shaped point-to-point link (delay, rate): the benchmarks'
                links, and the tests that need a slow link
    NetPair     a server namespace joined to the caller's own by a veth pair, cut by iptables DROP
                rules (`partition`, `clear`): the fault tests' partitions (`net_pair()`)
    Lan         hosts on one Ethernet segment (a bridge in a switch namespace), each host frozen or
                its downlink starved with `tc tbf` (no iptables): the fault tests' stalls (`lan()`)

One module because it is one concern: they share the command runner and the probe for whether
namespaces can be made here, and the address ranges below are kept apart in one place. Only
addresses created here are used, each inside namespaces created here (the one exception: a
`NetPair`'s host end, 10.233.<n>.1, is in the caller's namespace): 10.77.0.0/24 (`Network`),
10.233.<n>.0/24 (`NetPair`), 10.234.<n>.0/24 (`Lan`). Everything is removed on exit. All of it needs
root: `Network` falls back to the host's loopback (and says why); tests skip with the reason from
`netns_unavailable_reason()` or `lan_unavailable_reason()`.

The shaped link:

    client namespace  10.77.0.1  ==== link ====  10.77.0.2  server namespace (also has its own loopback)

Links (one-way delay on each direction, and a rate):

    loopback   no link: client and server both in the server namespace, on 127.0.0.1
    factory    0.5 ms one way, 1 Gbit/s   (a wired factory network)
    wifi       2.5 ms one way, 300 Mbit/s (a good Wi-Fi link)

The link is a veth pair shaped with ``tc qdisc ... netem delay D rate R`` on both ends, where the
kernel has ``sch_netem``. Where it does not (some container and VM kernels ship without it), the link is
a pair of TUN devices and a small delay line in user space (``python -m testbed.netns delay-line``):
it reads each IP packet, holds it for its serialisation time at the rate plus the delay, and writes it
to the other side, with a 1000-packet queue like netem's default. TCP therefore sees the real delay,
rate and queue: window growth, ACK clocking and HTTP/2 flow control behave as on a real link (a TCP
proxy would hide exactly that). Its cost (a few microseconds of CPU per packet, at MTU 1500) is
reported with the results.

Without root (``ip netns``) the benchmarks run on the host's loopback only.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import random
import select
import shutil
import struct
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

CLIENT_ADDR = "10.77.0.1"
SERVER_ADDR = "10.77.0.2"
MTU = 1500
QUEUE_LIMIT_PACKETS = 1000  # netem's default limit


@dataclass(frozen=True)
class LinkShape:
    name: str
    delay_ms: float  # one way, each direction
    rate_mbit: float | None  # None: unlimited
    label: str


LINKS = {
    "loopback": LinkShape("loopback", 0.0, None, "loopback"),
    "factory": LinkShape("factory", 0.5, 1000.0, "wired 1 Gbit/s, 0.5 ms one way"),
    "wifi": LinkShape("wifi", 2.5, 300.0, "Wi-Fi-like 300 Mbit/s, 2.5 ms one way"),
}


def _sh(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command (inside namespace `ns` if given), its output captured."""
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def _namespace_reason() -> str | None:
    """Why no network namespace can be created here (None: one can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"lzprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


class Network:
    """Creates the namespaces and the link (`start`), reshapes it (`shape`), removes it all (`close`).

    `method` is "netem", "tun-delay-line", or "host-loopback" (no namespaces: not root, or no `ip`).
    """

    def __init__(self, log_dir: str, use_namespaces: bool = True, with_link: bool = True):
        self.use_namespaces = use_namespaces
        self.with_link = with_link
        tag = f"lzb{os.getpid() % 100000}"
        self.ns_client = f"{tag}c"
        self.ns_server = f"{tag}s"
        self.log_dir = log_dir
        self.method = "host-loopback"
        self.reason = ""
        self._dev_client = f"{tag}c0"
        self._dev_server = f"{tag}s0"
        self._delay_line: subprocess.Popen | None = None
        self._created = False
        self.current: LinkShape | None = None

    # -- lifecycle

    def start(self) -> Network:
        if not self.use_namespaces:
            self.reason = "namespaces turned off (--no-netns): loopback on the host only"
            return self
        if os.geteuid() != 0 or shutil.which("ip") is None:
            self.reason = "not root or no `ip`: loopback on the host only"
            return self
        try:
            for ns in (self.ns_client, self.ns_server):
                _sh("ip", "netns", "add", ns)
                self._created = True
                _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            self.reason = f"could not create namespaces ({exc.stderr.strip()}): loopback on the host only"
            self.close()
            return self
        if not self.with_link:
            self.method = "namespace-loopback"
            return self
        if self._try_veth_netem():
            self.method = "netem"
        else:
            self._start_delay_line()
            self.method = "tun-delay-line"
        return self

    def _try_veth_netem(self) -> bool:
        c, s = self._dev_client, self._dev_server
        try:
            _sh("ip", "link", "add", c, "type", "veth", "peer", "name", s)
            _sh("ip", "link", "set", c, "netns", self.ns_client)
            _sh("ip", "link", "set", s, "netns", self.ns_server)
            self._configure(c, s)
            self._netem(0.5, 1000.0)  # probe: fails where sch_netem is missing
            return True
        except subprocess.CalledProcessError as exc:
            self.reason = f"netem unavailable ({exc.stderr.strip()}): TUN delay line"
            for ns, dev in ((self.ns_client, c), (self.ns_server, s)):
                _sh("ip", "netns", "exec", ns, "ip", "link", "del", dev, check=False)
            _sh("ip", "link", "del", c, check=False)
            return False

    def _configure(self, c: str, s: str) -> None:
        for ns, dev, addr, peer in ((self.ns_client, c, CLIENT_ADDR, SERVER_ADDR), (self.ns_server, s, SERVER_ADDR, CLIENT_ADDR)):
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "mtu", str(MTU), "txqueuelen", "10000", "up")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", addr, "peer", peer, "dev", dev)

    def _start_delay_line(self) -> None:
        log = open(os.path.join(self.log_dir, "delay_line.log"), "w")
        self._delay_line = subprocess.Popen(
            [sys.executable, "-m", "testbed.netns", "delay-line", "--client-dev", self._dev_client,
             "--server-dev", self._dev_server, "--client-ns", self.ns_client, "--server-ns", self.ns_server],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        line = self._delay_line.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"delay line did not start: {line!r} (see {log.name})")
        self._configure(self._dev_client, self._dev_server)

    def _netem(self, delay_ms: float, rate_mbit: float | None) -> None:
        for ns, dev in ((self.ns_client, self._dev_client), (self.ns_server, self._dev_server)):
            args = ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "netem",
                    "delay", f"{delay_ms}ms", "limit", str(QUEUE_LIMIT_PACKETS)]
            if rate_mbit:
                args += ["rate", f"{rate_mbit}mbit"]
            _sh(*args)

    def shape(self, link: LinkShape) -> None:
        """Apply `link` to the client-server link (loopback needs nothing)."""
        self.current = link
        if link.name == "loopback" or not self.has_link:
            return
        if self.method == "netem":
            self._netem(link.delay_ms, link.rate_mbit)
        else:
            self._delay_line_cmd(f"shape {link.delay_ms} {link.rate_mbit or 0}")

    def delay_line_stats(self) -> dict | None:
        if self._delay_line is None:
            return None
        fields = self._delay_line_cmd("stats").split()
        return {"packets": int(fields[1]), "dropped": int(fields[2]), "cpu_s": float(fields[3])}

    def _delay_line_cmd(self, cmd: str) -> str:
        self._delay_line.stdin.write(cmd + "\n")
        self._delay_line.stdin.flush()
        reply = self._delay_line.stdout.readline().strip()
        if not reply.startswith("ok"):
            raise RuntimeError(f"delay line: {cmd!r} -> {reply!r}")
        return reply

    def close(self) -> None:
        if self._delay_line is not None:
            try:
                self._delay_line.stdin.close()
                self._delay_line.wait(timeout=5)
            except Exception:
                self._delay_line.kill()
            self._delay_line = None
        if self._created:
            for ns in (self.ns_client, self.ns_server):
                _sh("ip", "netns", "del", ns, check=False)
            self._created = False

    def __enter__(self) -> Network:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- where things run

    @property
    def in_namespaces(self) -> bool:
        return self.method != "host-loopback"

    @property
    def has_link(self) -> bool:
        return self.method in ("netem", "tun-delay-line")

    def prefix(self, side: str, link: LinkShape | None = None) -> list[str]:
        """Command prefix that runs a process on `side` ("client" or "server") for `link`."""
        if not self.in_namespaces:
            return []
        if side == "server" or (link is not None and link.name == "loopback"):
            return ["ip", "netns", "exec", self.ns_server]
        return ["ip", "netns", "exec", self.ns_client]

    def server_host(self, link: LinkShape) -> str:
        return "127.0.0.1" if link.name == "loopback" or not self.has_link else SERVER_ADDR

    def server_iface(self, link: LinkShape) -> str:
        return "lo" if link.name == "loopback" or not self.has_link else self._dev_server


def link_bytes(pid: int, iface: str) -> int | None:
    """rx + tx bytes of `iface` in the network namespace of process `pid` (None if unreadable).

    On loopback every byte is counted twice (sent and received on `lo`), so this is halved there.
    """
    try:
        with open(f"/proc/{pid}/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == iface:
                    fields = rest.split()
                    total = int(fields[0]) + int(fields[8])
                    return total // 2 if iface == "lo" else total
    except OSError:
        return None
    return None


# ----------------------------------------------------------------------------- a veth pair, cut by iptables

def netns_unavailable_reason() -> str | None:
    """Why a `NetPair` cannot be built here (None: it can). Needs root, iproute2 (ip, tc) and iptables."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if shutil.which("iptables") is None:
        return "iptables is not installed (apt-get install iptables)"
    return _namespace_reason()


class NetPair:
    """Namespace `ns` at `peer_ip`, reachable from the test's namespace at `host_ip` over a veth."""

    def __init__(self) -> None:
        # A subnet no other pair on this host uses (test processes run side by side: `make test`).
        used = _sh("ip", "-o", "-4", "addr", "show", check=False).stdout
        n = random.choice([i for i in range(1, 251) if f" 10.233.{i}." not in used] or [random.randint(1, 250)])
        tag = f"{os.getpid() % 10000}{n}"
        self.ns = f"lzs{tag}"
        self.host_if = f"lzh{tag}"
        self.peer_if = f"lzp{tag}"
        self.host_ip = f"10.233.{n}.1"
        self.peer_ip = f"10.233.{n}.2"

    def up(self) -> NetPair:
        _sh("ip", "netns", "add", self.ns)
        _sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.peer_if)
        _sh("ip", "link", "set", self.peer_if, "netns", self.ns)
        _sh("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
        _sh("ip", "link", "set", self.host_if, "up")
        _sh("ip", "addr", "add", f"{self.peer_ip}/24", "dev", self.peer_if, ns=self.ns)
        _sh("ip", "link", "set", self.peer_if, "up", ns=self.ns)
        _sh("ip", "link", "set", "lo", "up", ns=self.ns)
        return self

    def down(self) -> None:
        _sh("ip", "link", "del", self.host_if, check=False)
        _sh("ip", "netns", "del", self.ns, check=False)

    def partition(self) -> None:
        """Drop every packet between the two namespaces (the link stays up, as with a dead switch)."""
        _sh("iptables", "-I", "INPUT", "-i", self.peer_if, "-j", "DROP", ns=self.ns)
        _sh("iptables", "-I", "OUTPUT", "-o", self.peer_if, "-j", "DROP", ns=self.ns)

    def clear(self) -> None:
        """Heal a partition."""
        _sh("iptables", "-F", ns=self.ns, check=False)

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


# ----------------------------------------------------------------------------- a LAN of namespaces


def lan_unavailable_reason() -> str | None:
    """Why a `Lan` cannot be built here (None: it can). Needs root and iproute2 (ip, tc, ss), not iptables."""
    for tool in ("ip", "tc", "ss"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    return _namespace_reason()


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
        _sh("ip", "netns", "add", self.ns)
        _sh("ip", "link", "set", "lo", "up", ns=self.ns)
        _sh("ip", "link", "add", self.iface, "netns", self.ns, "type", "veth", "peer", "name", self.switch_if,
            "netns", sw, ns=sw)
        _sh("ip", "link", "set", self.switch_if, "master", "br0", ns=sw)
        _sh("ip", "link", "set", self.switch_if, "up", ns=sw)
        _sh("ip", "addr", "add", f"{self.ip}/24", "dev", self.iface, ns=self.ns)
        _sh("ip", "link", "set", self.iface, "up", ns=self.ns)
        # multicast scouting (224.0.0.224) needs a route out of the LAN interface
        _sh("ip", "route", "add", "224.0.0.0/4", "dev", self.iface, ns=self.ns)
        return self

    def run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns, *cmd], capture_output=True, text=True, **kw)

    def popen(self, cmd: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns, *cmd], **kw)

    def freeze(self) -> None:
        """Every packet to and from this host is lost (a dead radio link); TCP keeps its connections."""
        for ns, dev in ((self._lan.switch_ns, self.switch_if), (self.ns, self.iface)):
            # tbf drops any packet larger than its bucket: a 1-byte bucket drops everything
            _sh("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", "8bit", "burst", "1", "limit", "1", ns=ns)

    def freeze_downlink(self) -> None:
        """Data to this host is lost, its own packets and the ACKs for them still flow (a congested
        downlink): it keeps sending, and whatever is sent to it piles up at the sender."""
        _sh("tc", "qdisc", "replace", "dev", self.switch_if, "root", "tbf", "rate", "8kbit", "burst", "100",
            "limit", "100", ns=self._lan.switch_ns)

    def thaw(self) -> None:
        for ns, dev in ((self._lan.switch_ns, self.switch_if), (self.ns, self.iface)):
            _sh("tc", "qdisc", "del", "dev", dev, "root", ns=ns, check=False)

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
        _sh("ip", "netns", "add", self.switch_ns)
        _sh("ip", "link", "add", "br0", "type", "bridge", "mcast_snooping", "0", ns=self.switch_ns)
        _sh("ip", "link", "set", "br0", "up", ns=self.switch_ns)
        return self

    def add(self, name: str) -> LanMember:
        member = LanMember(self, name, len(self.members) + 1).up()
        self.members[name] = member
        return member

    def down(self) -> None:
        for member in self.members.values():
            _sh("ip", "netns", "del", member.ns, check=False)
        _sh("ip", "netns", "del", self.switch_ns, check=False)


@contextmanager
def lan(*names: str):
    """A LAN with one member per name: `with lan("server", "robot") as (server, robot): ...`."""
    network = Lan()
    try:
        network.up()
        yield tuple(network.add(n) for n in names)
    finally:
        network.down()



# ----------------------------------------------------------------------------- the TUN delay line

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class _Direction:
    """One direction of the link: serialisation at `rate`, then `delay`, FIFO with a packet limit."""

    def __init__(self, src: int, dst: int):
        self.src, self.dst = src, dst
        self.queue: collections.deque = collections.deque()
        self.next_free = 0.0
        self.delay_s = 0.0
        self.rate_bps = 0.0
        self.packets = 0
        self.dropped = 0

    def read(self, now: float) -> None:
        while True:
            try:
                pkt = os.read(self.src, 65536)
            except BlockingIOError:
                return
            if len(self.queue) >= QUEUE_LIMIT_PACKETS:
                self.dropped += 1
                continue
            depart = max(now, self.next_free)
            if self.rate_bps:
                depart += len(pkt) * 8 / self.rate_bps
            self.next_free = depart
            self.queue.append((depart + self.delay_s, pkt))

    def deliver(self, now: float) -> None:
        q = self.queue
        while q and q[0][0] <= now:
            _, pkt = q.popleft()
            try:
                os.write(self.dst, pkt)
                self.packets += 1
            except OSError:
                self.dropped += 1


def delay_line(client_dev: str, server_dev: str, client_ns: str, server_ns: str) -> None:
    """Create the two TUN devices here, move each into its namespace, then forward with delay and rate."""
    fc, fs = _open_tun(client_dev), _open_tun(server_dev)
    _sh("ip", "link", "set", client_dev, "netns", client_ns)
    _sh("ip", "link", "set", server_dev, "netns", server_ns)
    dirs = [_Direction(fc, fs), _Direction(fs, fc)]
    stdin = sys.stdin.fileno()
    print("ready", flush=True)
    slack_s = 30e-6  # deliver this early rather than oversleep (select wakes up late, not early)
    while True:
        now = time.perf_counter()
        dues = [d.queue[0][0] for d in dirs if d.queue]
        timeout = max(0.0, min(dues) - now - slack_s) if dues else 0.5
        ready, _, _ = select.select([fc, fs, stdin], [], [], timeout)
        now = time.perf_counter()
        for d in dirs:
            if d.src in ready:
                d.read(now)
        for d in dirs:
            d.deliver(now + slack_s)
        if stdin in ready:
            line = sys.stdin.readline()
            if not line:
                return
            parts = line.split()
            if parts[0] == "shape":
                for d in dirs:
                    d.delay_s = float(parts[1]) / 1000.0
                    d.rate_bps = float(parts[2]) * 1e6
                print("ok", flush=True)
            elif parts[0] == "stats":
                print(f"ok {sum(d.packets for d in dirs)} {sum(d.dropped for d in dirs)} {time.process_time():.4f}",
                      flush=True)
            else:
                print(f"error unknown command {parts[0]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    dl = sub.add_parser("delay-line", help="(internal) the TUN delay line")
    for arg in ("--client-dev", "--server-dev", "--client-ns", "--server-ns"):
        dl.add_argument(arg, required=True)
    args = parser.parse_args()
    if args.cmd == "delay-line":
        delay_line(args.client_dev, args.server_dev, args.client_ns, args.server_ns)


if __name__ == "__main__":
    main()
