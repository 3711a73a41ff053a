"""`make demo`: one policy server and several simulated robots on loopback, then a summary.

    python -m lerobot_zenoh.demo --port=7447 --robots=2 --seconds=20 --policy=act

Runs the real console scripts as separate processes, as a user would: `lerobot-policy-server`
with manifests/demo.yaml (its port, checkpoint and client list adjusted to the flags, written to
`<out>/manifest.yaml`), and one `lerobot-robot-client --robot.type=zenoh_sim` per robot. While
they run, a line per second shows every robot's control rate, round trip and chunks (from their
telemetry, as `lerobot-zenoh-monitor` reads it). Each robot stops itself after `--seconds` and the
per-robot JSON summaries are printed as a table.

The demo is ready when *its own* server (a server id of this run) answers, never another one on the
port; it waits on the server and the robots as long as they run (no deadline a loaded machine can
miss: a line every 15 s shows what the server is doing). A failure names the process, its exit code
and the last lines of its log (exit 1); Ctrl-C stops every process and exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Where a wheel installs the manifests and examples (pyproject.toml's data-files).
SHARED = Path(sys.prefix) / "share" / "lerobot-zenoh"


def shipped(relative: str) -> Path:
    """A file of the project: from the checkout when running from one, else from the installed copy."""
    here = ROOT / relative
    return here if here.exists() else SHARED / relative
PROG = "python -m lerobot_zenoh.demo"
DEMO_POLICIES = ("act", "diffusion", "smolvla", "pi0", "pi05")
VLAS = ("smolvla", "pi0", "pi05")
# One task string per robot (a VLA reads it; ACT and Diffusion ignore it).
TASKS = ("pick the cube", "open the drawer", "fold the towel", "push the block to the left")


@dataclass
class DemoConfig:
    # TCP port on 127.0.0.1 the policy server listens on.
    port: int = 7447
    # Simulated robots to run (robot_1, robot_2, ...).
    robots: int = 2
    # How long the robots run, in seconds.
    seconds: float = 20.0
    # Policy family of the demo checkpoint: act, diffusion, smolvla, pi0 or pi05 (random weights,
    # built offline; the VLAs tiny, reading one task string per robot).
    policy: str = "act"
    # Checkpoint folder to serve. Unset: checkpoints/demo_<policy> in the current folder, built
    # first (random weights, offline, as `make checkpoint` does) when it is not there.
    checkpoint: str | None = None
    # Compiled inference of the served model (docs/policies.md, "Compiled inference"): off (the
    # manifest's own setting), default or max-autotune. Every batch bucket compiles before the robots
    # start (minutes on a small CPU the first time; the cache folder is kept).
    compile: str = "off"
    # Manifest to start from; its first model is served (default: the project's manifests/demo.yaml).
    manifest: str = field(default_factory=lambda: str(shipped("manifests/demo.yaml")))
    # Folder for the logs, the JSON summaries and the adjusted manifest.
    out: str = "outputs/demo"
    # robot_1 also records a LeRobotDataset into <out>/dataset.
    record: bool = False

    def __post_init__(self) -> None:
        from lerobot_zenoh.errors import ConfigError

        if not 1 <= self.port <= 65535:
            raise ConfigError("port", f"must be in 1..65535, got {self.port}")
        if self.robots < 1:
            raise ConfigError("robots", f"must be >= 1, got {self.robots}")
        if self.seconds <= 0:
            raise ConfigError("seconds", f"must be positive, got {self.seconds}")
        if self.policy not in DEMO_POLICIES:
            raise ConfigError("policy", f"{self.policy!r} is not one of {', '.join(DEMO_POLICIES)}")
        if self.checkpoint is not None and not (Path(self.checkpoint) / "config.json").is_file():
            raise ConfigError("checkpoint", f"{self.checkpoint} holds no checkpoint: build one with "
                                            f"lerobot-zenoh-build-checkpoint (or leave --checkpoint out)")
        if not Path(self.manifest).is_file():
            raise ConfigError("manifest", f"{self.manifest} is not a file")
        if self.compile not in ("off", "default", "max-autotune"):
            raise ConfigError("compile", f"{self.compile!r} is not one of off, default, max-autotune")


#: What `make checkpoint` builds: the simulated robot's features (6 joints, two 96x128 cameras).
CHECKPOINT_ARGS = ("--state_dim=6", "--cameras=front:96x128,wrist:96x128", "--chunk_size=50", "--fps=30")


def ensure_checkpoint(cfg: DemoConfig) -> str:
    """The checkpoint to serve: --checkpoint, or checkpoints/demo_<policy> (built when missing)."""
    if cfg.checkpoint is not None:
        return str(Path(cfg.checkpoint).resolve())
    folder = Path("checkpoints") / f"demo_{cfg.policy}"
    if not (folder / "config.json").is_file():
        print(f"== building a random-weight {cfg.policy} checkpoint in {folder} (offline, once)", flush=True)
        subprocess.run([_bin("lerobot-zenoh-build-checkpoint"), f"--policy_type={cfg.policy}", f"--output={folder}",
                        *CHECKPOINT_ARGS], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return str(folder.resolve())


def _bin(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def demo_manifest(cfg: DemoConfig, out: Path) -> Path:
    """The manifest with the demo's port, checkpoint, model id and enough clients; written to `out`."""
    import yaml

    data = yaml.safe_load(Path(cfg.manifest).read_text())
    entry = data["server"][0]
    entry["endpoint"] = f"tcp/127.0.0.1:{cfg.port}"
    entry.pop("endpoints", None)
    entry["pretrained_path"] = cfg.checkpoint
    entry["model_id"] = cfg.policy
    if cfg.policy in VLAS:  # the robots' observations (and their tasks) in one forward pass, each
        entry["max_batch_size"] = min(cfg.robots, 4)  # robot's chunk continuing what it executes (RTC)
        entry["rtc"] = {"enabled": True}
    if cfg.compile != "off":
        entry["compile"] = cfg.compile
    listed = [c["client_uuid"] for c in entry.get("clients", [])]
    entry["clients"] = [{"client_uuid": c} for c in listed] + [
        {"client_uuid": f"robot_{i}"} for i in range(1, cfg.robots + 1) if f"robot_{i}" not in listed]
    path = out / "manifest.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _wait_ready(port: int, app_status: str, server_id: str, server: subprocess.Popen, log_path: Path) -> bool:
    """Wait until *this* demo's server (its server id) answers its status query; False as soon as the
    server process exits. No deadline: loading a model on a busy machine takes what it takes, and the
    log's last line is shown every 15 s."""
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import loopback_settings

    t0 = last_note = time.monotonic()
    with ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
        while server.poll() is None:
            for _, payload in session.query(app_status, timeout_s=0.5):
                try:
                    if codec.decode_status(payload).server_id == server_id:
                        return True
                except Exception:  # noqa: BLE001 - someone else's reply: not ours
                    pass
            if time.monotonic() - last_note >= 15:
                last_note = time.monotonic()
                tail = _tail(log_path, 1)
                print(f"   ... still starting after {last_note - t0:.0f} s: {tail[-1] if tail else '(no log yet)'}",
                      flush=True)
            time.sleep(0.2)
    return False


