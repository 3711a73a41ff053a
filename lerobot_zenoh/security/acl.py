"""Zenoh `access_control` generated from manifests: who may put, subscribe, query and declare what.

Zenoh enforces an ACL in the node whose config holds it, on the messages that cross that node's
links (a local publisher and subscriber in the same session are never filtered). Each message is
checked against the remote peer, identified by the common name of its TLS certificate (mTLS), in
one of two directions: `ingress` (the remote sends it to us) and `egress` (we send it to the
remote). With `default_permission: deny`, anything not allowed below is dropped.

Grants, per identity, from the enforcing node's point of view (`P` = an app prefix
`<cluster>/<experiment>/<model>/<version>/<app>`, `c` = a client id, `s` = a server id):

    client c of P   ingress  put                            P/c/obs, P/c/metrics
                    ingress  declare_subscriber             P/c/action
                    ingress  query                          P/status
                    ingress  liveliness_token               P/c/metrics         (its presence)
                    ingress  declare_liveliness_subscriber  P/server/*          (server loss)
                    ingress  liveliness_query               P/server/*
                    egress   put                            P/c/action
                    egress   reply                          P/status
                    egress   liveliness_token               P/server/*
                    egress   declare_subscriber             P/*/obs, P/c/obs, **/metrics, P/c/metrics
                    egress   declare_queryable              P/status
    server s of P   ingress  declare_subscriber             P/*/obs, P/server/*/heartbeat
                    ingress  put                            P/*/action, P/server/s/metrics, P/server/s/heartbeat
                    ingress  declare_queryable, reply       P/status
                    ingress  liveliness_token               P/server/s
                    ingress  declare_liveliness_subscriber  P/server/*, P/*/metrics  (hot standby, handover;
                    ingress  liveliness_query               P/server/*, P/*/metrics   client sessions)
                    egress   put                            P/*/obs, P/server/*/heartbeat
                    egress   query                          P/status
                    egress   liveliness_token               P/server/*, P/*/metrics
                    egress   declare_subscriber             P/*/action, **/metrics, P/server/s/metrics,
                                                            P/server/*/heartbeat
    engine e of P   ingress  declare_subscriber             E/dispatch          (E = P/engine/e: its keys only)
                    ingress  put                            E/answer
                    ingress  declare_queryable, reply       E/status
                    ingress  liveliness_token               E
                    egress   put                            E/dispatch
                    egress   query                          E/status
                    egress   declare_subscriber             E/answer
                    egress   declare_liveliness_subscriber, liveliness_query   E
    server s of P   (with engines e, each E as above)
                    ingress  put                            E/dispatch
                    ingress  declare_subscriber             E/answer
                    ingress  query                          E/status
                    ingress  declare_liveliness_subscriber, liveliness_query   E
                    egress   put                            E/answer
                    egress   reply                          E/status
                    egress   liveliness_token               E
                    egress   declare_subscriber             E/dispatch
                    egress   declare_queryable              E/status
    monitor m       ingress  declare_subscriber             **/metrics
                    ingress  declare_liveliness_subscriber, liveliness_query   **
                    egress   put                            **/metrics
                    egress   liveliness_token               **

The egress `declare_*` grants only let a remote learn that a matching subscriber or queryable
exists: a `peer`-mode remote sends a put only towards a subscriber it knows of (measured with
Zenoh 1.10: without them, a peer-mode client's observations never leave it; `client`-mode
remotes do not need them). They reveal key expressions, never data.

An engine (docs/server.md, "Engines") is named by its `engine_id` (its certificate's common name)
and reaches only its own keys `E`. It subscribes to no robot key, but it receives every observation
its scheduler dispatches to it (the robot's observation bytes inside each request on `E/dispatch`),
and its answers on `E/answer` become those robots' chunks once the scheduler has checked them: for
the requests placed on it, it is trusted like a server. It never sees the observations placed
elsewhere, and no robot reaches an engine key (nothing grants a client anything under `P/engine`).

Server grants matter when a router enforces the ACL (servers connect to it); in a peer-to-peer
deployment the server's own session enforces it and its own entities are local. Several routers,
meshed, each enforce the same ACL on their own clients' links and pass everything to one another
(`with_router_mesh`).

Clients are named one by one (ACL subjects are certificate common names; Zenoh cannot derive a
key from a name), so a client accepted through `accept_unknown_clients` must still be listed
here (`extra_clients`) to get through an ACL.

A model that answers text or verdicts (a task component, docs/pipelines.md) has `P/c/text` or
`P/c/verdict` where the table says `action`. One serving components of multi-model tasks (a
`pipeline` block) also gets, for each task stream `T` = `<cluster>/<experiment>/_pipeline/1/<task>`:
its client c may put `T/c/obs` and `T/c/metrics` and declare its token `T/c/metrics` (egress: the
routes `T/*/obs`, `T/c/obs`); its server may subscribe to `T/*/obs` and watch `T/*/metrics` (egress:
`T/*/obs` puts and `T/*/metrics` tokens). A robot can still only publish its own observations.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.protocol.dispatch import EngineKeys
from lerobot_zenoh.protocol.keys import ALL_METRICS, ANSWER_TOPICS, AppKey, validate_chunk, validate_client_id
from lerobot_zenoh.protocol.reasons import OutputKind

INGRESS = ["ingress"]
EGRESS = ["egress"]
#: Selector of every liveliness token (the monitor CLI watches `**`).
ALL = "**"


@dataclass(frozen=True)
class AppGrant:
    """One served app: its key prefix, the clients it serves and the servers that serve it."""

    app: AppKey
    clients: tuple[str, ...]
    servers: tuple[str, ...]
    topic: str = "action"  # what the app answers on: action, text (System 2) or verdict (safety, monitor)
    streams: tuple[AppKey, ...] = ()  # the task observation streams its model also serves (pipeline)
    engines: tuple[str, ...] = ()  # engine processes its servers dispatch to (their engine_id)


@dataclass(frozen=True)
class Deployment:
    """Everything the ACL is generated from: apps (with clients and servers) and monitors."""

    apps: tuple[AppGrant, ...]
    monitors: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.identities  # validates every id and that each names one role

    @property
    def identities(self) -> dict[str, str]:
        """common name -> role ("server", "client", "engine" or "monitor"), in declaration order."""
        roles: dict[str, str] = {}
        for grant in self.apps:
            for s in grant.servers:
                _claim(roles, validate_chunk("server_id", s), "server")
            for c in grant.clients:
                _claim(roles, validate_client_id("client_uuid", c), "client")
            for e in grant.engines:
                _claim(roles, validate_chunk("engine_id", e), "engine")
        for m in self.monitors:
            _claim(roles, validate_chunk("monitor", m), "monitor")
        return roles

    @classmethod
    def from_manifests(cls, manifests: Iterable, monitors: Iterable[str] = (),
                       extra_clients: Mapping[str, Iterable[str]] | None = None) -> Deployment:
        """Apps of every manifest entry, its listed clients, and that manifest's `server_id`.

        `extra_clients` maps an app prefix (or `*` for every app) to more client ids, for clients
        a manifest admits through `accept_unknown_clients` without listing them.
        """
        extra = {k: list(v) for k, v in (extra_clients or {}).items()}
        merged: dict[AppKey, tuple[list[str], list[str]]] = {}
        answers: dict[AppKey, tuple[str, list[AppKey]]] = {}
        engines: dict[AppKey, list[str]] = {}
        for manifest in manifests:
            for entry in manifest.server:
                app = manifest.app_key(entry)
                # engines: those a scheduler lists, and an engine process's own manifest (`role: engine`)
                listed = engines.setdefault(app, [])
                for engine_id in [e.engine_id for e in entry.engines if not e.local] + (
                        [manifest.engine_id] if manifest.role == "engine" else []):
                    if engine_id not in listed:
                        listed.append(engine_id)
                if manifest.role == "engine":
                    continue
                topic, streams = answers.setdefault(app, (_answer_topic(entry), []))
                streams += [k for k in (manifest.pipeline_key(i) for i in entry.pipeline) if k not in streams]
                clients, servers = merged.setdefault(app, ([], []))
                for cid in [c.client_uuid for c in entry.clients] + extra.get(app.prefix, []) + extra.get("*", []):
                    if cid not in clients:
                        clients.append(cid)
                if manifest.server_id not in servers:
                    servers.append(manifest.server_id)
        unknown = set(extra) - {"*"} - {app.prefix for app in merged}
        if unknown:
            raise ConfigError("extra_clients", f"no manifest serves {sorted(unknown)}")
        for app in engines.keys() - merged.keys():  # an engine's manifest alone: no clients, no servers
            merged[app] = ([], [])
            answers[app] = ("action", [])
        apps = tuple(AppGrant(app, tuple(c), tuple(s), answers[app][0], tuple(answers[app][1]),
                              tuple(engines.get(app, ()))) for app, (c, s) in merged.items())
        return cls(apps, tuple(dict.fromkeys(monitors)))


@dataclass
class _Builder:
    rules: list[dict] = field(default_factory=list)
    policies: dict[str, list[str]] = field(default_factory=dict)  # subject id -> rule ids

    def allow(self, subject: str, rule_id: str, flows: list[str], messages: list[str], key_exprs: list[str]) -> None:
        self.rules.append({"id": rule_id, "permission": "allow", "flows": list(flows),
                           "messages": list(messages), "key_exprs": list(dict.fromkeys(key_exprs))})
        self.policies.setdefault(subject, []).append(rule_id)


def access_control(deployment: Deployment) -> dict:
    """The value of Zenoh's `access_control` config section for `deployment` (deny by default)."""
    b = _Builder()
    for grant in deployment.apps:
        p, app, topic, streams = grant.app.prefix, grant.app, grant.topic, grant.streams
        for c in grant.clients:
            key = app.client(c)
            own = [stream.client(c) for stream in streams]  # its keys on the task streams
            # On a task stream an observation's key names the components it asks (`ClientKey.obs_for`).
            own_obs = [k for o in own for k in (o.obs, f"{o.obs}/**")]
            rid = f"client/{c}@{p}"
            b.allow(c, f"{rid}/put", INGRESS, ["put"], [key.obs, key.metrics, *own_obs, *(o.metrics for o in own)])
            b.allow(c, f"{rid}/subscribe", INGRESS, ["declare_subscriber"], [key.topic(topic)])
            b.allow(c, f"{rid}/query", INGRESS, ["query"], [app.status])
            b.allow(c, f"{rid}/token", INGRESS, ["liveliness_token"], [key.metrics, *(o.metrics for o in own)])
            b.allow(c, f"{rid}/watch", INGRESS, ["declare_liveliness_subscriber", "liveliness_query"], [app.all_servers])
            b.allow(c, f"{rid}/receive", EGRESS, ["put"], [key.topic(topic)])
            b.allow(c, f"{rid}/reply", EGRESS, ["reply"], [app.status])
            b.allow(c, f"{rid}/tokens", EGRESS, ["liveliness_token"], [app.all_servers])
            b.allow(c, f"{rid}/routes", EGRESS, ["declare_subscriber"],
                    [app.all_observations, key.obs, ALL_METRICS, key.metrics, *own_obs,
                     *(k for stream in streams for k in (stream.all_observations, f"{stream.all_observations}/**"))])
            b.allow(c, f"{rid}/routes-status", EGRESS, ["declare_queryable"], [app.status])
        for s in grant.servers:
            rid = f"server/{s}@{p}"
            observations = [app.all_observations,
                            *(k for stream in streams for k in (stream.all_observations, f"{stream.all_observations}/**"))]
            tokens = [app.all_client_tokens, *(stream.all_client_tokens for stream in streams)]
            b.allow(s, f"{rid}/subscribe", INGRESS, ["declare_subscriber"], observations)
            b.allow(s, f"{rid}/put", INGRESS, ["put"], [f"{p}/*/{topic}", app.server_metrics(s), app.server_heartbeat(s)])
            # the heartbeats of served work the servers of one app exchange (a hot standby's watch)
            b.allow(s, f"{rid}/heartbeats", INGRESS, ["declare_subscriber"], [app.all_server_heartbeats])
            b.allow(s, f"{rid}/heartbeats-in", EGRESS, ["put"], [app.all_server_heartbeats])
            b.allow(s, f"{rid}/heartbeats-route", EGRESS, ["declare_subscriber"], [app.all_server_heartbeats])
            b.allow(s, f"{rid}/status", INGRESS, ["declare_queryable", "reply"], [app.status])
            b.allow(s, f"{rid}/token", INGRESS, ["liveliness_token"], [app.server_token(s)])
            b.allow(s, f"{rid}/watch", INGRESS, ["declare_liveliness_subscriber", "liveliness_query"],
                    [app.all_servers, *tokens])
            b.allow(s, f"{rid}/tokens", EGRESS, ["liveliness_token"], [app.all_servers, *tokens])
            b.allow(s, f"{rid}/receive", EGRESS, ["put"], observations)
            b.allow(s, f"{rid}/query", EGRESS, ["query"], [app.status])
            b.allow(s, f"{rid}/routes", EGRESS, ["declare_subscriber"],
                    [f"{p}/*/{topic}", ALL_METRICS, app.server_metrics(s)])
            keys = [EngineKeys(app, e) for e in grant.engines]
            if keys:
                b.allow(s, f"{rid}/engine-dispatch", INGRESS, ["put"], [k.dispatch for k in keys])
                b.allow(s, f"{rid}/engine-answers", INGRESS, ["declare_subscriber"], [k.answer for k in keys])
                b.allow(s, f"{rid}/engine-probe", INGRESS, ["query"], [k.status for k in keys])
                b.allow(s, f"{rid}/engine-watch", INGRESS, ["declare_liveliness_subscriber", "liveliness_query"],
                        [k.token for k in keys])
                b.allow(s, f"{rid}/engine-receive", EGRESS, ["put"], [k.answer for k in keys])
                b.allow(s, f"{rid}/engine-reply", EGRESS, ["reply"], [k.status for k in keys])
                b.allow(s, f"{rid}/engine-tokens", EGRESS, ["liveliness_token"], [k.token for k in keys])
                b.allow(s, f"{rid}/engine-routes", EGRESS, ["declare_subscriber"], [k.dispatch for k in keys])
                b.allow(s, f"{rid}/engine-routes-status", EGRESS, ["declare_queryable"], [k.status for k in keys])
        for e in grant.engines:
            k = EngineKeys(app, e)
            rid = f"engine/{e}@{p}"
            b.allow(e, f"{rid}/subscribe", INGRESS, ["declare_subscriber"], [k.dispatch])
            b.allow(e, f"{rid}/put", INGRESS, ["put"], [k.answer])
            b.allow(e, f"{rid}/status", INGRESS, ["declare_queryable", "reply"], [k.status])
            b.allow(e, f"{rid}/token", INGRESS, ["liveliness_token"], [k.token])
            b.allow(e, f"{rid}/receive", EGRESS, ["put"], [k.dispatch])
            b.allow(e, f"{rid}/query", EGRESS, ["query"], [k.status])
            b.allow(e, f"{rid}/routes", EGRESS, ["declare_subscriber"], [k.answer])
            b.allow(e, f"{rid}/watch", EGRESS, ["declare_liveliness_subscriber", "liveliness_query"], [k.token])
    for m in deployment.monitors:
        rid = f"monitor/{m}"
        b.allow(m, f"{rid}/subscribe", INGRESS, ["declare_subscriber"], [ALL_METRICS])
        b.allow(m, f"{rid}/watch", INGRESS, ["declare_liveliness_subscriber", "liveliness_query"], [ALL])
        b.allow(m, f"{rid}/receive", EGRESS, ["put"], [ALL_METRICS])
        b.allow(m, f"{rid}/tokens", EGRESS, ["liveliness_token"], [ALL])
    subjects = [{"id": f"cn/{name}", "cert_common_names": [name]} for name in deployment.identities]
    policies = [{"id": f"policy/{name}", "subjects": [f"cn/{name}"], "rules": b.policies.get(name, [])}
                for name in deployment.identities if b.policies.get(name)]
    return {"enabled": True, "default_permission": "deny", "rules": b.rules, "subjects": subjects,
            "policies": policies}


