"""`lerobot-policy-server`: pre-warm and serve until SIGINT/SIGTERM.

One model, no manifest (docs/server.md, "One model, no manifest")::

    lerobot-policy-server --policy.path=lerobot/smolvla_base --endpoint=tcp/0.0.0.0:7447

A fleet's models, clients and settings from a manifest (docs/server.md)::

    lerobot-policy-server --manifest=manifests/demo.yaml [--endpoint=tcp/0.0.0.0:7447]

`--policy.path` (and a manifest's `pretrained_path`) is a local checkpoint folder or a Hugging Face
hub id, `user/repo` or `user/repo@revision`: downloaded when online, taken from the cache when the
user's HF_HUB_OFFLINE is set (server/runners/hub.py). The endpoints are bound before any model loads, so a
busy port fails at once.

SIGHUP re-reads the manifest and takes its client lists (with integer `max_batch_size` and the task
streams of `pipeline`) without a restart; a manifest that fails to load or that changes any other
field is refused in one log line, and the running one stays in force (docs/server.md, "Reloading the client list").

Exit codes: 0 when stopped by SIGINT/SIGTERM (a second one, a second or more later, ends it at once
with 128 + its number; a stop that takes more than 20 s prints every thread's stack and exits with 1,
cli/stopping.py); 2 for a configuration mistake, in one line naming the flag or the manifest field
(a bad manifest, a checkpoint that cannot be loaded, an endpoint that cannot be bound, an unknown flag).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass, field

#: Exit status when every model was withdrawn after serving-loop faults (the log says why).
EXIT_FAILED = 1

PROG = "lerobot-policy-server"

#: Where a single-model server listens without --endpoint: loopback, as LeRobot's policy server.
DEFAULT_ENDPOINT = "tcp/127.0.0.1:7447"
#: The application a single-model server serves, but for its model id (the checkpoint's name). A
#: robot client left with its routing flags unset finds it anyway (docs/client.md, "Finding the server").
SINGLE_MODEL_APP = {"cluster_uuid": "local", "experiment_tag": "default", "model_version": "v1",
                    "application_tag": "default"}


@dataclass
class PolicyArgs:
    # The checkpoint: a local folder, or a Hugging Face hub id (user/repo, user/repo@revision).
    path: str | None = None
    # Torch device: cuda, cuda:N, mps, cpu, or auto (cuda when torch sees one, else cpu).
    device: str = "auto"
    # float32, or bfloat16 (VLAs only).
    dtype: str = "float32"
    # Compiled inference: off, default or max-autotune (CPU or CUDA), cuda_graphs (CUDA only); batch
    # buckets up to --max_batch_size are compiled at start-up (docs/policies.md, "Compiled inference").
    compile: str = "off"
    # With --policy.compile: when compiling fails at start-up, serve eager (eager) or do not start (refuse).
    compile_fallback: str = "refuse"


@dataclass
class ServerConfig:
    # A fleet's YAML manifest: models, checkpoints, clients and Zenoh settings (docs/server.md).
    # Leave it out and give --policy.path to serve one model with the defaults.
    manifest: str | None = None
    # One model without a manifest: --policy.path=user/repo (or a folder), --policy.device=cuda.
    policy: PolicyArgs = field(default_factory=PolicyArgs)
    # Where to listen, e.g. tcp/0.0.0.0:7447 (all interfaces) or tcp/127.0.0.1:7450. With a manifest it
    # replaces the manifest's listen endpoints; without, the default is tcp/127.0.0.1:7447 (this host only).
    endpoint: str | None = None
    # Single model: the control rate the robots must run at (the status tells them).
    fps: int = 30
    # Single model: the model id clients name (--model_id); default: the checkpoint's folder or repo name.
    model_id: str | None = None
    # Single model: the client ids served (comma-separated); default: any client.
    clients: str | None = None
    # Single model: most robots served in one forward pass (1: none batched), or auto (profiled at start-up).
    max_batch_size: str = "1"
    # Serve under this server id (default: the manifest's server_id, else <hostname>-<pid>).
    server_id: str | None = None
    # Logging level: DEBUG, INFO, WARNING or ERROR.
    log_level: str = "INFO"
    # Write this process's id here once serving (removed at exit): what `kill -HUP $(cat FILE)` and
    # lerobot-zenoh-admit signal to reload the manifest's client lists and task streams.
    pid_file: str | None = None

    def __post_init__(self) -> None:
        from lerobot_zenoh.command_line import check_log_level
        from lerobot_zenoh.errors import ConfigError

        if (self.manifest is None) == (self.policy.path is None):
            raise ConfigError("policy.path", "give --policy.path=REPO_OR_FOLDER (one model) or --manifest=FILE "
                                             "(a fleet), not both" if self.manifest else
                              "missing: give --policy.path=REPO_OR_FOLDER (one model, e.g. lerobot/smolvla_base) "
                              "or --manifest=FILE (a fleet; docs/server.md)")
        if self.manifest is not None:
            if not os.path.isfile(self.manifest):
                raise ConfigError("manifest", f"{self.manifest} is not a file")
            for name in ("model_id", "clients"):
                if getattr(self, name) is not None:
                    raise ConfigError(name, "applies to --policy.path only (a manifest names its own)")
        if not 1 <= self.fps <= 1000:  # (the manifest's bound) before --policy.path is looked at
            raise ConfigError("fps", f"must be in 1..1000, got {self.fps}")
        check_log_level(self.log_level)
        if self.endpoint is not None and not re.match(r"^(tcp|udp|tls|quic|ws|unixsock-stream)/\S+$", self.endpoint):
            raise ConfigError("endpoint", f"{self.endpoint!r} is not a Zenoh endpoint such as tcp/0.0.0.0:7447")


def single_model_manifest(args: ServerConfig):
    """The manifest `--policy.path` stands for: one model, any client (or --clients), the defaults."""
    from lerobot_zenoh.errors import ConfigError
    from lerobot_zenoh.server.runners.hub import HubRef
    from lerobot_zenoh.server.config.manifest import parse_manifest

    path = args.policy.path
    ref = None if os.path.exists(path) else HubRef.parse(path)
    model_id = args.model_id or _chunk(ref.name if ref else os.path.basename(os.path.normpath(path)))
    clients = [c.strip() for c in (args.clients or "").split(",") if c.strip()]
    batch = args.max_batch_size if args.max_batch_size == "auto" else _int("max_batch_size", args.max_batch_size)
    entry = {"model_id": model_id, "pretrained_path": path, "device": _device(args.policy.device),
             "dtype": args.policy.dtype, "fps": args.fps, "max_batch_size": batch,
             "compile": {"mode": args.policy.compile, "fallback": args.policy.compile_fallback},
             "accept_unknown_clients": not clients, "clients": [{"client_uuid": c} for c in clients],
             "application_tag": SINGLE_MODEL_APP["application_tag"],
             "model_version": SINGLE_MODEL_APP["model_version"]}
    data = {"cluster_uuid": SINGLE_MODEL_APP["cluster_uuid"], "experiment_tag": SINGLE_MODEL_APP["experiment_tag"],
            "zenoh": {"mode": "peer", "multicast_scouting": False, "listen": [args.endpoint or DEFAULT_ENDPOINT]},
            "server": [entry]}
    if args.server_id:
        data["server_id"] = args.server_id
    try:
        return parse_manifest(data)
    except ConfigError as exc:  # name the flag that set the field
        flags = {"model_id": "model_id", "device": "policy.device", "dtype": "policy.dtype", "fps": "fps",
                 "compile": "policy.compile", "mode": "policy.compile", "fallback": "policy.compile_fallback",
                 "max_batch_size": "max_batch_size", "clients": "clients", "server_id": "server_id"}
        name = exc.field.split(".")[-1] if exc.field.startswith("server.0.") else exc.field
        if exc.field.startswith("server.0.clients"):
            name = "clients"
        message = str(exc).split(f"{exc.field}: ", 1)[-1]
        raise ConfigError(flags.get(name, name), message) from None


def check_policy_path(path: str) -> None:
    """A --policy.path that cannot be served, in one line before the server imports torch: a missing
    folder, a training output folder (its checkpoint named), and offline a hub id the cache lacks.
    Online, a hub id is fetched when the model loads, as before."""
    from pathlib import Path

    from lerobot_zenoh.command_line import fail
    from lerobot_zenoh.errors import PolicyError
    from lerobot_zenoh.server.runners.hub import checkpoint_folder, is_offline

    if not os.path.exists(path) and not is_offline():
        return
    try:
        checkpoint_folder(path, Path(path), "--policy.path")
    except PolicyError as exc:
        fail(PROG, str(exc))


def _chunk(name: str) -> str:
    """A checkpoint's name as a key chunk (the model id): what Zenoh reserves becomes `_`."""
    return re.sub(r"[/*$?#@\s]", "_", name) or "policy"