def port_in_use(port: int) -> bool:
    """Whether something listens on 127.0.0.1:`port` (or on every interface at that port)."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free for a listener
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def next_free_port(port: int) -> int:
    return next((p for p in range(port + 1, min(port + 100, 65535)) if not port_in_use(p)), port + 1)


def port_hint(port: int) -> str:
    """How the user sets the port: `make demo PORT=N` when make started the demo (the Makefile names
    its variable in DEMO_PORT_VARIABLE), else this script's --port=N."""
    variable = os.environ.get("DEMO_PORT_VARIABLE")
    return f"make demo {variable}={port}" if variable else f"--port={port}"


def _tail(path: Path, n: int) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if line.strip()][-n:]


#: The client's "starting: ..." log lines (cli/client.py) -> the stage a robot shows until it runs.
STAGES = (("starting: asking", "connecting"), ("starting: importing LeRobot", "importing LeRobot"),
          ("starting: connecting the", "opening the robot"), ("starting: asking the server", "status"),
          (": server ", "waiting for its first chunk"))


def robot_stage(log_path: Path) -> str:
    """Where a robot that sends no telemetry yet is in its start, from the last step its log names."""
    stage = "reading its flags"
    for line in _tail(log_path, 40):
        for marker, name in STAGES:
            if marker in line and (marker != ": server " or " serves " in line):
                stage = name
    return stage


