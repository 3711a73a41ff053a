"""Where this project's time goes, sampled with py-spy (`pip install py-spy`; needs ptrace, e.g. root).

    python -m benchmarks.studies.profile_ours latency [--workload cam2_480x640] [--seconds 15]
    python -m benchmarks.studies.profile_ours ingest [--clients 100] [--seconds 10] [--policy-ms 50]

latency: our client and server processes on the host's loopback, round trips back to back; both
         processes are sampled. ingest: the server taking in N simulated clients; the server is sampled.
Prints, per process, the CPU milliseconds per round trip (or per second) spent under each of the
functions that matter (inclusive, so a frame counts wherever it appears in a stack) and the hottest
leaf frames. Samples are of running threads only (`py-spy` leaves idle ones out), so the numbers are
CPU time, not waiting. Raw stacks are kept in `outputs/bench/profile/`.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import time


from benchmarks.common import FPS, MAIN_WORKLOAD, free_port
from benchmarks.worker import ROOT, Worker

RATE_HZ = 400
# (label, regex on one frame): inclusive time under each
def _fn(name: str, path: str = "") -> str:
    """A regex for one frame of py-spy's raw output: `Class.name (path/file.py:line)`."""
    return rf"(?:^|\.){re.escape(name)} \({re.escape(path)}"


# (label, regex on one frame): inclusive CPU time under each
MARKERS = [
    ("JPEG encode (codec.encode_jpeg)", _fn("encode_jpeg")),
    ("JPEG decode (codec.decode_jpeg)", _fn("decode_jpeg")),
    ("msgpack encode (codec.encode)", _fn("encode", "lerobot_zenoh/protocol/codec")),
    ("msgpack decode + checks (codec.decode)", _fn("decode", "lerobot_zenoh/protocol/codec")),
    ("Zenoh put (Publisher.put)", _fn("put", "lerobot_zenoh/transport/session")),
    ("Zenoh callback -> handler (Subscription._on_sample)", _fn("_on_sample")),
    ("  of which payload.to_bytes (copy, client's chunks)", _fn("_key_and_payload")),
    ("server: observation copy out of Zenoh's buffer (Payload.__bytes__)", _fn("__bytes__", "lerobot_zenoh/transport/session")),
    ("server: admission (Ingest.on_observation)", _fn("on_observation", "lerobot_zenoh/server/ingest")),
    ("server: _take (announce + msgpack decode of fresh slots)", _fn("_take")),
    ("server: _prepare (checks + JPEG decode)", _fn("_prepare")),
    ("server: policy (runner.run, subtracted from RTT)", _fn("run", "lerobot_zenoh/server/runners")),
    ("server: publish chunk (_publish)", _fn("_publish")),
    ("server: status responder polling (Responder._run)", _fn("_run", "lerobot_zenoh/transport/session")),
    ("client: control step (ControlLoop.step)", _fn("step", "lerobot_zenoh/client/control_loop")),
    ("client: publisher thread (ObservationPublisher.run)", _fn("run", "lerobot_zenoh/client/observation_publisher")),
    ("client: receiver (ChunkReceiver.handle)", _fn("handle", "lerobot_zenoh/client/chunk_receiver")),
    ("client: buffer merge", _fn("merge", "lerobot_zenoh/scheduling")),
    ("telemetry", r"TelemetryPublisher|telemetry_figures"),
]


def _pyspy() -> str:
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(exe):
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
    return exe


