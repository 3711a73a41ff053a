"""`ZenohSettings` for each identity of a secured deployment, and the files they point at.

Two deployments, and where the ACL is enforced in each (docs/security.md):

- **peer-to-peer** (one server): the server's session listens on `tls/...` with mutual TLS and
  holds the ACL; clients and monitors connect to it in `client` mode, so every message they send
  or receive crosses the server's links and is checked there. Clients never listen and never
  meet each other.
- **router**: a Zenoh router (`zenohd`, or a session in `router` mode) listens on `tls/...` and
  holds the ACL; servers, clients and monitors all connect to it in `client` mode. Use this for
  several servers, or to keep the ACL off the GPU host.

Every node uses mutual TLS with the same CA, has multicast scouting off, and lists its endpoints
explicitly (an unset `listen` would make a peer listen on every interface). Only the server and
the router hold certificates that name the hosts robots and monitors dial (security/pki.py); an
engine's names only where its scheduler dials it (`check_engine_names` keeps the two apart);
robots and monitors hold client-only certificates and verify the listener they connect to.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.transport.settings import MAX_MESSAGE_BYTES, ZenohSettings

WILDCARD_HOSTS = ("0.0.0.0", "[::]", "::")
#: What every session reassembles at most (`ZenohSettings.max_message_bytes`, secured or not).
RX_MAX_MESSAGE_BYTES = MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class PkiLayout:
    """Where `lerobot-zenoh-secure init` writes a deployment's files (one folder)."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def acl(self) -> Path:
        return self.root / "acl.json5"

    def cert(self, name: str) -> Path:
        return self.root / f"{name}.pem"

    def key(self, name: str) -> Path:
        return self.root / f"{name}.key"

    def tls(self, name: str) -> dict:
        """The TLS fields of ZenohSettings for identity `name`."""
        return {"tls_root_ca": str(self.ca_cert), "tls_certificate": str(self.cert(name)),
                "tls_private_key": str(self.key(name)), "tls_mtls": True}


def tls_endpoint(endpoint: str) -> str:
    """`tcp/host:port` -> `tls/host:port`; a `tls/` endpoint is kept; anything else is refused."""
    proto, sep, address = endpoint.partition("/")
    if not sep or not address:
        raise ConfigError("endpoint", f"{endpoint!r} is not an endpoint like tcp/127.0.0.1:7447")
    if proto not in ("tcp", "tls"):
        raise ConfigError("endpoint", f"{endpoint!r}: only tcp/ endpoints can be moved to tls/")
    return f"tls/{address}"


def host_of(endpoint: str) -> str:
    """The host of `proto/host:port` (brackets of an IPv6 literal removed)."""
    address = endpoint.partition("/")[2].split("#", 1)[0]
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def connect_endpoint(listen_endpoint: str, host: str) -> str:
    """Where a peer connects to reach `listen_endpoint` (a wildcard host is replaced by `host`)."""
    endpoint = tls_endpoint(listen_endpoint)
    address = endpoint.partition("/")[2]
    listen_host, _, port = address.rpartition(":")
    if listen_host in WILDCARD_HOSTS:
        listen_host = f"[{host}]" if ":" in host else host
    return f"tls/{listen_host}:{port}"


def check_host_names(hosts: list[str], identities: dict[str, str]) -> None:
    """Refuse host names a certificate must not carry: empty, wildcard, or equal to the id of a
    client, monitor or engine (a TLS stack that falls back to the common name would then take that
    identity's certificate for the server's)."""
    by_id = {name.lower(): (name, role) for name, role in identities.items()}
    for host in hosts:
        if not host or any(ch.isspace() for ch in host) or "*" in host or host in WILDCARD_HOSTS:
            raise ConfigError("host", f"{host!r} is not a host name or address a client can dial")
        name, role = by_id.get(host.lower(), (None, None))
        if role in ("client", "monitor", "engine"):
            raise ConfigError("host", f"{host!r} is a host name of a certificate and also the id of {role} {name!r}: "
                                      "rename one of them")


@dataclass(frozen=True)
class DialledName:
    """A host name (or address) a certificate will carry, and the setting it comes from."""

    host: str
    field: str  # the setting that names it, for the error message: `zenoh.listen`, `engines[gpu1].endpoint`, `host`
    source: str | None = None  # the manifest file it is in, if any


def check_engine_names(engine_names: dict[str, list[DialledName]], dialled: dict[str, list[DialledName]]) -> None:
    """Refuse an engine name that a server or router certificate also carries.

    `dialled` maps each server and router id to the names its certificate carries (the names robots
    and monitors dial); `engine_names` maps each engine id to the names its scheduler dials it by.
    With one name on both, the engine's certificate would be accepted by a robot dialling the
    server, so its holder could pose as the server. TLS compares names literally (`localhost` and
    `127.0.0.1` are two names), and so does this check.
    """
    owner = {n.host.lower(): ident for ident, names in dialled.items() for n in names}
    for engine_id, names in engine_names.items():
        for name in names:
            if name.host.lower() in owner:
                raise ConfigError(name.field, f"engine {engine_id!r} would be dialled at {name.host!r}, a name the "
                                              f"certificate of {owner[name.host.lower()]!r} carries (robots dial it): "
                                              "an engine certificate naming it could pose as that server; give the "
                                              "engine an address or host name of its own (on one Linux host e.g. "
                                              "tls/127.0.0.2:<port>)", source=name.source)


def server_settings(layout: PkiLayout, server_id: str, listen: list[str], *,
                    router: str | list[str] | None = None) -> ZenohSettings:
    """The policy server: listens and enforces the ACL, or (with `router`: one endpoint, or the
    endpoints of several routers) connects to a router, moving to the next one when its link drops."""
    if router is not None:
        routers = [router] if isinstance(router, str) else list(router)
        return ZenohSettings(mode="client", connect=routers, multicast_scouting=False, **layout.tls(server_id))
    if not listen:
        raise ConfigError("zenoh.listen", "a peer-to-peer secured server must listen on a tls/ endpoint")
    return ZenohSettings(mode="peer", listen=[tls_endpoint(e) for e in listen], multicast_scouting=False,
                         access_control_file=str(layout.acl), **layout.tls(server_id))


def member_settings(layout: PkiLayout, name: str, connect: list[str]) -> ZenohSettings:
    """A robot client or a monitor: `client` mode, so it only ever talks through the enforcing node."""
    return ZenohSettings(mode="client", connect=list(connect), multicast_scouting=False, **layout.tls(name))


def router_settings(layout: PkiLayout, name: str, listen: list[str], connect: list[str] = ()) -> ZenohSettings:
    """A router that enforces the ACL for everyone connected to it; `connect`: the other routers of its
    mesh (each router lists the others, so a restarted one joins again by itself)."""
    return ZenohSettings(mode="router", listen=[tls_endpoint(e) for e in listen], connect=list(connect),
                         multicast_scouting=False, access_control_file=str(layout.acl), **layout.tls(name))
