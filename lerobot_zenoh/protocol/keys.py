"""Every key expression of lerobot-zenoh is built and parsed here.

Schema (docs/protocol.md §2)::

    <cluster>/<experiment>/<model>/<version>/<app>/<client>/<topic>     topic in {obs, action, metrics, text, verdict}
    <cluster>/<experiment>/<model>/<version>/<app>/status               queryable: Status
    <cluster>/<experiment>/<model>/<version>/<app>/*/obs                the server's subscription
    <cluster>/<experiment>/<model>/<version>/<app>/server/<id>/metrics  server telemetry
    <cluster>/<experiment>/<model>/<version>/<app>/server/<id>          server liveliness token
    <cluster>/<experiment>/_pipeline/1/<task>/<client>/obs/c<i>/c<j>     a multi-model task's observation,
                                                                        with a chunk per component it asks

A chunk is one path segment. It must be non-empty and must not contain any character Zenoh
reserves (``/ * $ ? # @``) or whitespace; otherwise a ``KeyExprError`` names the field and value.
``server``, ``status`` and ``engine`` are reserved and cannot be used as client ids, and a client
id is at most ``MAX_CLIENT_ID_BYTES`` (128) bytes of UTF-8: a server keeps ids (in its sessions,
its parsed-key cache and its counters), so their size is bounded before any of that.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from lerobot_zenoh.errors import KeyExprError
from lerobot_zenoh.protocol.messages import MAX_COMPONENTS
from lerobot_zenoh.protocol.reasons import OutputKind

RESERVED_CHARS = frozenset("/*$?#@")
RESERVED_CLIENT_IDS = frozenset({"server", "status", "engine"})  # engine: the dispatch keys (protocol/dispatch.py)

#: The longest client id, in bytes of UTF-8 (docs/protocol.md §2.3). A server refuses an observation
#: whose key names a longer one before it parses the rest of the key or keeps anything of it.
MAX_CLIENT_ID_BYTES = 128

STATUS = "status"
SERVER = "server"
HEARTBEAT = "heartbeat"

#: Selector that matches the telemetry of every server and client of every cluster.
ALL_METRICS = "**/metrics"


class Topic(StrEnum):
    OBS = "obs"
    ACTION = "action"
    METRICS = "metrics"
    TEXT = "text"  # a System 2 component's TextResult
    VERDICT = "verdict"  # a safety or monitor component's Verdict


#: The client topic a server answers on, by what it answers (`Status.output`).
ANSWER_TOPICS: dict[OutputKind, Topic] = {OutputKind.ACTIONS: Topic.ACTION, OutputKind.TEXT: Topic.TEXT,
                                          OutputKind.VERDICT: Topic.VERDICT}


def validate_chunk(field: str, value: str) -> str:
    """Return `value` if it is a valid key-expression chunk, else raise KeyExprError naming `field`."""
    if not isinstance(value, str):
        raise KeyExprError(field, str(value), "must be a string")
    if value == "":
        raise KeyExprError(field, value, "must not be empty")
    for ch in value:
        if ch in RESERVED_CHARS:
            raise KeyExprError(field, value, f"contains {ch!r}, which Zenoh reserves (/ * $ ? # @)")
        if ch.isspace():
            raise KeyExprError(field, value, "contains whitespace")
    return value


def validate_client_id(field: str, value: str) -> str:
    # Length first: the character checks below walk the whole string.
    if isinstance(value, str) and len(value) > MAX_CLIENT_ID_BYTES // 4 and len(value.encode()) > MAX_CLIENT_ID_BYTES:
        raise KeyExprError(field, _shortened(value), f"is {len(value.encode())} bytes of UTF-8, a client id has at most "
                                                     f"{MAX_CLIENT_ID_BYTES}")
    validate_chunk(field, value)
    if value in RESERVED_CLIENT_IDS:
        raise KeyExprError(field, value, f"is reserved ({', '.join(sorted(RESERVED_CLIENT_IDS))})")
    return value


def _shortened(value: str) -> str:
    return value if len(value) <= 40 else f"{value[:40]}... ({len(value)} characters)"


def client_chunk_too_long(key: str) -> bool:
    """Whether the sixth chunk of `key` (where a client key names its client, after the five of the
    app prefix) is longer than `MAX_CLIENT_ID_BYTES`, found without reading the key past it: what a
    server checks first of an observation's key, before looking it up, parsing it or keeping it.
    False for a key with fewer chunks (`parse_key` refuses it)."""
    start = 0
    for _ in range(5):
        start = key.find("/", start) + 1
        if start == 0:
            return False
    end = key.find("/", start, start + MAX_CLIENT_ID_BYTES + 1)
    if end < 0:  # no "/" within the limit: the chunk runs past it, or it is the key's last chunk
        end = len(key) if len(key) - start <= MAX_CLIENT_ID_BYTES else -1
    if end < 0:
        return True
    # Within MAX_CLIENT_ID_BYTES characters; UTF-8 may still take more bytes.
    return end - start > MAX_CLIENT_ID_BYTES // 4 and len(key[start:end].encode()) > MAX_CLIENT_ID_BYTES


@dataclass(frozen=True)
class AppKey:
    """The five chunks that name one served application: cluster/experiment/model/version/app."""

    cluster: str
    experiment: str
    model: str
    version: str
    app: str

    def __post_init__(self) -> None:
        for name in ("cluster", "experiment", "model", "version", "app"):
            validate_chunk(name, getattr(self, name))

    @property
    def prefix(self) -> str:
        return f"{self.cluster}/{self.experiment}/{self.model}/{self.version}/{self.app}"

    @property
    def status(self) -> str:
        return f"{self.prefix}/{STATUS}"

    @property
    def all_observations(self) -> str:
        """What a server subscribes to: every client's observations for this app."""
        return f"{self.prefix}/*/{Topic.OBS}"

    def component_observations(self, bit: int) -> str:
        """A multi-model task stream's observations that ask component `bit` (their key has its chunk,
        `ClientKey.obs_for`): what that component's server subscribes to besides `all_observations`,
        so that a router sends it only those."""
        return f"{self.prefix}/*/{Topic.OBS}/**/{component_chunk(bit)}/**"

    @property
    def all_client_tokens(self) -> str:
        """Liveliness selector for every client of this app (a client's token is its metrics key)."""
        return f"{self.prefix}/*/{Topic.METRICS}"

    @property
    def all_servers(self) -> str:
        """Liveliness selector for every server of this app."""
        return f"{self.prefix}/{SERVER}/*"

    def client(self, client_id: str) -> ClientKey:
        return ClientKey(self, client_id)

    def server_token(self, server_id: str) -> str:
        validate_chunk("server_id", server_id)
        return f"{self.prefix}/{SERVER}/{server_id}"

    def server_metrics(self, server_id: str) -> str:
        return f"{self.server_token(server_id)}/{Topic.METRICS}"

    def server_heartbeat(self, server_id: str) -> str:
        """A server's heartbeat of served work, several times a second (hot standby, docs/reliability.md)."""
        return f"{self.server_token(server_id)}/{HEARTBEAT}"

    @property
    def all_server_heartbeats(self) -> str:
        return f"{self.prefix}/{SERVER}/*/{HEARTBEAT}"