def _int(flag: str, value: str) -> int:
    from lerobot_zenoh.errors import ConfigError

    try:
        return int(value)
    except ValueError:
        raise ConfigError(flag, f"an integer or auto, got {value!r}") from None


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def with_endpoint(manifest, endpoint: str):
    """`manifest` listening on `endpoint` only (--endpoint replaces the manifest's listen endpoints)."""
    zenoh = manifest.zenoh.replace(listen=[endpoint], connect=list(manifest.zenoh.connect),
                                   json5_overrides=dict(manifest.zenoh.json5_overrides))
    entries = [e.model_copy(update={"endpoint": None, "endpoints": []}) for e in manifest.server]
    return manifest.model_copy(update={"zenoh": zenoh, "server": entries})


def load(args: ServerConfig):
    """The manifest to serve: the file's (with --server_id, --endpoint), or the single model's."""
    from lerobot_zenoh.server.config.manifest import load_manifest

    if args.manifest is None:
        return single_model_manifest(args)
    manifest = load_manifest(args.manifest)
    if args.server_id:
        manifest = manifest.model_copy(update={"server_id": args.server_id})
    if args.endpoint:
        manifest = with_endpoint(manifest, args.endpoint)
    return manifest


def bind_error(exc: BaseException, endpoints: list[str]) -> str:
    """Zenoh's error on a listen endpoint, in one line without its Rust source locations."""
    text = str(exc)
    if "Address already in use" in text or "Can not create a new TCP listener" in text:
        return f"cannot listen on {', '.join(endpoints)}: the address is in use (another server on this port? " \
               "pick another with --endpoint=tcp/HOST:PORT)"
    if "Cannot assign requested address" in text:
        return f"cannot listen on {', '.join(endpoints)}: no interface of this host has that address"
    text = re.sub(r"\s*at \S+\.rs:\d+(:\d+)?\.?", "", text)  # Rust source locations
    return re.sub(r"\s*\[\S+\.rs:\d+\]", "", text)


