"""How long each console-script mistake takes to be reported, and `--help` of every script.

    python -m benchmarks.studies.cli_mistakes                     # this checkout
    python -m benchmarks.studies.cli_mistakes --baseline=HEAD~5   # and a git revision, side by side

Each case is a cold `python -m lerobot_zenoh.cli.<script> ...` process, timed from start to exit (what
a user waits for after pressing Enter), with its exit code and first line of stderr. With
`--baseline`, the revision is extracted into a temporary folder (`git archive`) and every case runs
against both trees, alternating, so both columns see the same machine load. The "wrong --model_id"
case runs against a synthetic-policy server (manifests/synthetic.yaml) this script starts and stops.
Prints one table; times are medians of `--repeat` runs.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPTS = {
    "lerobot-robot-client": "client", "lerobot-policy-server": "server",
    "lerobot-zenoh-build-checkpoint": "build_checkpoint", "lerobot-zenoh-monitor": "monitor",
    "lerobot-zenoh-router": "router", "lerobot-zenoh-secure": "secure", "lerobot-zenoh-plan": "plan",
    "lerobot-zenoh-profile": "profile", "lerobot-zenoh-admit": "admit", "lerobot-zenoh-cache": "cache",
}
SIM = "--robot.type=zenoh_sim"

#: (what the user got wrong, script, arguments); {dead}: a port nothing listens on, {live}: the
#: synthetic server's port, {tmp}: a scratch folder.
CASES = [
    ("--fps=abc", "lerobot-robot-client", [SIM, "--fps=abc"]),
    ("--fps=0", "lerobot-robot-client", [SIM, "--fps=0"]),
    ("missing --robot.type", "lerobot-robot-client", []),
    ("unknown --robot.type", "lerobot-robot-client", ["--robot.type=so101_folower"]),
    ("unknown flag", "lerobot-robot-client", [SIM, "--num_episodes=2"]),
    ("--failsafe=stop", "lerobot-robot-client", [SIM, "--failsafe=stop"]),
    ("--robot.port missing", "lerobot-robot-client", ["--robot.type=so101_follower", "--robot.port=/dev/ttyACM_nope"]),
    ("--dataset.repo_id=nouser", "lerobot-robot-client", [SIM, "--dataset.repo_id=nouser"]),
    ("read-only --dataset.root", "lerobot-robot-client", [SIM, "--dataset.repo_id=local/x", "--dataset.root=/proc/x/y"]),
    ("dead --endpoint", "lerobot-robot-client", [SIM, "--endpoint=127.0.0.1:{dead}"]),
    ("wrong --model_id", "lerobot-robot-client", [SIM, "--endpoint=127.0.0.1:{live}", "--model_id=smolvla"]),
    ("--task over 2,048 bytes", "lerobot-robot-client", [SIM, "--task=" + "x" * 3000]),
    # {listed}: a synthetic server serving robot_0 only, whose model reads at most 8 tokens of the task.
    ("client id not listed", "lerobot-robot-client", [SIM, "--endpoint=127.0.0.1:{listed}", "--client_uuid=stranger"]),
    ("fps mismatch", "lerobot-robot-client", [SIM, "--endpoint=127.0.0.1:{listed}", "--fps=10"]),
    ("camera missing", "lerobot-robot-client", [SIM, "--endpoint=127.0.0.1:{listed}", "--robot.cameras={{front: [96, 128]}}"]),
    ("camera size", "lerobot-robot-client", [SIM, "--endpoint=127.0.0.1:{listed}",
                                             "--robot.cameras={{front: [48, 64], wrist: [96, 128]}}"]),
    ("task over the token limit", "lerobot-robot-client", [SIM, "--endpoint=127.0.0.1:{listed}", "--duration_s=30",
                                                          "--task=pick up the red cube and put it in the blue box"]),
    ("LeRobot --pretrained_name_or_path", "lerobot-robot-client", [SIM, "--pretrained_name_or_path=lerobot/smolvla_base"]),
    ("server: LeRobot --host/--port", "lerobot-policy-server", ["--host=0.0.0.0", "--port=8080"]),
    ("server: no --policy.path", "lerobot-policy-server", []),
    ("server: missing folder", "lerobot-policy-server", ["--policy.path={tmp}/checkpoints/demo_actt",
                                                         "--endpoint=tcp/127.0.0.1:{dead}"]),
    ("build-checkpoint: --state_dim=0", "lerobot-zenoh-build-checkpoint", ["--output={tmp}/never", "--state_dim=0"]),
    ("plan: missing factory", "lerobot-zenoh-plan", ["--factory={tmp}/nope.yaml", "--profiles={tmp}/nope.yaml"]),
] + [(f"{script} --help", script, ["--help"]) for script in SCRIPTS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(tree: Path, script: str, args: list[str]) -> tuple[float, int | None, str]:
    module = f"lerobot_zenoh.cli.{SCRIPTS[script]}"
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env,
                              cwd=tree, timeout=120)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - t0, None, "(timed out after 120 s)"
    elapsed = time.perf_counter() - t0
    if proc.returncode == 1 and "No module named" in proc.stderr and "lerobot_zenoh.cli." in proc.stderr:
        return elapsed, None, "(no such script in this tree)"
    progress = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ INFO ")  # the client's "starting: ..." lines
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not progress.match(line)]
    if "--help" in args:
        lines = [f"{len(proc.stdout.splitlines())} lines of help"]
    return elapsed, proc.returncode, (lines[-1] if "Traceback" in proc.stderr else lines[0]) if lines else ""


#: The {listed} server's manifest: robot_0 only, and a token limit the long task is over.
LISTED = """cluster_uuid: local
experiment_tag: listed
zenoh: {multicast_scouting: false}
server:
  - model_id: synthetic
    model_version: v1
    application_tag: listed
    synthetic: {cameras: {front: [96, 128], wrist: [96, 128]}, latency_ms: 40, max_task_tokens: 8}
    fps: 30
    clients: [{client_uuid: robot_0}]