@dataclass(frozen=True)
class ClientKey:
    """One client of one application."""

    app: AppKey
    client_id: str

    def __post_init__(self) -> None:
        validate_client_id("client_id", self.client_id)

    def topic(self, topic: Topic | str) -> str:
        return f"{self.app.prefix}/{self.client_id}/{Topic(topic)}"

    @property
    def obs(self) -> str:
        return self.topic(Topic.OBS)

    def obs_for(self, component_mask: int | None) -> str:
        """The key of an observation asking the components of `component_mask` on a multi-model
        task's stream: `obs` and one chunk per bit set, lowest first (``.../obs/c0/c2`` for 0b101),
        so that Zenoh routes it only towards the servers of those components. None: `obs`."""
        if component_mask is None:
            return self.obs
        return "/".join([self.obs, *(component_chunk(b) for b in mask_bits(component_mask))])

    @property
    def action(self) -> str:
        return self.topic(Topic.ACTION)

    @property
    def metrics(self) -> str:
        return self.topic(Topic.METRICS)

    @property
    def text(self) -> str:
        return self.topic(Topic.TEXT)

    @property
    def verdict(self) -> str:
        return self.topic(Topic.VERDICT)


@dataclass(frozen=True)
class ParsedKey:
    app: AppKey
    client_id: str | None  # None for status and server keys
    server_id: str | None
    topic: str  # "obs" | "action" | "metrics" | "status" | "server" | "heartbeat"
    component_mask: int | None = None  # an observation key's component chunks (`ClientKey.obs_for`)


def component_chunk(bit: int) -> str:
    if not (isinstance(bit, int) and 0 <= bit < MAX_COMPONENTS):
        raise KeyExprError("component bit", str(bit), f"must be an integer in [0, {MAX_COMPONENTS})")
    return f"c{bit}"


def mask_bits(mask: int) -> list[int]:
    """The bits set in a component mask, lowest first (KeyExprError for 0 or a bit past the last)."""
    if not (isinstance(mask, int) and 0 < mask < 1 << MAX_COMPONENTS):
        raise KeyExprError("component_mask", str(mask), f"must be in [1, 2**{MAX_COMPONENTS})")
    return [b for b in range(MAX_COMPONENTS) if mask >> b & 1]


