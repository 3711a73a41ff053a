"""The exception tree of lerobot-zenoh. Imports nothing of ours.

    LeRobotZenohError
    ├── ConfigError            a setting or manifest is invalid (names the field)
    ├── KeyExprError           a key-expression chunk is empty or uses a reserved character
    ├── ProtocolError          bytes that are not a valid message (carries a short `reason`)
    │   └── VersionError       a message of a protocol version we do not speak (another major, or
    │                          a minor older than its message type's minimum)
    ├── TransportError         Zenoh refused to open, declare, put or get (raised from zenoh.ZError)
    │   └── TlsRefusedError    a TLS handshake with an endpoint fails: the listener's certificate, or ours, is refused
    ├── CompatibilityError     a server's capabilities do not match the robot (client start-up)
    └── PolicyError            a checkpoint cannot be loaded or a policy cannot run

Foreign errors are mapped at the boundary with ``raise ... from exc``: callers catch ours only.
"""

from __future__ import annotations


class LeRobotZenohError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(LeRobotZenohError, ValueError):
    """A configuration value is invalid. `field` is the dotted path of the offending setting."""

    def __init__(self, field: str, message: str, *, source: str | None = None):
        self.field = field
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{field}: {message}")


class KeyExprError(LeRobotZenohError, ValueError):
    """A key-expression chunk is empty or contains a character Zenoh reserves."""

    def __init__(self, field: str, value: str, why: str):
        self.field = field
        self.value = value
        super().__init__(f"{field}={value!r}: {why}")


class ProtocolError(LeRobotZenohError, ValueError):
    """A byte string is not a valid message. `reason` is a short machine-friendly tag."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


class VersionError(ProtocolError):
    """The message declares a protocol version this build does not read: another major version, or a
    minor older than its message type's minimum (docs/protocol.md §4.2)."""


class TransportError(LeRobotZenohError, RuntimeError):
    """Zenoh failed to open a session or to declare/put/get."""


class TlsRefusedError(TransportError):
    """Something listens at a `tls/` endpoint, but the TLS handshake with it fails: its certificate is
    refused (another CA, no name for the host dialled, not a server certificate) or it refused ours."""


class CompatibilityError(LeRobotZenohError):
    """A server's announced capabilities do not match the robot's features."""


class PolicyError(LeRobotZenohError, RuntimeError):
    """A policy checkpoint is missing, unreadable, inconsistent, or failed to run."""