def _record(pid: int, seconds: float, path: str) -> subprocess.Popen:
    return subprocess.Popen([_pyspy(), "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", str(RATE_HZ),
                             "--nonblocking", "--threads", "--format", "raw", "--output", path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _analyse(path: str, per: float, unit: str, top: int = 12) -> str:
    stacks = []
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if stack:
                stacks.append((stack.split(";"), int(count)))
    total = sum(c for _, c in stacks)
    ms = lambda n: n / RATE_HZ * 1000 / per  # noqa: E731
    out = [f"  sampled CPU: {ms(total):.2f} ms {unit}"]
    by_thread = collections.Counter()
    for frames, c in stacks:
        by_thread[re.sub(r" \(?0x[0-9a-f]+\)?|\s*\(\d+\)", "", frames[0])] += c
    out.append("  by thread: " + ", ".join(f"{t} {ms(c):.2f}" for t, c in by_thread.most_common(6)))
    for label, pattern in MARKERS:
        rx = re.compile(pattern)
        n = sum(c for frames, c in stacks if any(rx.search(f) for f in frames[1:]))
        if n:
            out.append(f"  {label:<58} {ms(n):7.2f} ms {unit} ({100 * n / total:4.1f} %)")
    leaves = collections.Counter()
    for frames, c in stacks:
        leaves[re.sub(r":\d+\)", ")", frames[-1])] += c
    out.append("  hottest leaf frames:")
    for frame, c in leaves.most_common(top):
        out.append(f"    {ms(c):7.2f} ms  {frame[:110]}")
    return "\n".join(out)


def profile_latency(args, out_dir: str) -> None:
    port = free_port()
    work = os.path.join(out_dir, "work")
    server = Worker("profile-server", [], out_dir, work)
    client = Worker("profile-client", [], out_dir, work)
    try:
        server.create("OursServer", listen=[f"tcp/127.0.0.1:{port}"], models=[{"app": args.workload, "workload": args.workload}])
        client.create("OursClient", workload=args.workload, endpoint=f"tcp/127.0.0.1:{port}")
        client.call("round_trips", n=20)
        paths = {p: os.path.join(out_dir, f"latency-{p}.txt") for p in ("client", "server")}
        recs = [_record(client.pid, args.seconds, paths["client"]), _record(server.pid, args.seconds, paths["server"])]
        n, rtts, t_end = 0, [], time.monotonic() + args.seconds
        while time.monotonic() < t_end:
            r = client.call("round_trips", n=25)
            n += len(r["rtt_ms"])
            rtts += r["rtt_ms"]
        for rec in recs:
            rec.wait(timeout=60)
    finally:
        client.close()
        server.close()
    import numpy as np

    print(f"ours, {args.workload}, loopback: {n} round trips in {args.seconds:.0f} s, RTT median {np.median(rtts):.2f} ms")
    for p in ("client", "server"):
        print(f"{p} process (CPU ms per round trip)")
        print(_analyse(paths[p], n, "per round trip"))


def profile_ingest(args, out_dir: str) -> None:
    port = free_port()
    work = os.path.join(out_dir, "work")
    server = Worker("profile-ingest-server", [], out_dir, work)
    pub = Worker("profile-ingest-publisher", [], out_dir, work)
    path = os.path.join(out_dir, f"ingest-{args.clients}.txt")
    try:
        server.create("OursServer", listen=[f"tcp/127.0.0.1:{port}"],
                      models=[{"app": "ingest", "workload": MAIN_WORKLOAD, "latency_ms": args.policy_ms,
                               "max_unknown_clients": args.clients + 16}])
        pub.create("IngestPublisher", system="ours", endpoint=f"tcp/127.0.0.1:{port}", workload=MAIN_WORKLOAD,
                   max_clients=args.clients, app="ingest")
        pub.send("publish", n_clients=args.clients, duration_s=args.seconds + 2)
        time.sleep(1.5)
        s0, c0 = server.call("stats"), server.cpu_s()
        rec = _record(server.pid, args.seconds, path)
        rec.wait(timeout=args.seconds + 60)
        s1, c1 = server.call("stats"), server.cpu_s()
        pub.result(timeout_s=120)
    finally:
        pub.close()
        server.close()
    d = {k: s1[k] - s0[k] for k in s1}
    print(f"ours, ingest of {args.clients} clients x {FPS} Hz: server {((c1 - c0) / args.seconds):.2f} cores; "
          f"in {args.seconds:.0f} s: received {d['received']}, served {d['served']}, superseded {d['superseded']}, "
          f"msgpack-decoded {d['decoded_observations']}, JPEG frames decoded {d['decoded_jpegs']}")
    print("server process (CPU ms per second of wall time; 1000 = one core)")
    print(_analyse(path, args.seconds, "per s"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("latency", "ingest"))
    parser.add_argument("--workload", default=MAIN_WORKLOAD)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--policy-ms", type=float, default=50.0)
    parser.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench", "profile"))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    (profile_latency if args.what == "latency" else profile_ingest)(args, args.out)


if __name__ == "__main__":
    main()