#: The end of --help: what LeRobot's policy server users type, and where the manifest is described.
HELP_EXTRA = """
LeRobot's policy_server flags: --host=H --port=P is --endpoint=tcp/H:P here (answered in one line if
given). The manifest's fields: docs/server.md, "Manifest reference".
"""


def main(argv: list[str] | None = None) -> int:
    from lerobot_zenoh.command_line import (EXIT_CONFIG, LEROBOT_SERVER_FLAGS, answer_foreign_flags, explain, one_line,
                                           parse, require_role)
    from lerobot_zenoh.cli.stopping import begin_stop

    given = sys.argv[1:] if argv is None else list(argv)
    if "-h" in given or "--help" in given:
        from lerobot_zenoh.command_line import help_text

        print(help_text(ServerConfig, PROG) + HELP_EXTRA, end="")
        return 0
    answer_foreign_flags(PROG, given, LEROBOT_SERVER_FLAGS)
    args = parse(ServerConfig, argv, PROG)
    require_role(PROG, "lerobot", "server")
    if args.policy.path is not None:
        check_policy_path(args.policy.path)
    logging.basicConfig(level=args.log_level.upper(), force=True, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger(PROG)

    from lerobot_zenoh.errors import ConfigError, LeRobotZenohError, TransportError
    from lerobot_zenoh.server.shell.policy_server import PolicyServer

    def interrupt(*_):
        begin_stop(None)
        raise KeyboardInterrupt  # while loading: stop at once (the server closes what it opened)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)
    source = args.manifest or "--policy.path"
    manifest = None
    try:
        manifest = load(args)
        log.info("listening on %s, then loading and warming up %d model(s) from %s ...",
                 ", ".join(manifest.zenoh_settings().listen), len(manifest.server), source)
        server = PolicyServer(manifest).start()
    except KeyboardInterrupt:
        log.info("stopped while loading")
        return 0
    except ConfigError as exc:
        if args.manifest is None:
            # A field of the single model's entry, refused as it loads, is its --policy.<field> flag.
            message = (re.sub(r"^server\[[^\]]*\]\.", "--policy.", str(exc)) if exc.field.startswith("server[")
                       else explain(exc))
        else:
            message = str(exc) if exc.source else f"{args.manifest}: {exc}"
        print(f"{PROG}: {one_line(message)}", file=sys.stderr)
        return EXIT_CONFIG
    except TransportError as exc:
        listen = manifest.zenoh_settings().listen if manifest is not None else []
        print(f"{PROG}: {one_line(bind_error(exc, listen))}", file=sys.stderr)
        return EXIT_CONFIG
    except LeRobotZenohError as exc:
        text = str(exc)
        if args.manifest is None:  # the single model's checkpoint is --policy.path
            text = re.sub(r"^<memory>: server\[[^\]]*\]\.pretrained_path", "--policy.path", text)
            text = re.sub(r"^<memory>: server\[[^\]]*\]\.", "--policy.", text)
        elif not text.startswith(args.manifest):
            text = f"{args.manifest}: {text}"
        print(f"{PROG}: {one_line(text)}", file=sys.stderr)
        return EXIT_CONFIG
    stop, hup, wake = threading.Event(), threading.Event(), threading.Event()
    for sig, flag in ((signal.SIGINT, stop), (signal.SIGTERM, stop), (signal.SIGHUP, hup)):
        signal.signal(sig, lambda *_, f=flag: (f.set(), wake.set()))
    log.info("server %s ready", manifest.server_id)
    if args.manifest is None:
        app = manifest.app_key(manifest.server[0])
        log.info("robots connect with: lerobot-robot-client --endpoint=%s --model_id=%s (--help for the rest)",
                 _client_endpoint(manifest.zenoh_settings().listen[0]), app.model)
    pid_file = _write_pid(args.pid_file)
    try:
        while not stop.is_set():
            wake.wait(1.0)
            wake.clear()
            if server.failed.is_set():  # every model withdrawn after faults (logged): not a half-alive process
                log.critical("server %s serves nothing any more; exiting", manifest.server_id)
                return EXIT_FAILED
            if hup.is_set() and not stop.is_set():
                hup.clear()
                _reload(server, args, log)
    finally:
        begin_stop(log)
        server.stop()
        if pid_file is not None:
            pid_file.unlink(missing_ok=True)
    return 0


def _client_endpoint(listen: str) -> str:
    """What a robot on another host connects to: the listen endpoint, with 0.0.0.0 as this host's name."""
    import socket

    return listen.replace("0.0.0.0", socket.gethostname()) if "0.0.0.0" in listen else listen


def _reload(server, args: ServerConfig, log: logging.Logger) -> None:
    """SIGHUP: re-read the manifest; the server takes its client lists or refuses it (one line)."""
    from lerobot_zenoh.command_line import one_line
    from lerobot_zenoh.errors import ConfigError

    if args.manifest is None:
        log.warning("SIGHUP ignored: a single-model server (--policy.path) has no manifest to re-read")
        return
    try:
        manifest = load(args)
    except ConfigError as exc:
        log.error("manifest reload refused: %s; the running manifest stays in force", one_line(str(exc)))
        return
    server.reload(manifest)


def _write_pid(path: str | None):
    from pathlib import Path

    if path is None:
        return None
    pid_file = Path(path)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = pid_file.with_name(pid_file.name + ".tmp")
    tmp.write_text(f"{os.getpid()}\n")
    tmp.replace(pid_file)  # a reader never sees a half-written id
    return pid_file


if __name__ == "__main__":
    sys.exit(main())