def live_line(fleet, clients: list[str], elapsed_s: float, out: Path | None = None,
              exit_codes: dict[str, int | None] | None = None) -> str:
    """One line: every robot's loop rate, round-trip median and chunks so far (from its telemetry);
    while a robot starts, the step it is at (from its log in `out`); once it exited, that it finished."""
    figures = {m.member_id: m.metrics for m in fleet.members() if m.kind == "client"}
    parts = []
    for cid in clients:
        m = figures.get(cid)
        code = (exit_codes or {}).get(cid)
        if code is not None:
            parts.append(f"{cid}: finished" if code == 0 else f"{cid}: exited with code {code}")
            continue
        if not m or not m.get("chunks_received"):
            stage = "waiting for its first chunk" if m else robot_stage(out / f"{cid}.log") if out else "starting"
            parts.append(f"{cid}: {stage}")
            continue
        hz, rtt = m.get("loop_hz"), m.get("rtt_ms_p50")
        parts.append(f"{cid}: {hz or 0:.0f} Hz, rtt {'-' if rtt is None else f'{rtt:.0f} ms'}, "
                     f"{int(m.get('chunks_received', 0))} chunks" + (" REVALIDATING" if m.get("revalidating") else ""))
    return f"[{elapsed_s:4.0f} s] " + " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    from lerobot_zenoh.command_line import parse

    cfg = parse(DemoConfig, argv, PROG)
    if port_in_use(cfg.port):  # before anything starts: another server (or an earlier demo) holds it
        print(f"{PROG}: port {cfg.port} on 127.0.0.1 is in use (another policy server, or a demo still running?): "
              f"choose another with {port_hint(next_free_port(cfg.port))}", file=sys.stderr)
        return 2

    from lerobot_zenoh.client.options import routing_args
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.server.config.manifest import load_manifest
    from lerobot_zenoh.telemetry.fleet import FleetView
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import loopback_settings

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        cfg.checkpoint = ensure_checkpoint(cfg)
    except subprocess.CalledProcessError as exc:
        print(f"demo FAILED: lerobot-zenoh-build-checkpoint exited with {exc.returncode} (see above)", file=sys.stderr)
        return 1
    manifest_path = demo_manifest(cfg, out)
    manifest = load_manifest(manifest_path)
    entry = manifest.server[0]
    app = manifest.app_key(entry)
    # This run's own server id: readiness is this server answering, never another one on the port.
    server_id = f"demo-{os.getpid()}"
    clients = [f"robot_{i}" for i in range(1, cfg.robots + 1)]
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}

    print(f"== starting the policy server on tcp/127.0.0.1:{cfg.port}: loading and warming up {cfg.policy} "
          f"({cfg.checkpoint}); log in {out / 'server.log'}", flush=True)
    t_start = time.monotonic()
    server_log = open(out / "server.log", "w")
    server = subprocess.Popen([_bin("lerobot-policy-server"), f"--manifest={manifest_path}", f"--server_id={server_id}"],
                              stdout=server_log, stderr=subprocess.STDOUT, env=env)
    robots: list[subprocess.Popen] = []
    interrupted = False
    try:
        if not _wait_ready(cfg.port, app.status, server_id, server, out / "server.log"):
            server.wait()
            return report_failure(out, clients, [], server.returncode, "the policy server did not start", cfg.port)
        print(f"== server ready in {time.monotonic() - t_start:.0f} s; starting {len(clients)} simulated robots "
              f"for {cfg.seconds:g} s", flush=True)
        for i, client_id in enumerate(clients):
            cmd = [
                _bin("lerobot-robot-client"), "--robot.type=zenoh_sim", f"--robot.id={client_id}",
                f"--robot.seed={i}", *routing_args(app, client_id, f"tcp/127.0.0.1:{cfg.port}"),
                f"--fps={entry.fps}", f"--duration_s={cfg.seconds}", f"--task={TASKS[i % len(TASKS)]}",
                f"--summary_path={out / (client_id + '.json')}",
                # A robot started on a busy machine may need longer than the default to see the server.
                "--discovery_timeout_s=120",
            ]
            if cfg.record and i == 0:
                cmd += [f"--dataset.repo_id=local/demo_{client_id}", f"--dataset.root={out / 'dataset'}",
                        f"--dataset.episode_time_s={cfg.seconds}", "--dataset.num_episodes=1"]
            log = open(out / f"{client_id}.log", "w")
            robots.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        fleet = FleetView()
        t0 = time.monotonic()
        with ZenohSession(loopback_settings(None, listen=False, connect_ports=(cfg.port,))) as session:
            session.subscribe(f"{app.prefix}/*/metrics", lambda key, payload: fleet.on_telemetry(
                key, codec.decode_telemetry(payload), time.monotonic()))
            # Each robot stops itself after --seconds of running (however long its start took); the
            # demo waits for them all, unless the server dies under them.
            while any(p.poll() is None for p in robots) and server.poll() is None:
                time.sleep(1.0)
                codes = {cid: proc.poll() for cid, proc in zip(clients, robots)}
                print(live_line(fleet, clients, time.monotonic() - t0, out, codes), flush=True)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave processes behind
        if interrupted:
            print("\n== Ctrl-C: stopping the robots and the server", flush=True)
        for proc in robots:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in robots:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if interrupted and server.poll() is None:
            try:  # a terminal's Ctrl-C reached the server too; another SIGINT would cut its stop short
                server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass  # (the demo alone was interrupted: `kill -INT`)
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        server_log.close()
    if interrupted:
        print_table(out, clients, [p.returncode for p in robots])
        print(f"\ndemo stopped by Ctrl-C (server exit code {server.returncode}); logs and JSON summaries in {out}")
        return 0
    return print_summary(out, clients, [p.returncode for p in robots], server.returncode)