def names_components(key: str, bits: tuple[int, ...]) -> bool:
    """Whether an observation key (`ClientKey.obs_for`) names any of `bits` (cheap: no full parse)."""
    if not bits:
        return False
    _, sep, suffix = key.rpartition(f"/{Topic.OBS}/")  # (the last: component chunks are never "obs")
    return bool(sep) and any(component_chunk(b) in suffix.split("/") for b in bits)


def _component_mask(key: str, chunks: list[str]) -> int:
    """The mask an observation key's component chunks name: `c<bit>` each, strictly increasing, so
    that one mask has one key (KeyExprError otherwise)."""
    mask, last = 0, -1
    for chunk in chunks:
        digits = chunk[1:]  # ASCII digits only: "c²" is a digit to str.isdigit and not to int()
        bit = int(digits) if chunk[:1] == "c" and digits.isascii() and digits.isdigit() and digits == str(int(digits)) else -1
        if not last < bit < MAX_COMPONENTS:
            raise KeyExprError("key", key, f"component chunks after obs must be c<bit>, increasing, bit < {MAX_COMPONENTS}")
        mask |= 1 << bit
        last = bit
    return mask


#: The model and version chunks of a multi-model task's observation stream (docs/pipelines.md).
PIPELINE_MODEL = "_pipeline"
PIPELINE_VERSION = "1"


def pipeline_app(cluster: str, experiment: str, task: str) -> AppKey:
    """Where the robots of a multi-model task publish each observation once, for every component:
    ``<cluster>/<experiment>/_pipeline/1/<task>/<robot>/obs`` (their liveliness tokens at
    ``.../<robot>/metrics``). Each component's server subscribes here and answers on its own app key."""
    return AppKey(cluster, experiment, PIPELINE_MODEL, PIPELINE_VERSION, task)


#: The manifest's (and the robot client's) names for an application's five chunks, in key order.
APP_FIELDS = ("cluster_uuid", "experiment_tag", "model_id", "model_version", "application_tag")


def status_selector(cluster: str | None = None, experiment: str | None = None, model: str | None = None,
                    version: str | None = None, app: str | None = None) -> str:
    """The status key of every application that fits the chunks given (None: any), e.g.
    ``*/*/act/*/*/status``: one query lists what an endpoint serves (docs/client.md, "Finding the server")."""
    chunks = []
    for name, value in (("cluster", cluster), ("experiment", experiment), ("model", model), ("version", version),
                        ("app", app)):
        chunks.append("*" if value is None else validate_chunk(name, value))
    return "/".join(chunks) + f"/{STATUS}"


def parse_key(key: str) -> ParsedKey:
    """Parse any concrete key of the schema; raise KeyExprError if it does not fit."""
    if not isinstance(key, str):
        raise KeyExprError("key", str(key), "must be a string")
    parts = key.split("/")
    if len(parts) < 6:
        raise KeyExprError("key", key, "has fewer than 6 chunks")
    app = AppKey(*parts[:5])
    rest = parts[5:]
    if rest == [STATUS]:
        return ParsedKey(app, None, None, STATUS)
    if rest[0] == SERVER:
        if len(rest) == 2:
            return ParsedKey(app, None, validate_chunk("server_id", rest[1]), SERVER)
        if len(rest) == 3 and rest[2] == Topic.METRICS:
            return ParsedKey(app, None, validate_chunk("server_id", rest[1]), Topic.METRICS.value)
        if len(rest) == 3 and rest[2] == HEARTBEAT:  # its sender is this server id (the ACL's identity)
            return ParsedKey(app, None, validate_chunk("server_id", rest[1]), HEARTBEAT)
        raise KeyExprError("key", key, "is not a server token, server metrics or heartbeat key")
    if len(rest) > 2 and rest[1] == Topic.OBS:  # a multi-model task's observation, with its components
        validate_client_id("client_id", rest[0])
        return ParsedKey(app, rest[0], None, Topic.OBS.value, _component_mask(key, rest[2:]))
    if len(rest) != 2:
        raise KeyExprError("key", key, "must be <app prefix>/<client>/<topic>")
    client_id, topic = rest
    validate_client_id("client_id", client_id)
    try:
        topic = Topic(topic).value
    except ValueError:
        raise KeyExprError("topic", topic, f"must be one of {[t.value for t in Topic]}") from None
    return ParsedKey(app, client_id, None, topic)


def parse_client_key(key: str, expected_topic: Topic | str | None = None) -> tuple[AppKey, str]:
    """Return (app, client_id) of a client key, checking its topic when given."""
    parsed = parse_key(key)
    if parsed.client_id is None:
        raise KeyExprError("key", key, "is not a client key")
    if expected_topic is not None and parsed.topic != Topic(expected_topic):
        raise KeyExprError("topic", parsed.topic, f"expected {Topic(expected_topic).value}")
    return parsed.app, parsed.client_id
