"""The one Zenoh configuration of the project, and its translation into a `zenoh.Config`.

`ZenohSettings` is used as is by every program: the `--zenoh.*` flags of the robot client, the
monitor and the router (draccus), and the server manifest's `zenoh:` block (pydantic validates the
same dataclass). Its fields, defaults and help texts are defined here and nowhere else.

Defaults are chosen so that a program opens nothing it was not asked to (docs/security.md):

- `mode: auto` is Zenoh `client` mode (connect only, no listener) when `connect` endpoints are
  given and `listen` is empty, `peer` otherwise. A `peer` with connect endpoints and no `listen`
  listens nowhere; only a peer given no endpoint at all keeps Zenoh's own default (it listens on
  every interface so that peers found by scouting can reach it).
- `multicast_scouting` unset is off when `connect` endpoints are given, on otherwise.
- `shared_memory` is off (eclipse-zenoh 1.10.2 leaks a segment per same-host session and loses
  messages silently without the memory-lock privilege: docs/security.md).
- `max_message_bytes` caps what a link reassembles (Zenoh's own default is 1 GiB): a larger message
  is dropped by Zenoh while it arrives, having cost at most this much memory, in every session,
  secured or not (docs/security.md §5).

Anything else Zenoh offers goes through `json5_overrides` (a Zenoh config path -> a JSON5
literal), applied last.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lerobot_zenoh.errors import ConfigError

MODES = ("auto", "peer", "client", "router")
#: The Zenoh priority action chunks are sent at (session.ACTION_QOS) and the transmit queue, in
#: batches per link, every session gives it (Zenoh's default is 2; see json5_entries).
ACTION_TX_PRIORITY = "interactive_high"
ACTION_TX_QUEUE_BATCHES = 16
#: What a link reassembles at most: the codec's 16 MiB message limit (docs/protocol.md §8.1) plus
#: room for the Zenoh message around it (an observation's header attachment, key, framing).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024 + 64 * 1024
#: How long a client-mode session waits for an endpoint when `connect_timeout_s` is unset; the robot
#: client and the monitor wait QUICK_CONNECT_WAIT_S instead, so that a dead endpoint is reported soon.
DEFAULT_CONNECT_TIMEOUT_S = 30.0
QUICK_CONNECT_WAIT_S = 2.0


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class ZenohSettings:
    mode: str = field(default="auto", metadata=_help(
        "Zenoh mode: auto (client when only `connect` endpoints are given, else peer), peer (talks to peers "
        "directly), client (connects to one peer or router, never listens), router (routes for others)."))
    connect: list[str] = field(default_factory=list, metadata=_help(
        "Endpoints to connect to, e.g. [tcp/192.168.1.50:7447] or [tls/gpu-host:7447]."))
    listen: list[str] = field(default_factory=list, metadata=_help(
        "Endpoints to listen on, e.g. [tcp/127.0.0.1:7447]. Empty: open no listener (unless no endpoint at "
        "all is given, where a peer keeps Zenoh's default of listening on every interface)."))
    multicast_scouting: bool | None = field(default=None, metadata=_help(
        "Find peers on the LAN by multicast (224.0.0.224:7446). Unset: off when `connect` endpoints are "
        "given, on otherwise."))
    connect_timeout_s: float | None = field(default=None, metadata=_help(
        "In client mode, how long opening the session waits for one of the `connect` endpoints to answer "
        "before failing (Zenoh retries meanwhile). Unset: 30 s, except that the robot client and the "
        "monitor report a dead endpoint within 2 s. Once connected, a client reconnects by itself."))
    shared_memory: bool = field(default=False, metadata=_help(
        "Zenoh shared memory between processes of one host (payloads over ~3 KB skip the TCP copy). Off by "
        "default: see docs/security.md for what it costs with eclipse-zenoh 1.10."))
    tls_root_ca: str | None = field(default=None, metadata=_help(
        "TLS: the CA certificate (PEM) that signed the peers' certificates. Setting any tls_* file turns TLS "
        "on: every endpoint must then be tls/..."))
    tls_certificate: str | None = field(default=None, metadata=_help(
        "TLS: this node's certificate (PEM); its common name is its identity in the access-control list."))
    tls_private_key: str | None = field(default=None, metadata=_help("TLS: this node's private key (PEM)."))
    tls_mtls: bool = field(default=True, metadata=_help(
        "Mutual TLS: a listener demands a certificate signed by tls_root_ca from every peer."))
    tls_verify_name: bool = field(default=True, metadata=_help(
        "When connecting, check that the listener's certificate names the host of the endpoint and is a "
        "server certificate."))
    max_message_bytes: int = field(default=MAX_MESSAGE_BYTES, metadata=_help(
        "The largest message a link of this session reassembles (Zenoh's transport/link/rx/max_message_size); "
        "a larger one is dropped while it arrives. Default: the protocol's 16 MiB limit plus 64 KiB."))
    access_control_file: str | None = field(default=None, metadata=_help(
        "A JSON5 file holding Zenoh's access_control section (lerobot-zenoh-secure writes acl.json5)."))
    json5_overrides: dict[str, str] = field(default_factory=dict, metadata=_help(
        "Any other Zenoh setting, Zenoh config path -> JSON5 literal, e.g. {transport/link/tx/lease: '10000'}; "
        "applied last."))

    # -- what the defaults resolve to ---------------------------------------------------------

    @property
    def effective_mode(self) -> str:
        if self.mode != "auto":
            return self.mode
        return "client" if (self.connect and not self.listen) else "peer"

    @property
    def effective_scouting(self) -> bool:
        return (not self.connect) if self.multicast_scouting is None else self.multicast_scouting

    @property
    def tls_enabled(self) -> bool:
        return any((self.tls_root_ca, self.tls_certificate, self.tls_private_key))

    def connect_wait_s(self, unset_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> float:
        """How long opening waits for an endpoint in client mode: `connect_timeout_s` when given (any
        value), else `unset_s`."""
        return unset_s if self.connect_timeout_s is None else self.connect_timeout_s

    def replace(self, **changes) -> ZenohSettings:
        return dataclasses.replace(self, **changes)

    def with_connect(self, *endpoints: str | None) -> ZenohSettings:
        """A copy that also connects to `endpoints` (None and duplicates skipped)."""
        connect = list(self.connect)
        connect += [e for e in endpoints if e and e not in connect]
        return self.replace(connect=connect, listen=list(self.listen), json5_overrides=dict(self.json5_overrides))

    def with_files_resolved(self, resolve: Callable[[str], str]) -> ZenohSettings:
        """A copy whose file fields went through `resolve` (e.g. relative to a manifest's folder)."""
        files = ("tls_root_ca", "tls_certificate", "tls_private_key", "access_control_file")
        return self.replace(**{n: resolve(getattr(self, n)) for n in files if getattr(self, n)})

    # -- checks -------------------------------------------------------------------------------

    def validate(self, prefix: str = "zenoh", *, check_files: bool = True) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"{prefix}.mode", f"{self.mode!r} is not one of {', '.join(MODES)}")
        for name in ("listen", "connect"):
            for endpoint in getattr(self, name):
                if not isinstance(endpoint, str) or "/" not in endpoint:
                    raise ConfigError(f"{prefix}.{name}", f"{endpoint!r} is not an endpoint like tcp/127.0.0.1:7447")
                if "," in endpoint or any(ch.isspace() for ch in endpoint):
                    raise ConfigError(f"{prefix}.{name}", f"{endpoint!r} is not one endpoint: give each its own item, "
                                                          "e.g. [tcp/ra:7447, tcp/rb:7447] (several routers)")
        if self.connect_timeout_s is not None and not 0 < self.connect_timeout_s <= 3600:
            raise ConfigError(f"{prefix}.connect_timeout_s", f"must be in (0, 3600], got {self.connect_timeout_s}")
        if not 64 * 1024 <= self.max_message_bytes <= 2**30:
            raise ConfigError(f"{prefix}.max_message_bytes", f"must be in [64 KiB, 1 GiB], got {self.max_message_bytes}")
        if self.mode == "client" and self.listen:
            raise ConfigError(f"{prefix}.listen", "a client never listens: use mode peer (or auto) to listen")
        for path, literal in self.json5_overrides.items():
            if not isinstance(literal, str):
                raise ConfigError(f"{prefix}.json5_overrides.{path}", "value must be a JSON5 literal given as a string")
        self._validate_tls(prefix, check_files)

    def _validate_tls(self, prefix: str, check_files: bool) -> None:
        files = ["access_control_file"]
        if self.tls_enabled:
            files += ["tls_root_ca", "tls_certificate", "tls_private_key"]
            if not self.tls_root_ca:
                raise ConfigError(f"{prefix}.tls_root_ca", "TLS needs the CA certificate that signed the peers' certificates")
            if bool(self.tls_certificate) != bool(self.tls_private_key):
                missing = "tls_private_key" if self.tls_certificate else "tls_certificate"
                raise ConfigError(f"{prefix}.{missing}", "give both tls_certificate and tls_private_key, or neither")
            if self.tls_mtls and not self.tls_certificate:
                raise ConfigError(f"{prefix}.tls_certificate", "mutual TLS (tls_mtls) needs this node's certificate and key")
            for name in ("listen", "connect"):
                for endpoint in getattr(self, name):
                    if not endpoint.startswith("tls/"):
                        raise ConfigError(f"{prefix}.{name}", f"{endpoint!r} is not a tls/ endpoint, and TLS is on: "
                                                              "a plain endpoint would bypass it")
        if not check_files:
            return
        for name in files:
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"{prefix}.{name}", f"{path} is not a readable file")

    # -- the one conversion -------------------------------------------------------------------

    def json5_entries(self) -> list[tuple[str, str]]:
        """(Zenoh config path, JSON5 literal) pairs, in the order they are applied."""
        mode = self.effective_mode
        entries: list[tuple[str, str]] = [
            ("mode", json.dumps(mode)),
            ("scouting/multicast/enabled", json.dumps(self.effective_scouting)),
            ("transport/shared_memory/enabled", json.dumps(self.shared_memory)),
        ]
        # Unset, a peer listens on tcp/[::]:0 (every interface) and a router on tcp/[::]:7447: say
        # "nowhere" explicitly unless no endpoint at all was given (a scouting-only peer).
        if self.listen or self.tls_enabled or self.connect or mode == "client":
            entries.append(("listen/endpoints", json.dumps(list(self.listen))))
        if self.connect:
            entries.append(("connect/endpoints", json.dumps(list(self.connect))))
        if mode == "client":  # Zenoh's default (0) fails at once when the server is not up yet
            entries.append(("connect/timeout_ms", json.dumps(int(self.connect_wait_s() * 1000))))
        # Zenoh queues 2 batches per priority per link and drops (congestion control DROP) after
        # 1 ms when both are taken. Chunks are express (one batch each), so a batch of inferences
        # answered to robots that share a link (a router, one process) overflowed 2 whenever the
        # sending thread was short of CPU: 1-6 % of a 16-chunk burst lost silently with 3 busy
        # processes on 2 cores, none with 16 (docs/reliability.md). Lazily allocated.
        entries.append((f"transport/link/tx/queue/size/{ACTION_TX_PRIORITY}", json.dumps(ACTION_TX_QUEUE_BATCHES)))
        entries.append(("transport/link/rx/max_message_size", json.dumps(int(self.max_message_bytes))))
        entries.extend(self._tls_entries())
        entries.extend(self.json5_overrides.items())
        return entries

    def to_zenoh_config(self):
        """Build the zenoh.Config (imports zenoh lazily so settings stay importable anywhere)."""
        import zenoh

        self.validate()
        config = zenoh.Config()
        for path, literal in self.json5_entries():
            try:
                config.insert_json5(path, literal)
            except Exception as exc:  # zenoh.ZError, or a type error from the binding
                field_name = "zenoh.access_control_file" if path == "access_control" else f"zenoh.{path}"
                raise ConfigError(field_name, f"Zenoh rejected {literal[:200]!r}: {exc}") from exc
        return config

    def _tls_entries(self) -> list[tuple[str, str]]:
        entries: list[tuple[str, str]] = []
        if self.tls_enabled:
            tls = "transport/link/tls"
            entries += [
                ("transport/link/protocols", json.dumps(["tls"])),
                (f"{tls}/root_ca_certificate", json.dumps(self.tls_root_ca)),
                (f"{tls}/enable_mtls", json.dumps(self.tls_mtls)),
                (f"{tls}/verify_name_on_connect", json.dumps(self.tls_verify_name)),
            ]
            if self.tls_certificate:
                for side in ("listen", "connect"):  # one identity whichever side opens the link
                    entries += [(f"{tls}/{side}_certificate", json.dumps(self.tls_certificate)),
                                (f"{tls}/{side}_private_key", json.dumps(self.tls_private_key))]
        if self.access_control_file:
            try:
                entries.append(("access_control", Path(self.access_control_file).read_text()))
            except OSError as exc:
                raise ConfigError("zenoh.access_control_file", f"cannot read {self.access_control_file}: {exc}") from exc
        return entries


def loopback_settings(port: int | None = None, *, listen: bool = True, connect_ports: tuple[int, ...] = ()) -> ZenohSettings:
    """Peer settings confined to 127.0.0.1 with scouting off (tests, the demo): listening on `port`,
    or (listen=False) on a random loopback port, so that such peers also meet each other."""
    return ZenohSettings(
        mode="peer",
        listen=[f"tcp/127.0.0.1:{port if (listen and port is not None) else 0}"],
        connect=[f"tcp/127.0.0.1:{p}" for p in connect_ports],
        multicast_scouting=False,
    )