def report_failure(out: Path, clients: list[str], codes: list[int | None], server_code: int | None, why: str,
                   port: int | None = None) -> int:
    """Name each process that failed, its exit code and the last lines of its log."""
    print(f"\ndemo FAILED: {why}", file=sys.stderr)
    failed = [("policy server", "server.log", server_code)] if server_code not in (0, None) or not codes else []
    for client_id, code in zip(clients, codes):
        path = out / f"{client_id}.json"
        summary = json.loads(path.read_text()) if path.exists() else {}
        if code != 0 or not summary.get("chunks_received"):
            failed.append((client_id, f"{client_id}.log", code))
    for name, log_name, code in failed:
        what = "was killed" if code is not None and code < 0 else f"exit code {code}"
        print(f"-- {name} ({what}); last lines of {out / log_name}:", file=sys.stderr)
        for line in _tail(out / log_name, 8):
            print(f"   {line}", file=sys.stderr)
    if port is not None and failed and failed[0][0] == "policy server" and any("the address is in use" in line
                                                         for line in _tail(out / "server.log", 8)):
        print(f"-- the port was taken while the demo started: choose another with {port_hint(next_free_port(port))}",
              file=sys.stderr)
    return 1


def print_table(out: Path, clients: list[str], codes: list[int | None]) -> bool:
    """The per-robot table; True when every robot exited 0 with chunks received."""
    cols = [("robot", 10), ("exit", 5), ("steps", 6), ("actions", 8), ("chunks", 7), ("rtt p50", 8),
            ("rtt p99", 8), ("infer p50", 10), ("period p99", 11), ("empty", 6), ("trimmed", 8), ("overruns", 9),
            ("rtc delay", 10)]
    print()
    print("  ".join(name.rjust(width) for name, width in cols))
    ok = True
    for client_id, code in zip(clients, codes):
        path = out / f"{client_id}.json"
        s = json.loads(path.read_text()) if path.exists() else {}
        ok &= code == 0 and bool(s) and s.get("chunks_received", 0) > 0
        ms = lambda v: "-" if v is None else f"{v:.1f}ms"  # noqa: E731
        row = [client_id, str(code), str(s.get("steps", "-")), str(s.get("actions_executed", "-")),
               str(s.get("chunks_received", "-")), ms(s.get("rtt_ms_p50")), ms(s.get("rtt_ms_p99")),
               ms(s.get("inference_ms_p50")), ms(s.get("control_period_ms_p99")),
               str(s.get("empty_buffer_cycles", "-")), str(s.get("trimmed_steps", "-")), str(s.get("loop_overruns", "-")),
               _rtc_cell(s.get("rtc") or {})]
        print("  ".join(v.rjust(width) for v, (_, width) in zip(row, cols)))
    print(COLUMNS)
    return ok


#: What the table's columns mean (printed under it; README, "make demo").
COLUMNS = """
steps: control steps run; actions: steps that executed a policy action; chunks: action chunks received.
rtt: observation sent -> its chunk back; infer: the server's inference per chunk; period: the control
loop's step period (1/fps when on time). empty: steps with no action to execute (the robot held its
position); trimmed: actions dropped because their step had passed when their chunk arrived; overruns:
steps that ended after their deadline; rtc delay: real-time chunking's inference delay, predicted/actual
median in steps ("off": the server does not offer it)."""


def print_summary(out: Path, clients: list[str], codes: list[int | None], server_code: int | None) -> int:
    ok = print_table(out, clients, codes)
    print(f"\nserver exit code {server_code}; logs and JSON summaries in {out}")
    if ok and server_code == 0:
        print("demo OK")
        return 0
    why = "the policy server stopped during the run" if server_code != 0 else "a robot failed"
    return report_failure(out, clients, codes, server_code, why)


def _rtc_cell(rtc: dict) -> str:
    """Real-time chunking in the table: `predicted/actual` delay p50 in control steps, or `off`."""
    if not rtc.get("active"):
        return "off"
    p, a = rtc.get("delay_predicted_steps_p50"), rtc.get("delay_actual_steps_p50")
    return "-" if p is None or a is None else f"{p:.0f}/{a:.0f}"


if __name__ == "__main__":
    sys.exit(main())
