"""Typed Zenoh settings and their translation into a `zenoh.Config`.

The few settings people change are typed fields; anything else Zenoh offers goes through
`json5_overrides` (a Zenoh config path -> a JSON5 literal), applied last.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from lerobot_zenoh.errors import ConfigError

MODES = ("peer", "client", "router")


@dataclass
class ZenohSettings:
    # "peer" talks to other peers directly; "client" goes through a router; "router" routes.
    mode: str = "peer"
    # Endpoints to listen on, e.g. ["tcp/127.0.0.1:7447"] or ["tls/0.0.0.0:7447"].
    listen: list[str] = field(default_factory=list)
    # Endpoints to connect to, e.g. ["tcp/127.0.0.1:7447"].
    connect: list[str] = field(default_factory=list)
    # Multicast scouting finds peers on the LAN without endpoints; turn it off to stay on loopback.
    multicast_scouting: bool = True
    # Shared memory between processes of one host (payloads over ~3 KB skip the TCP copy).
    shared_memory: bool = True
    # Any other Zenoh setting: config path -> JSON5 literal, e.g. {"transport/link/tx/lease": "10000"}.
    json5_overrides: dict[str, str] = field(default_factory=dict)
    # TLS (docs/security.md): PEM files. Setting any of them turns TLS on: every endpoint must then
    # be tls/..., Zenoh accepts no other protocol, and a peer listens only where `listen` says.
    tls_root_ca: str | None = None  # the CA that signed the peers' certificates
    tls_certificate: str | None = None  # this node's certificate; its common name is its ACL identity
    tls_private_key: str | None = None
    # Mutual TLS: a listener demands a certificate signed by tls_root_ca from every peer.
    tls_mtls: bool = True
    # When connecting, check that the listener's certificate names the host (DNS or IP SAN).
    tls_verify_name: bool = True
    # A JSON5 file holding Zenoh's `access_control` section (lerobot-zenoh-secure writes acl.json5).
    access_control_file: str | None = None

    @property
    def tls_enabled(self) -> bool:
        return any((self.tls_root_ca, self.tls_certificate, self.tls_private_key))

    def validate(self, prefix: str = "zenoh") -> None:
        if self.mode not in MODES:
            raise ConfigError(f"{prefix}.mode", f"{self.mode!r} is not one of {', '.join(MODES)}")
        for name in ("listen", "connect"):
            for endpoint in getattr(self, name):
                if not isinstance(endpoint, str) or "/" not in endpoint:
                    raise ConfigError(f"{prefix}.{name}", f"{endpoint!r} is not an endpoint like tcp/127.0.0.1:7447")
        for path, literal in self.json5_overrides.items():
            if not isinstance(literal, str):
                raise ConfigError(f"{prefix}.json5_overrides.{path}", "value must be a JSON5 literal given as a string")
        self._validate_tls(prefix)

    def _validate_tls(self, prefix: str) -> None:
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
        for name in files:
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"{prefix}.{name}", f"{path} is not a readable file")

    def to_zenoh_config(self):
        """Build the zenoh.Config (imports zenoh lazily so settings stay importable anywhere)."""
        import zenoh

        self.validate()
        config = zenoh.Config()
        entries: list[tuple[str, str]] = [
            ("mode", json.dumps(self.mode)),
            ("scouting/multicast/enabled", json.dumps(self.multicast_scouting)),
            ("transport/shared_memory/enabled", json.dumps(self.shared_memory)),
        ]
        if self.listen or self.tls_enabled:  # unset, a peer listens on tcp/[::]:0 (all interfaces)
            entries.append(("listen/endpoints", json.dumps(list(self.listen))))
        if self.connect:
            entries.append(("connect/endpoints", json.dumps(list(self.connect))))
        entries.extend(self._tls_entries())
        entries.extend(self.json5_overrides.items())
        for path, literal in entries:
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
    """Peer settings confined to 127.0.0.1 with scouting off (tests, the demo)."""
    return ZenohSettings(
        mode="peer",
        listen=[f"tcp/127.0.0.1:{port}"] if (listen and port is not None) else [],
        connect=[f"tcp/127.0.0.1:{p}" for p in connect_ports],
        multicast_scouting=False,
    )