#: Every message kind Zenoh's access control knows.
ALL_MESSAGES = ["put", "delete", "declare_subscriber", "query", "reply", "declare_queryable", "liveliness_token",
                "declare_liveliness_subscriber", "liveliness_query"]


def with_router_mesh(acl: dict, routers: Iterable[str]) -> dict:
    """`acl` with every message allowed, both ways, between the routers of a mesh (their certificate
    common names). Each router enforces the same ACL on the links of its own clients, so what crosses
    a router-to-router link was checked where it entered the mesh and is checked again where it
    leaves it; without these rules the routers (no role of the manifests) would drop it all."""
    routers = list(dict.fromkeys(routers))
    if len(routers) < 2:
        return acl
    rules = [{"id": "router-mesh", "permission": "allow", "flows": INGRESS + EGRESS, "messages": list(ALL_MESSAGES),
              "key_exprs": ["**"]}]
    subjects = [{"id": f"cn/{name}", "cert_common_names": [name]} for name in routers]
    policy = {"id": "policy/router-mesh", "subjects": [s["id"] for s in subjects], "rules": ["router-mesh"]}
    return {**acl, "rules": [*acl["rules"], *rules], "subjects": [*acl["subjects"], *subjects],
            "policies": [*acl["policies"], policy]}


def _answer_topic(entry) -> str:
    """The client topic a manifest entry answers on, from its declared output (a LeRobot checkpoint
    answers actions)."""
    declared = entry.synthetic or entry.vlm
    return ANSWER_TOPICS[declared.output if declared is not None else OutputKind.ACTIONS]


def write_acl(acl: dict, path: str | Path) -> Path:
    """Write `acl` as a JSON5 file (plain JSON with a header comment): the `access_control` value."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = ("// Zenoh access_control, generated by lerobot-zenoh-secure from the manifest(s).\n"
              "// Load it with ZenohSettings.access_control_file (manifest: zenoh.access_control_file),\n"
              "// or paste it as `access_control: <this object>` into a zenohd config. See docs/security.md.\n")
    body = ",\n".join(f"  {json.dumps(k)}: {_one_per_line(v)}" for k, v in acl.items())
    path.write_text(header + "{\n" + body + "\n}\n")
    return path


def _one_per_line(value) -> str:
    if isinstance(value, list) and value:
        return "[\n" + ",\n".join(f"    {json.dumps(item)}" for item in value) + "\n  ]"
    return json.dumps(value)


def _claim(roles: dict[str, str], name: str, role: str) -> None:
    if roles.setdefault(name, role) != role:
        raise ConfigError(role, f"{name!r} is already a {roles[name]}: one certificate common name, one role")
