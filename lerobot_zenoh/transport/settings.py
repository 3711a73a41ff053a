"""Typed Zenoh settings and their translation into a `zenoh.Config`.

The few settings people change are typed fields; anything else Zenoh offers goes through
`json5_overrides` (a Zenoh config path -> a JSON5 literal), applied last.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

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
        if self.listen:
            entries.append(("listen/endpoints", json.dumps(list(self.listen))))
        if self.connect:
            entries.append(("connect/endpoints", json.dumps(list(self.connect))))
        entries.extend(self.json5_overrides.items())
        for path, literal in entries:
            try:
                config.insert_json5(path, literal)
            except Exception as exc:  # zenoh.ZError, or a type error from the binding
                raise ConfigError(f"zenoh.{path}", f"Zenoh rejected {literal!r}: {exc}") from exc
        return config


def loopback_settings(port: int | None = None, *, listen: bool = True, connect_ports: tuple[int, ...] = ()) -> ZenohSettings:
    """Peer settings confined to 127.0.0.1 with scouting off (tests, the demo)."""
    return ZenohSettings(
        mode="peer",
        listen=[f"tcp/127.0.0.1:{port}"] if (listen and port is not None) else [],
        connect=[f"tcp/127.0.0.1:{p}" for p in connect_ports],
        multicast_scouting=False,
    )
