"""`lerobot-zenoh-secure`: certificates and the Zenoh access control of a deployment, from its manifest(s).

    lerobot-zenoh-secure init --manifest manifests/demo.yaml --out pki --monitor ops
    lerobot-zenoh-secure init --manifest a.yaml --manifest b.yaml --out pki --router zrouter \\
        --router_endpoint tls/10.0.0.2:7447 --host 10.0.0.2
    lerobot-zenoh-secure init --manifest a.yaml --out pki \\
        --router za=tls/10.0.0.2:7447 --router zb=tls/10.0.0.3:7447     # two routers, meshed
    lerobot-zenoh-secure init ... --ca_cert corp-ca.pem --ca_key corp-ca.key    # sign with your CA
    lerobot-zenoh-secure acl --manifest manifests/demo.yaml --monitor ops --certs pki --out pki/acl.json5

`init` writes into --out: ca.pem/ca.key (a new development CA, unless --ca_cert/--ca_key), one
<id>.pem/<id>.key per server id, client uuid, monitor (and router), acl.json5, and what each
program needs to use them: <server_id>.manifest.yaml (the manifest, secured), <id>.flags for each
client and monitor, <router>.zenoh.json5 for a router; README.md says which is which.
`init` prints, for each certificate, the names it may serve as a TLS listener: a server's and the
router's carry the names robots and monitors dial; an engine's only where its scheduler dials it
(a name a server or router also carries is refused); robots' and monitors' none.
`acl` writes only the ACL, for certificates you already have (their common names must be the ids).
Flags are draccus' `--flag=value` as in every console script (docs/client.md, "Command lines");
the list flags may be given once per item (`--manifest a.yaml --manifest b.yaml`).
Exit codes: 0 done, 2 bad arguments or configuration.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

PROG = "lerobot-zenoh-secure"

#: Flags given once per item (``--manifest a.yaml --manifest b.yaml``), besides draccus' lists.
_REPEATABLE = frozenset({"--manifest", "--monitor", "--client", "--host", "--router", "--router_endpoint"})


@dataclass
class _Identities:
    # A server manifest; repeatable (--manifest=a.yaml --manifest=b.yaml): one per server or engine.
    manifest: list[str] = field(default_factory=list)
    # A monitor identity (its certificate's common name); repeatable.
    monitor: list[str] = field(default_factory=list)
    # A client id the manifests do not list (accept_unknown_clients): ID for every app, or
    # <cluster>/<experiment>/<model>/<version>/<app>/ID for one; repeatable.
    client: list[str] = field(default_factory=list)
    # Logging level: DEBUG, INFO, WARNING or ERROR.
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        from lerobot_zenoh.command_line import check_log_level
        from lerobot_zenoh.errors import ConfigError

        if not self.manifest:
            raise ConfigError("manifest", "missing: give --manifest=FILE (once per server manifest)")
        check_log_level(self.log_level)


@dataclass
class InitConfig(_Identities):
    ("`init`: a CA (or yours), one certificate per identity, the ACL and settings. The list flags may be "
     "given once per item (--manifest a.yaml --manifest b.yaml); --force needs no value.")

    # The folder to write into (a CA, one certificate per identity, acl.json5, settings; README.md there).
    out: str = ""
    # An extra host name or IP the server and router certificates carry (robot and monitor certificates
    # name no host); repeatable. The first one replaces a wildcard listen address (0.0.0.0) in the
    # endpoints given to clients.
    host: list[str] = field(default_factory=list)
    # Issue a certificate for this router and enforce the ACL there: NAME (its endpoints in
    # --router_endpoint), or NAME=tls/host:port; repeatable: several routers, meshed (each connects to
    # the others; everyone else is given them all).
    router: list[str] = field(default_factory=list)
    # Where the router of --router NAME listens (tls/host:port); repeatable.
    router_endpoint: list[str] = field(default_factory=list)
    # Sign with this CA certificate (PEM) instead of a new development CA.
    ca_cert: str | None = None
    # The private key of --ca_cert (unencrypted PEM).
    ca_key: str | None = None
    # Days the issued certificates are valid.
    valid_days: int = 365
    # Overwrite an existing CA key in --out.
    force: bool = False

    def __post_init__(self) -> None:
        from lerobot_zenoh.errors import ConfigError

        super().__post_init__()
        if not self.out:
            raise ConfigError("out", "missing: give --out=FOLDER to write the certificates into")
        if self.valid_days < 1:
            raise ConfigError("valid_days", f"must be at least 1, got {self.valid_days}")


@dataclass
class AclConfig(_Identities):
    ("`acl`: only the ACL (acl.json5), for certificates you already have (their common names must be the "
     "ids). The list flags may be given once per item (--manifest a.yaml --manifest b.yaml).")

    # The file to write (acl.json5).
    out: str = ""
    # A folder of <id>.pem certificates: check that each identity has one with that common name.
    certs: str | None = None

    def __post_init__(self) -> None:
        from lerobot_zenoh.errors import ConfigError

        super().__post_init__()
        if not self.out:
            raise ConfigError("out", "missing: give --out=FILE (acl.json5)")


#: Sub-command -> (its flags, what it does).
COMMANDS = {
    "init": (InitConfig, "a CA (or yours), one certificate per identity, the ACL and settings"),
    "acl": (AclConfig, "only the ACL (acl.json5), for certificates you already have"),
}


def usage() -> str:
    lines = [f"usage: {PROG} {{{','.join(COMMANDS)}}} [--flag=value ...]", "", (__doc__ or "").strip(), "",
             "commands:"]
    lines += [f"  {name:6} {what}  ({PROG} {name} --help lists its flags)" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from lerobot_zenoh.command_line import Spellings, explain, fail, parse, warn_old_spellings
    from lerobot_zenoh.errors import LeRobotZenohError

    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0
    if args[0] not in COMMANDS:
        fail(PROG, f"{args[0]!r} is not a command: {' or '.join(COMMANDS)} ({PROG} --help)")
    command, rest = args[0], args[1:]
    warn_old_spellings(PROG, rest, {"--log-level": "--log_level"})
    spellings = Spellings(switches={"--force": "--force=true"}, aliases={"--log-level": "--log_level"},
                          repeatable=_REPEATABLE)
    config = parse(COMMANDS[command][0], rest, f"{PROG} {command}", spellings)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _init(config) if command == "init" else _acl(config)
    except LeRobotZenohError as exc:
        print(f"{PROG}: {explain(exc)}", file=sys.stderr)
        return 2


def _deployment(args):
    from lerobot_zenoh.errors import ConfigError
    from lerobot_zenoh.security.acl import Deployment
    from lerobot_zenoh.server.config.manifest import load_manifest

    manifests = [load_manifest(m) for m in args.manifest]
    for m in manifests:
        if m.role == "server" and "server_id" not in m.model_fields_set:
            raise ConfigError("server_id", "set server_id in the manifest: its certificate and ACL subject are "
                                           "named after it (the default <hostname>-<pid> changes every run)",
                              source=m.source)
    extra: dict[str, list[str]] = {}
    for spec in args.client:
        prefix, _, cid = spec.rpartition("/")
        extra.setdefault(prefix or "*", []).append(cid)
    return manifests, Deployment.from_manifests(manifests, args.monitor, extra)


def _acl(args) -> int:
    from lerobot_zenoh.errors import ConfigError
    from lerobot_zenoh.security import pki
    from lerobot_zenoh.security.acl import access_control, write_acl

    _, deployment = _deployment(args)
    if args.certs:
        found = {}
        for pem in sorted(Path(args.certs).glob("*.pem")):
            try:
                found[pki.common_name(pem.read_bytes())] = pem
            except (ConfigError, ValueError):
                continue
        missing = [name for name in deployment.identities if name not in found]
        if missing:
            raise ConfigError("certs", f"no certificate in {args.certs} has the common name of {missing}")
    path = write_acl(access_control(deployment), args.out)
    print(f"wrote {path} ({len(deployment.identities)} identities)")
    return 0


def _init(args) -> int:
    import yaml

    from lerobot_zenoh.errors import ConfigError
    from lerobot_zenoh.security import pki
    from lerobot_zenoh.security.acl import access_control, with_router_mesh, write_acl
    from lerobot_zenoh.security.identities import (
        PkiLayout, check_engine_names, check_host_names, connect_endpoint, member_settings, router_settings,
        server_settings,
    )

    manifests, deployment = _deployment(args)
    layout = PkiLayout(Path(args.out).resolve())
    routers = _routers(args)
    servers = [m for m in manifests if m.role == "server"]
    if not routers and len(servers) > 1:
        raise ConfigError("manifest", "several servers need a router (--router, --router_endpoint): in a "
                                      "peer-to-peer deployment clients talk to exactly one server")

    # 1. where servers (or the router) listen, and where everyone else connects
    connect_host = args.host[0] if args.host else "127.0.0.1"
    # An engine process (`role: engine`) is named by its engine_id: its certificate, its ACL subject.
    server_listen = {_identity(m): m.zenoh_settings().listen for m in manifests}
    if routers:
        connect = [connect_endpoint(e, connect_host) for endpoints in routers.values() for e in endpoints]
    else:
        if len(servers) != 1:
            raise ConfigError("manifest", "a peer-to-peer deployment needs exactly one server manifest (role: server)")
        sid, listen = servers[0].server_id, server_listen[servers[0].server_id]
        if not listen:
            raise ConfigError("zenoh.listen", f"server {sid} listens nowhere: give the manifest an endpoint")
        connect = [connect_endpoint(e, connect_host) for e in listen]

    # 2. the identities, and the names each certificate may serve
    identities = dict(deployment.identities)
    for router in routers:
        if router in identities:
            raise ConfigError("router", f"{router!r} is already a {identities[router]}")
        identities[router] = "router"
    names = _served_names(args, routers, manifests, server_listen)
    check_host_names([n.host for served in names.values() for n in served], identities)
    check_engine_names({i: names.get(i, []) for i, role in identities.items() if role == "engine"},
                       {i: names.get(i, []) for i, role in identities.items() if role in ("server", "router")})

    # 3. the CA (nothing is written before the arguments are checked)
    if bool(args.ca_cert) != bool(args.ca_key):
        raise ConfigError("ca_key" if args.ca_cert else "ca_cert", "give both --ca_cert and --ca_key")
    layout.root.mkdir(parents=True, exist_ok=True)
    if args.ca_cert:
        ca = pki.load_ca(args.ca_cert, args.ca_key)
        if Path(args.ca_cert).resolve() != layout.ca_cert:
            shutil.copyfile(args.ca_cert, layout.ca_cert)
    else:
        if layout.ca_key.exists() and not args.force:
            raise ConfigError("out", f"{layout.ca_key} exists; pass --ca_cert/--ca_key to reuse it, or --force")
        ca = pki.create_ca()
        pki.save_ca(ca, layout.root)

    # 4. one certificate per identity, named by its id; only servers, the router and listening engines name hosts
    for name, role in identities.items():
        pki.write_identity(ca, name, layout.root, [n.host for n in names.get(name, [])], args.valid_days, role=role)

    # 5. the ACL, and what each program needs
    write_acl(with_router_mesh(access_control(deployment), routers), layout.acl)
    written = []
    for manifest in manifests:
        name = _identity(manifest)
        settings = server_settings(layout, name, server_listen[name], router=connect if routers else None)
        path = layout.root / f"{name}.manifest.yaml"
        path.write_text(f"# {manifest.source}, secured by lerobot-zenoh-secure (docs/security.md)\n"
                        + yaml.safe_dump(_secured_manifest(manifest, settings, layout.root), sort_keys=False))
        written.append((manifest.role, name, f"lerobot-policy-server --manifest {path}"))
    for i, (name, role) in enumerate((n, r) for n, r in identities.items() if r in ("client", "monitor")):
        # with several routers each member's list starts at another one: the members are spread over them
        first = sum(len(e) for e in list(routers.values())[:i % len(routers)]) if routers else 0
        settings = member_settings(layout, name, connect[first:] + connect[:first])
        flags = _client_flags(settings) if role == "client" else _monitor_flags(settings)
        path = layout.root / f"{name}.flags"
        path.write_text("\n".join(flags) + "\n")
        program = "lerobot-robot-client --robot.type=... <routing flags>" if role == "client" else "lerobot-zenoh-monitor"
        written.append((role, name, f"{program} $(cat {path})"))
    for router, endpoints in routers.items():
        others = [connect_endpoint(e, connect_host) for r, es in routers.items() if r != router for e in es]
        settings = router_settings(layout, router, endpoints, others)
        path = layout.root / f"{router}.zenoh.json5"
        path.write_text(json.dumps(_zenoh_json(settings), indent=2) + "\n")
        written.append(("router", router, f"lerobot-zenoh-router --config {path}"))
    served = [(role, name, _serves(role, pki.served_names(layout.cert(name).read_bytes())))
              for name, role in identities.items()]
    (layout.root / "README.md").write_text(_readme(layout, written, served, bool(routers)))
    for role, name, command in written:
        print(f"{role:8} {name:24} {command}")
    print("certificates, and the names each may serve as a TLS listener (robots and monitors accept only a "
          "server's or router's):")
    for role, name, what in served:
        print(f"  {role:8} {name:24} {what}")
    print(f"ACL: {layout.acl}; CA: {layout.ca_cert}")
    return 0


def _routers(args) -> dict[str, list[str]]:
    """router name -> its endpoints, from `--router NAME --router_endpoint E ...` (one router) or
    `--router NAME=E ...` (one or several; a name given again adds an endpoint)."""
    from lerobot_zenoh.errors import ConfigError
    from lerobot_zenoh.security.identities import WILDCARD_HOSTS, host_of

    routers: dict[str, list[str]] = {}
    for spec in args.router:
        name, eq, endpoint = spec.partition("=")
        if eq and args.router_endpoint:
            raise ConfigError("router_endpoint", "give routers either as --router NAME=tls/host:port, or as one "
                                                 "--router NAME with --router_endpoint, not both")
        if eq and not endpoint:
            raise ConfigError("router", f"{spec!r}: NAME=tls/host:port, the endpoint is missing")
        routers.setdefault(name, []).extend([endpoint] if eq else [])
    if args.router_endpoint:
        if len(routers) != 1:
            raise ConfigError("router_endpoint", "--router_endpoint belongs to one --router NAME; with several "
                                                 "routers give each as --router NAME=tls/host:port")
        routers[next(iter(routers))] = list(args.router_endpoint)
    for name, endpoints in routers.items():
        if not endpoints:
            raise ConfigError("router_endpoint", f"router {name!r} has no endpoint: --router {name} needs "
                                                 "--router_endpoint tls/host:port (or --router NAME=tls/host:port)")
        if len(routers) > 1 and any(host_of(e) in WILDCARD_HOSTS for e in endpoints):
            raise ConfigError("router", f"router {name!r} listens on a wildcard address ({endpoints}): with several "
                                        "routers give each the host the others dial")
    return routers


def _served_names(args, routers: dict[str, list[str]], manifests, server_listen: dict[str, list[str]]) -> dict:
    """identity -> the names (`DialledName`) its certificate will carry.

    Servers and the router: `DEFAULT_HOSTS`, every --host and the hosts they listen on: the names
    robots and monitors dial. An engine: only where its scheduler dials it (its own listen hosts, and
    the hosts of the `engines[].endpoint` naming it), never a default, so that a robot dialling a
    server refuses an engine's certificate; behind routers an engine listens nowhere and names none.
    """
    from lerobot_zenoh.errors import ConfigError
    from lerobot_zenoh.security import pki
    from lerobot_zenoh.security.identities import WILDCARD_HOSTS, DialledName, host_of

    def own(endpoints, field, source=None) -> list[DialledName]:
        return [DialledName(h, field, source) for h in map(host_of, endpoints) if h and h not in WILDCARD_HOSTS]

    dialled = [DialledName(h, "host") for h in (*pki.DEFAULT_HOSTS, *args.host)]
    names: dict[str, list[DialledName]] = {}
    for m in manifests:
        ident = _identity(m)
        if m.role == "server":
            names[ident] = dialled + own(server_listen[ident], "zenoh.listen", m.source)
        elif not routers:  # behind routers an engine connects to them and listens nowhere
            names.setdefault(ident, []).extend(own(server_listen[ident], "zenoh.listen", m.source))
        for i, entry in enumerate(m.server):
            for j, engine in enumerate(entry.engines):
                if engine.endpoint and not routers:
                    names.setdefault(engine.engine_id, []).extend(
                        own([engine.endpoint], f"server.{i}.engines.{j}.endpoint", m.source))
    for m in manifests:
        if m.role == "engine" and not routers and server_listen[m.engine_id] and not names.get(m.engine_id):
            raise ConfigError("zenoh.listen", f"engine {m.engine_id!r} listens on {server_listen[m.engine_id]} but "
                                              "no host it is dialled at is known: give init its scheduler's manifest "
                                              "too (its engines[].endpoint names the host), or listen on the "
                                              "engine's own address", source=m.source)
    for router, endpoints in routers.items():
        names[router] = dialled + own(endpoints, "router")
    return names


def _serves(role: str, names: list[str]) -> str:
    """What `lerobot-zenoh-secure init` says a certificate may serve."""
    if not names:
        return "nothing: client only"
    return ", ".join(names) + (" (to its scheduler only)" if role == "engine" else "")


def _secured_manifest(manifest, settings, root: Path) -> dict:
    """The manifest as data, with the secured zenoh block, tls/ endpoints and absolute checkpoint paths."""
    from lerobot_zenoh.security.identities import tls_endpoint
    from lerobot_zenoh.server.runners.hub import HubRef

    data = manifest.model_dump(mode="json", exclude_none=True)
    listen = [] if settings.mode == "client" else [tls_endpoint(e) for e in manifest.zenoh.listen]
    zenoh = {"mode": settings.mode, "listen": listen, "connect": settings.connect,
             "multicast_scouting": settings.multicast_scouting, "shared_memory": manifest.zenoh.shared_memory,
             "json5_overrides": {**settings.json5_overrides, **manifest.zenoh.json5_overrides}}  # yours win
    for name in ("tls_root_ca", "tls_certificate", "tls_private_key", "access_control_file"):
        value = getattr(settings, name)
        if value:
            zenoh[name] = str(Path(value).relative_to(root)) if Path(value).is_relative_to(root) else value
    data["zenoh"] = {k: v for k, v in zenoh.items() if v not in ([], {})}
    for raw, entry in zip(data["server"], manifest.server):
        if settings.mode == "client":  # behind a router the server listens nowhere
            raw.pop("endpoint", None)
            raw.pop("endpoints", None)
        else:
            if "endpoint" in raw:
                raw["endpoint"] = tls_endpoint(raw["endpoint"])
            if raw.get("endpoints"):
                raw["endpoints"] = [tls_endpoint(e) for e in raw["endpoints"]]
        local = manifest.resolve_path(entry) if entry.pretrained_path else None
        if local is not None and (local.exists() or HubRef.parse(entry.pretrained_path) is None):
            raw["pretrained_path"] = str(local.resolve())  # a hub id stays as written
        for engine in raw.get("engines", []):  # the scheduler dials its engines over TLS too
            if engine.get("endpoint") and settings.mode == "client":
                engine.pop("endpoint")  # behind routers: they join the two, and the engine listens nowhere
            elif engine.get("endpoint"):
                engine["endpoint"] = tls_endpoint(engine["endpoint"])
    return data


def _identity(manifest) -> str:
    """The certificate common name of the process a manifest runs: its engine_id for an engine."""
    return manifest.engine_id if manifest.role == "engine" else manifest.server_id


def _client_flags(settings) -> list[str]:
    # one endpoint: --endpoint; several (routers): --zenoh.connect once each, in order (the first is tried first)
    where = ([f"--endpoint={e}" for e in settings.connect] if len(settings.connect) == 1
             else [f"--zenoh.connect={e}" for e in settings.connect])
    return [f"--zenoh.mode={settings.mode}", "--zenoh.multicast_scouting=false", *where,
            f"--zenoh.tls_root_ca={settings.tls_root_ca}", f"--zenoh.tls_certificate={settings.tls_certificate}",
            f"--zenoh.tls_private_key={settings.tls_private_key}"]


def _monitor_flags(settings) -> list[str]:
    return _client_flags(settings)  # the monitor takes the robot client's --endpoint and --zenoh.* flags


def _zenoh_json(settings) -> dict:
    """A standalone Zenoh config (for zenohd or another binding) holding what `settings` sets."""
    config = settings.to_zenoh_config()
    return {key: json.loads(config.get_json(key))
            for key in ("mode", "listen", "connect", "scouting", "transport", "access_control")}


def _readme(layout, written, served, router: bool) -> str:
    where = ("the router(s) (each <router>.zenoh.json5 holds the ACL); everyone else connects to them in client mode"
             if router else "the server's own session (its manifest points at acl.json5); clients and monitors "
                            "connect to it in client mode")
    lines = [
        "# Generated by lerobot-zenoh-secure (docs/security.md)",
        "",
        f"The ACL (acl.json5) is enforced by {where}.",
        "",
        "Private keys (*.key) are secrets: copy each one only to the machine of its identity.",
        "ca.key signs new identities: keep it offline, never on a robot or a server.",
        "",
        "| role | identity | run |",
        "|---|---|---|",
        *(f"| {role} | {name} | `{command}` |" for role, name, command in written),
        "",
        "What each certificate may serve as a TLS listener (the names a connecting node accepts it under):",
        "robots and monitors dial only server and router names, so only those certificates can answer them.",
        "",
        "| role | identity | may serve |",
        "|---|---|---|",
        *(f"| {role} | {name} | {what} |" for role, name, what in served),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