"""


def start_server(tree: Path, port: int, log: Path, manifest: str = "manifests/synthetic.yaml") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "lerobot_zenoh.cli.server", f"--manifest={manifest}",
                             f"--endpoint=tcp/127.0.0.1:{port}"], stdout=out, stderr=subprocess.STDOUT, env=env,
                            cwd=tree)
    deadline = time.monotonic() + 180
    while "ready" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the synthetic server did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    return proc


def baseline_tree(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    tree = into / "baseline"
    tree.mkdir()
    archive_path = into / "baseline.tar"
    archive_path.write_bytes(archive)
    with tarfile.open(archive_path) as tar:
        tar.extractall(tree, filter="data")
    return tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a git revision to time side by side with this checkout")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case and tree (median)")
    parser.add_argument("--only", help="run only the cases whose name contains this")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        trees = {"now": ROOT}
        if args.baseline:
            trees = {"before": baseline_tree(args.baseline, tmp), **trees}
        (tmp / "checkpoints" / "demo_act").mkdir(parents=True)  # the folder a typo misses
        dead, live, listed = free_port(), free_port(), free_port()
        cases = [c for c in CASES if not args.only or args.only in c[0]]
        servers = []
        if any("{live}" in " ".join(c[2]) for c in cases):
            servers.append(start_server(ROOT, live, tmp / "server.log"))
        if any("{listed}" in " ".join(c[2]) for c in cases):
            (tmp / "listed.yaml").write_text(LISTED)
            servers.append(start_server(ROOT, listed, tmp / "listed.log", str(tmp / "listed.yaml")))
        rows = []
        try:
            for name, script, case_args in cases:
                argv = [a.format(dead=dead, live=live, listed=listed, tmp=tmp) for a in case_args]
                results: dict[str, list] = {label: [] for label in trees}
                for _ in range(args.repeat):
                    for label, tree in trees.items():
                        results[label].append(run_case(tree, script, argv))
                row = [name]
                for label in trees:
                    times = [t for t, _, _ in results[label]]
                    _, code, line = results[label][-1]
                    row += [f"{statistics.median(times):.2f}", "-" if code is None else str(code)]
                row.append(results["now"][-1][2][:110])
                rows.append(row)
                print("  ".join(row), file=sys.stderr, flush=True)
        finally:
            for server in servers:
                server.terminate()
                server.wait(timeout=30)
    heads = ["mistake"]
    for label in trees:
        heads += [f"{label} s", "exit"]
    heads.append("what the user reads now")
    widths = [max(len(r[i]) for r in [heads, *rows]) for i in range(len(heads))]
    print(f"\n{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, Python {sys.version.split()[0]}; "
          f"baseline {args.baseline or '-'}; median of {args.repeat}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(heads, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
