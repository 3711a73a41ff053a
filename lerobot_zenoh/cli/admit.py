"""`lerobot-zenoh-admit --deployment=DIR --task=T [--robot=ID]`: admit one robot into a running fleet.

DIR is what `lerobot-zenoh-plan --output=DIR` wrote. Placement-preserving admission
(`pipelines.fleet_admission.admit`, docs/pipelines.md "Admission control") decides on the factory, profiles
and exact plan stored there. Refused: the reason in one line on stderr, exit 1, no file touched.
Admitted: plan.json, plan_state.json and the manifests of the servers that changed are rewritten,
each running server among them (its `run/srvN.pid`, written by servers.sh) is sent SIGHUP and re-reads
its client list and task streams (docs/server.md, "Reloading the client list"), the robot's client
command is printed and appended to DIR/admitted.sh. With `--confirm_s` > 0 each signalled server is
then asked, over Zenoh at its planned endpoint, whether it serves the robot (`status?client=<id>`).

Exit codes: 0 admitted (and taken by every running server); 1 refused; 2 a configuration mistake in
one line naming the field (a deployment that cannot be read, a task its factory does not have); 3
admitted and written, but a signalled server did not take it within `--confirm_s` (named: see its log).
"""

from __future__ import annotations

import fcntl
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PROG = "lerobot-zenoh-admit"
EXIT_REFUSED = 1
EXIT_NOT_TAKEN = 3


@dataclass
class AdmitConfig:
    # The deployment folder lerobot-zenoh-plan wrote (--output).
    deployment: str
    # The factory task the robot runs.
    task: str
    # The robot's client id; default `<task>-r<n>`, the next free number of its class.
    robot: str | None = None
    # Seconds to wait for each signalled server to serve the robot (status query over Zenoh); 0: do not ask.
    confirm_s: float = 10.0


def main(argv: list[str] | None = None) -> int:
    from lerobot_zenoh.command_line import EXIT_CONFIG, parse

    args = parse(AdmitConfig, argv, PROG)
    if not Path(args.deployment).is_dir():
        print(f"{PROG}: deployment: {args.deployment} is not a folder", file=sys.stderr)
        return EXIT_CONFIG
    # One admission at a time per deployment (each reads the plan the previous one wrote): a lock on
    # the folder itself, so that a refusal leaves no file behind.
    folder = os.open(args.deployment, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        return _admit(args)
    finally:
        os.close(folder)


def _admit(args: AdmitConfig) -> int:
    from lerobot_zenoh.command_line import EXIT_CONFIG, one_line
    from lerobot_zenoh.errors import ConfigError
    from lerobot_zenoh.pipelines.fleet_admission import admit
    from lerobot_zenoh.pipelines.deployment import apply_admission, client_command, load_deployment

    try:
        factory, profiles, plan = load_deployment(args.deployment)
    except ConfigError as exc:
        print(f"{PROG}: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    decision = admit(factory, profiles, plan, args.task, args.robot)
    if args.task not in factory.tasks:  # a user's mistake, not a refusal
        print(f"{PROG}: task: {one_line(decision.reason)}", file=sys.stderr)
        return EXIT_CONFIG
    if not decision.admitted:
        print(f"{PROG}: refused {decision.robot or args.task}: {one_line(decision.reason)}", file=sys.stderr)
        return EXIT_REFUSED
    changed = apply_admission(factory, plan, decision.plan, decision.robot, args.deployment)
    print(f"admitted {decision.robot} ({args.task} at {decision.rate_hz:.3f} Hz): {decision.reason}")
    not_taken = []
    for index in changed:
        state = _signal(Path(args.deployment), index)
        if state == "signalled" and args.confirm_s > 0 and decision.robot in _clients(decision.plan, index):
            state = "reloaded" if _serves(factory, decision.plan, index, decision.robot, args.confirm_s) else \
                f"signalled, but it does not serve {decision.robot} after {args.confirm_s:g} s: see its log"
            if state != "reloaded":
                not_taken.append(f"srv{index}")
        print(f"srv{index}: {state}")
    print(client_command(factory, decision.plan, decision.robot, Path(args.deployment) / "plan.json"))
    if not_taken:
        print(f"{PROG}: admitted and written, but not taken by {', '.join(not_taken)}", file=sys.stderr)
        return EXIT_NOT_TAKEN
    return 0


def _clients(plan, index: int) -> set[str]:
    return {rid for sh in plan.servers[index].shares for rid in sh.robot_ids}


def _signal(deployment: Path, index: int) -> str:
    """SIGHUP to the server started from manifests/srvN.yaml, found by its pid file; what happened."""
    from lerobot_zenoh.pipelines.deployment import pid_path

    path = pid_path(deployment, index)
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return "manifest updated (not running: it reads it at start)"
    cmdline = Path(f"/proc/{pid}/cmdline")
    try:  # a stale pid file whose id went to another process must not be signalled
        if cmdline.exists() and f"/srv{index}.yaml".encode() not in cmdline.read_bytes():
            return f"manifest updated (pid {pid} in {path} is not its server: not signalled)"
        os.kill(pid, signal.SIGHUP)
    except (ProcessLookupError, FileNotFoundError):
        return f"manifest updated (pid {pid} in {path} is gone: it reads it at start)"
    except PermissionError:
        return f"manifest updated (not allowed to signal pid {pid}: send it SIGHUP)"
    return "signalled"


def _serves(factory, plan, index: int, robot: str, timeout_s: float) -> bool:
    """Whether server `index` answers its status query naming `robot` with client_admitted, in time."""
    from lerobot_zenoh.client.discovery import query_status
    from lerobot_zenoh.errors import TransportError
    from lerobot_zenoh.pipelines.deployment import application_tag, server_endpoint
    from lerobot_zenoh.protocol.keys import AppKey
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import ZenohSettings

    served = factory.models[plan.servers[index].model]
    app = AppKey(factory.cluster_uuid, factory.experiment_tag, served.model_id, served.model_version,
                 application_tag(plan.servers[index]))
    settings = ZenohSettings(mode="client", connect=[server_endpoint(factory, index)], multicast_scouting=False,
                             connect_timeout_s=timeout_s)
    deadline = time.monotonic() + timeout_s
    try:
        with ZenohSession(settings) as session:
            while time.monotonic() < deadline:
                status = query_status(session, app, timeout_s=min(0.5, max(0.05, deadline - time.monotonic())),
                                      client_uuid=robot)
                if status is not None and status.client_admitted:
                    return True
                time.sleep(0.05)
    except TransportError:
        pass  # its endpoint cannot be reached from here
    return False


if __name__ == "__main__":
    sys.exit(main())
