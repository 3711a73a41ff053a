"""Edge-only vs cloud-only vs hybrid serving (Kairos Fig. 13) on the real stack, over shaped links.

Three network namespaces and two shaped links (TUN delay lines of `testbed/netns.py`, or netem
where the kernel has it):

    robots  10.78.1.1 ==== 2.5 ms one way, 300 Mbit/s ==== 10.78.1.2  edge  10.78.2.1 ==== --wan-ms one way
    (default 100 ms: a 200 ms round trip), --wan-mbit (default 1 Gbit/s) ==== 10.78.2.2  cloud

Link delays are ONE WAY, each direction, as in `benchmarks/studies/fleet.py`: Kairos (§5.1) gives each link
a "base latency" beside per-direction bandwidths (Wi-Fi 7: 2.5 ms, 2 Gbps up, 3 Gbps down; WAN:
100 ms, 1 Gbps symmetric), i.e. the delay of a packet in one direction; a round trip is twice it.

What is real: the edge scheduler (`lerobot-policy-server` with `engines`: its own loop as the edge
engine, wait-ratio order, Kairos placement), the cloud engine (`lerobot-policy-server` with `role:
engine`), Zenoh over the shaped links, the codec, the relay of every chunk through the edge. What is
simulated: the robots (one driver process; a task is `--rounds` rounds, each: send an observation
with one 96x128 JPEG camera, wait for its chunk, execute `--steps` actions at 30 Hz, then the next
round: synchronous, so the inference latency is on the task's critical path) and the GPUs (the
synthetic policy sleeps its profile's latency for the batch size, no compute).

GPU-like profiles (ms per forward pass by batch size; chosen shapes, not measurements: a VLA-sized
flow-matching model, the cloud card about 1.8x faster, as an A100 against an A6000, each batching
well up to its capacity):

    edge  (A6000-like, N_e = 4):  1: 80, 2: 86, 4: 100, 8: 135
    cloud (A100-like,  N_c = 8):  1: 45, 2: 48, 4: 55, 8: 72, 16: 110

`--profile vla`: the VLA-shaped pair, the tiny SmolVLA's measured batch curve (`PROFILES`) scaled to
the same batch-1 times (edge 80 / 86.6 / 97.5 / 151.5 ms, cloud 45 / 48.7 / 54.8 / 85.2 / 146 ms):
it batches better up to 4 and worse beyond.

Modes: ``edge`` (engines: the edge's own loop only), ``cloud`` (engines: the cloud engine only;
robots still talk to the edge, which relays), ``hybrid`` (both; Kairos placement). Tasks arrive by a
Poisson process at each `--rates` value (tasks/s), each on a new robot (a new wait-ratio task);
latency = arrival to the last action executed, for tasks arriving after `--warmup-s` within
`--duration-s`; mean, P25, P95 over `--seeds` seeds per point.

    python -m benchmarks.studies.hybrid study --rates 2,4,6,8 --seeds 3 --duration-s 20   # make bench-hybrid
    python -m benchmarks.studies.hybrid study --wan-ms 50 ...  # a 50 ms one-way (100 ms round-trip) WAN
    python -m benchmarks.studies.hybrid study --no-netns ...   # loopback, no shaping (a smoke run only)
    python -m benchmarks.studies.hybrid wan --rate 10 --wan 25:1000,100:1000,200:1000,100:100   # Kairos Fig. 17
    python -m benchmarks.studies.hybrid scaleout ...   # n engines vs n servers: mean task latency at a fixed load
    (the issue's scale-out metric, robots carried within the stall budget: benchmarks/studies/fleet_scaleout.py)

`wan` runs the hybrid mode only, under each edge-cloud link `<one-way ms>:<Mbit/s>` in turn (the
link is reshaped between runs; the scheduler measures the new round trip and bandwidth itself),
and reports the offload share and the mean task latency.

Seeds: task arrivals are drawn exactly as the fleet model's online arrivals
(`benchmarks/studies/fleet.py --uniform-tasks ROUNDS STEPS --hybrid-rates R`, `arrival_times` below), so a
seed is the same arrival times in both, and a real run sits beside the model's run of that seed.

With a GPU (one real engine on the GPU as the cloud tier): `--checkpoint PATH` makes
both tiers load that LeRobot checkpoint instead of the synthetic policies, the edge on the CPU and the
cloud engine on `--device cuda --dtype bfloat16`; both profiles are then measured at start-up (the
edge's own, and the one the cloud engine reports), and the robots send what the status asks for
(its cameras at their sizes, its state size). `--edge-cpus 0,1` pins the edge server to those cores
(as many torch threads), so that one lent GPU machine holds an edge slower than its cloud engine
(docs/benchmarks.md, "A VLA on a GPU as the cloud tier").

Needs root (`ip netns`) for the shaped links.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from benchmarks.harness.processes import stop_processes  # noqa: E402

EDGE_PROFILE_MS = {1: 80, 2: 86, 4: 100, 8: 135}
CLOUD_PROFILE_MS = {1: 45, 2: 48, 4: 55, 8: 72, 16: 110}
#: The VLA-shaped pair (`--profile vla`): the tiny SmolVLA's measured CPU medians by batch size
#: (docs/benchmarks.md, "VLAs: chunk latency by batch size": 42.5 / 46.0 / 51.8 / 80.5 ms at 1 / 2 / 4
#: / 8; 16 extrapolated on the 4 -> 8 slope), scaled so batch 1 takes the GPU-like pair's 80 ms at
#: the edge and 45 ms in the cloud.
_SMOLVLA_MS = {1: 42.5, 2: 46.0, 4: 51.8, 8: 80.5, 16: 80.5 + 8 * (80.5 - 51.8) / 4}
PROFILES = {"gpu": (EDGE_PROFILE_MS, CLOUD_PROFILE_MS),
            "vla": ({b: round(80 * ms / 42.5, 1) for b, ms in _SMOLVLA_MS.items() if b <= 8},
                    {b: round(45 * ms / 42.5, 1) for b, ms in _SMOLVLA_MS.items()})}
EDGE_CAPACITY, CLOUD_CAPACITY = 4, 8
ROBOT_EDGE = ("10.78.1.1", "10.78.1.2", 2.5, 300.0)  # robots addr, edge addr, one-way ms, Mbit/s
EDGE_CLOUD = ("10.78.2.1", "10.78.2.2", 100.0, 1000.0)  # edge addr, cloud addr, one-way ms (Kairos), Mbit/s
EDGE_PORT, CLOUD_PORT = 8050, 8051
APP = ("bench", "hybrid", "vla", "v1", "app")
CAMERA = (96, 128)
MODES = ("edge", "cloud", "hybrid")
#: A robot sends its observation again when no chunk answered it for this long (an observation lost
#: on the way). Not shorter: a resend of a request that still waits replaces it in its slot, so it
#: loses its place in line (and one already dispatched is computed twice), which feeds an overload.
RESEND_S = 10.0


# -- the network --------------------------------------------------------------------------------------


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


class Topology:
    """Namespaces robots / edge / cloud and the two shaped links (see the module docstring)."""

    def __init__(self, log_dir: Path, wan: tuple[float, float] | None = None):
        """`wan`: the edge-cloud link's (one-way ms, Mbit/s), default `EDGE_CLOUD`'s."""
        tag = f"lzh{os.getpid() % 100000}"
        self.specs = [ROBOT_EDGE, EDGE_CLOUD if wan is None else (*EDGE_CLOUD[:2], wan[0], wan[1])]
        self.devs: list[tuple[str, str, str, str]] = []  # (ns_a, ns_b, dev_a, dev_b) per link
        self.ns = {"robots": f"{tag}r", "edge": f"{tag}e", "cloud": f"{tag}c"}
        self.log_dir = log_dir
        self.lines: list[subprocess.Popen] = []
        self.method = ""

    def start(self) -> Topology:
        for ns in self.ns.values():
            _sh("ip", "netns", "add", ns)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        tag = self.ns["robots"][:-1]
        for i, (a, b) in enumerate((("robots", "edge"), ("edge", "cloud"))):
            dev_a, dev_b = f"{tag}{i}a", f"{tag}{i}b"
            self.devs.append((self.ns[a], self.ns[b], dev_a, dev_b))
            self._link(self.ns[a], self.ns[b], dev_a, dev_b, self.specs[i])
        return self

    def reshape_wan(self, one_way_ms: float, mbit: float) -> None:
        """Give the edge-cloud link a new one-way delay and rate (between runs)."""
        ns_a, ns_b, dev_a, dev_b = self.devs[1]
        if self.method == "netem":
            for ns, dev in ((ns_a, dev_a), (ns_b, dev_b)):
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "netem", "delay",
                    f"{one_way_ms}ms", "rate", f"{mbit}mbit", "limit", "1000")
            return
        line = self.lines[1]
        line.stdin.write(f"shape {one_way_ms} {mbit}\n")
        line.stdin.flush()
        if not line.stdout.readline().startswith("ok"):
            raise RuntimeError("delay line refused its shape")

    def _link(self, ns_a: str, ns_b: str, dev_a: str, dev_b: str, spec) -> None:
        addr_a, addr_b, delay_ms, rate_mbit = spec
        try:
            _sh("ip", "link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
            _sh("ip", "link", "set", dev_a, "netns", ns_a)
            _sh("ip", "link", "set", dev_b, "netns", ns_b)
            for ns, dev in ((ns_a, dev_a), (ns_b, dev_b)):
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "netem", "delay",
                    f"{delay_ms}ms", "rate", f"{rate_mbit}mbit", "limit", "1000")
            self.method = "netem"
        except subprocess.CalledProcessError:
            _sh("ip", "netns", "exec", ns_a, "ip", "link", "del", dev_a, check=False)
            log = open(self.log_dir / f"delay_line_{dev_a}.log", "w")
            line = subprocess.Popen(
                [sys.executable, "-m", "testbed.netns", "delay-line", "--client-dev", dev_a, "--server-dev", dev_b,
                 "--client-ns", ns_a, "--server-ns", ns_b],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1, cwd=ROOT)
            if line.stdout.readline().strip() != "ready":
                raise RuntimeError(f"delay line did not start (see {log.name})")
            line.stdin.write(f"shape {delay_ms} {rate_mbit}\n")
            line.stdin.flush()
            if not line.stdout.readline().startswith("ok"):
                raise RuntimeError("delay line refused its shape")
            self.lines.append(line)
            self.method = "tun-delay-line"
        for ns, dev, addr, peer in ((ns_a, dev_a, addr_a, addr_b), (ns_b, dev_b, addr_b, addr_a)):
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "mtu", "1500", "txqueuelen", "10000", "up")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", addr, "peer", peer, "dev", dev)

    def prefix(self, where: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[where]]

    def close(self) -> None:
        for line in self.lines:
            try:
                line.stdin.close()
                line.wait(timeout=5)
            except Exception:
                line.kill()
        for ns in self.ns.values():
            _sh("ip", "netns", "del", ns, check=False)


class Loopback:
    """No namespaces, no shaping (a smoke run of the benchmark's machinery)."""

    method = "host-loopback (no shaping)"

    def start(self) -> Loopback:
        return self

    def prefix(self, where: str) -> list[str]:
        return []

    def close(self) -> None:
        pass


# -- the servers --------------------------------------------------------------------------------------


def _entry(profile_ms: dict, max_batch: int, real: dict | None = None) -> dict:
    """A model entry: the synthetic GPU-like policy, or (`real`: checkpoint, device, dtype) a checkpoint."""
    cluster, experiment, model, version, app = APP
    if real is None:
        source = {"synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 50, "cameras": {"front": list(CAMERA)},
                                "batch_latency_ms": {int(b): float(t) for b, t in profile_ms.items()}},
                  "actions_per_chunk": 50}
    else:
        source = {"pretrained_path": str(Path(real["checkpoint"]).resolve()), "device": real["device"],
                  "dtype": real["dtype"]}
    return {"model_id": model, "model_version": version, "application_tag": app, **source,
            "fps": 30, "accept_unknown_clients": True, "max_unknown_clients": 4096, "max_batch_size": max_batch,
            "scheduler": "wait_ratio"}


def manifests(mode: str, edge_host: str, cloud_host: str, real: dict | None = None,
              profile: str = "gpu", cloud_in_flight: int = 0) -> dict[str, dict]:
    """{"edge": manifest, "cloud": manifest or absent} for `mode`; `real`: {checkpoint, device, dtype} of
    the cloud engine (the edge loads the checkpoint on the CPU), else the synthetic profiles;
    `cloud_in_flight`: the cloud engine's `max_in_flight` (0: its capacity, one batch)."""
    cluster, experiment, *_ = APP
    common = {"cluster_uuid": cluster, "experiment_tag": experiment, "telemetry_period_s": 0,
              "sessions": {"idle_timeout_s": 5, "liveliness_grace_s": 1}, "same_host": False}
    edge_ms, cloud_ms = PROFILES[profile]
    # (the edge publishes telemetry: the driver reads each engine's estimate against its actual)
    engines = []
    if mode in ("edge", "hybrid"):
        engines.append({"engine_id": "local", "tier": "edge", "capacity": EDGE_CAPACITY, "local": True,
                        "profile": edge_ms if real is None else "measured"})
    if mode in ("cloud", "hybrid"):
        engines.append({"engine_id": "cloud0", "tier": "cloud", "capacity": CLOUD_CAPACITY,
                        "endpoint": f"tcp/{cloud_host}:{CLOUD_PORT}", "profile": "measured",
                        "max_in_flight": cloud_in_flight})
    edge = {**common, "server_id": "edge0", "telemetry_period_s": 1.0,
            "zenoh": {"listen": [f"tcp/{edge_host}:{EDGE_PORT}"], "multicast_scouting": False},
            "server": [{**_entry(edge_ms, EDGE_CAPACITY,
                                 None if real is None else {**real, "device": "cpu", "dtype": "float32"}),
                        "engines": engines, "profile_max_batch": EDGE_CAPACITY,
                        "dispatch": {"answer_timeout_s": 2.0, "probe_period_s": 0.5, "start_timeout_s": 60}}]}
    out = {"edge": edge}
    if mode in ("cloud", "hybrid"):
        out["cloud"] = {**common, "role": "engine", "engine_id": "cloud0",
                        "zenoh": {"listen": [f"tcp/{cloud_host}:{CLOUD_PORT}"], "multicast_scouting": False},
                        "server": [{**_entry(cloud_ms, CLOUD_CAPACITY, real), "profile_budget_s": 60}]}
    return out


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "HF_HUB_OFFLINE": "1"}


def start_servers(net, mode: str, work: Path, hosts: tuple[str, str], real: dict | None = None,
                  profile: str = "gpu", cloud_in_flight: int = 0, edge_cpus: str | None = None) -> list[subprocess.Popen]:
    """The servers of `mode`; `edge_cpus` (e.g. ``0,1``): the edge server pinned to those CPUs with
    as many torch threads (an edge-class box beside a cloud GPU on one lent machine)."""
    import yaml

    procs = []
    for name in ("cloud", "edge"):  # the engine first: the edge checks it at start-up
        data = manifests(mode, *hosts, real, profile, cloud_in_flight).get(name)
        if data is None:
            continue
        path = work / f"{mode}-{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        log = open(work / f"{mode}-{name}.log", "w")
        pin, env = [], _env()
        if name == "edge" and edge_cpus:
            pin = ["taskset", "-c", edge_cpus]
            env["OMP_NUM_THREADS"] = str(len(edge_cpus.split(",")))
        procs.append(subprocess.Popen([*net.prefix(name), *pin, sys.executable, "-m", "lerobot_zenoh.cli.server",
                                       f"--manifest={path}", "--log_level=WARNING"],
                                      stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
        if name == "cloud":
            time.sleep(3.0 if real is None else 30.0)  # its load, warm-up and start-up profile
    return procs


# -- the robots ---------------------------------------------------------------------------------------


def drive(endpoint: str, rate: float, seed: int, duration_s: float, warmup_s: float, rounds: int, steps: int,
          tag: str, resend_s: float = RESEND_S) -> dict:
    """Run Poisson task arrivals against the edge at `endpoint` (several, comma-separated: independent
    servers, task i on server i mod n, a static assignment); the result as a dict."""
    import numpy as np

    from lerobot_zenoh.errors import TransportError
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.protocol.keys import AppKey
    from lerobot_zenoh.protocol.messages import ExecutionInfo, Observation
    from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
    from lerobot_zenoh.transport.settings import ZenohSettings

    app = AppKey(*APP)
    rng = np.random.default_rng(seed)
    deadline = time.monotonic() + 180
    sessions = []
    for one in endpoint.split(","):
        while True:  # the edge may still be loading its model (and profiling it)
            try:
                sessions.append(ZenohSession(ZenohSettings(mode="client", connect=[one], multicast_scouting=False,
                                                           connect_timeout_s=5)).open())
                break
            except TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
        while not (replies := sessions[-1].query(app.status, timeout_s=1.0)):
            if time.monotonic() > deadline:
                raise SystemExit(f"{one} never answered its status")
    status = codec.decode_status(replies[0][1])  # what the model reads: its cameras, its state size
    images = {name: codec.encode_jpeg(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
              for name, (h, w) in status.expected_cameras.items()}
    state_dim = status.state_dim or 6
    waiting: dict[str, queue.SimpleQueue] = {}

    def on_chunk(key: str, payload: bytes) -> None:
        box = waiting.get(key.rsplit("/", 2)[-2])
        if box is not None:
            box.put((time.monotonic(), payload))

    for session in sessions:
        session.subscribe(f"{app.prefix}/*/action", on_chunk)
    # The edge scheduler's own account of each engine (its telemetry): placement's latency estimate
    # against the dispatch-to-answer time, over its last 256 requests, as the run ends.
    engine_figures: dict[str, float] = {}

    def on_metrics(key: str, payload: bytes) -> None:
        try:
            figures = codec.decode_telemetry(payload).metrics
        except Exception:
            return
        engine_figures.update({k: v for k, v in figures.items() if k.startswith("engine.")
                               and k.endswith(("estimate_ms_mean", "actual_ms_mean"))})

    sessions[0].subscribe(f"{app.prefix}/server/*/metrics", on_metrics)
    dt = 1 / 30
    results: list[dict] = []
    lock = threading.Lock()

    def task(client_id: str, arrival: float, task_rng, session) -> None:
        box = waiting[client_id] = queue.SimpleQueue()
        pub = session.publisher(app.client(client_id).obs, OBSERVATION_QOS)
        tiers, resends, round_ms = [], 0, []
        for seq in range(1, rounds + 1):
            obs = codec.encode(Observation(seq, client_id, task_rng.normal(size=state_dim).astype(np.float32), images,
                                           "task", execution=ExecutionInfo(time.monotonic() - arrival, 0, dt),
                                           episode_id="e"))
            sent = time.monotonic()
            chunk = None
            while chunk is None:
                pub.put(obs)
                try:
                    while True:
                        _, payload = box.get(timeout=resend_s)
                        c = codec.decode_action_chunk(payload)
                        if c.response_to_seq_id == seq:
                            chunk = c
                            break
                except queue.Empty:
                    resends += 1
                    if time.monotonic() - sent > 30:
                        pub.close()
                        return
            round_ms.append((time.monotonic() - sent) * 1000)
            tiers.append(chunk.tier or "edge")
            time.sleep(steps * dt)  # execute the round's actions
        pub.close()
        waiting.pop(client_id, None)
        with lock:
            results.append({"arrival": arrival, "latency_s": time.monotonic() - arrival, "tiers": tiers,
                            "resends": resends, "round_ms": round_ms})

    t0 = time.monotonic()
    threads = []
    i = 0
    for at in arrival_times(rate, seed, duration_s):
        delay = t0 + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=task, args=(f"{tag}-{i}", time.monotonic(), np.random.default_rng([seed, i]),
                                                     sessions[i % len(sessions)]), daemon=True)
        thread.start()
        threads.append(thread)
        i += 1
    for thread in threads:
        thread.join(timeout=max(1.0, t0 + duration_s + 120 - time.monotonic()))
    for session in sessions:
        session.close()
    kept = sorted(r["latency_s"] for r in results if r["arrival"] - t0 >= warmup_s)
    tiers = [t for r in results for t in r["tiers"]]
    rounds_ms = [m for r in results for m in r["round_ms"]]
    return {"rate": rate, "seed": seed, "tasks": len(kept), "started": i, "finished": len(results),
            "mean_s": statistics.fmean(kept) if kept else None,
            "p25_s": _q(kept, 0.25), "p95_s": _q(kept, 0.95),
            "offload_share": tiers.count("cloud") / len(tiers) if tiers else 0.0,
            "round_ms_mean": statistics.fmean(rounds_ms) if rounds_ms else None,
            "resends": sum(r["resends"] for r in results), "engines": dict(engine_figures)}


def arrival_times(rate: float, seed: int, until_s: float) -> list[float]:
    """Poisson task arrivals (s from the start) before `until_s`: the draws of the fleet model's online
    arrivals (`benchmarks/studies/fleet.py`, `FleetSim`: its generator, seeded with the run's seed, picks the
    first trace, then draws each gap), so seed k means the same arrival times here and in the model."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rng.integers(1)  # the model's first-trace pick (one trace: the uniform tasks)
    out, at = [], rng.exponential(1 / rate)
    while at < until_s:
        out.append(at)
        at += rng.exponential(1 / rate)
    return out


def _q(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# -- the study ----------------------------------------------------------------------------------------


def _real(args) -> dict | None:
    return None if not args.checkpoint else {"checkpoint": args.checkpoint, "device": args.device, "dtype": args.dtype}


def _seed_rows(net, hosts, mode: str, rate: float, args, tag: str, extra: dict | None = None,
               endpoints: str | None = None) -> list[dict]:
    """One run per seed of `args` (``--first-seed`` on), each row printed as it comes, `extra` added to it."""
    rows = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        row = _drive_cmd(net, hosts, mode, rate, seed, args, f"{tag}s{seed}", endpoints) | (extra or {})
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _drive_cmd(net, hosts, mode: str, rate: float, seed: int, args, tag: str, endpoints: str | None = None) -> dict:
    cmd = [*net.prefix("robots"), sys.executable, "-m", "benchmarks.studies.hybrid", "drive",
           "--endpoint", endpoints or f"tcp/{hosts[0]}:{EDGE_PORT}", "--rate", str(rate), "--seed", str(seed),
           "--duration-s", str(args.duration_s), "--warmup-s", str(args.warmup_s),
           "--rounds", str(args.rounds), "--steps", str(args.steps), "--tag", tag, "--resend-s", str(args.resend_s)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT)
    line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode != 0 or not line.startswith("{"):
        raise RuntimeError(f"driver failed ({mode}, {rate}, {seed}): {out.stderr[-2000:]}")
    return {"mode": mode, **json.loads(line)}


def wan_sweep(args) -> dict:
    """The hybrid mode under each edge-cloud link of `args.wan` (Kairos Fig. 17)."""
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    shapes = [tuple(float(x) for x in item.split(":")) for item in args.wan.split(",")]
    net = Topology(work, wan=shapes[0])
    hosts = (ROBOT_EDGE[1], EDGE_CLOUD[1])
    rows = []
    net.start()
    try:
        procs = start_servers(net, "hybrid", work, hosts, _real(args), args.profile, args.cloud_in_flight,
                              args.edge_cpus)
        try:
            for one_way_ms, mbit in shapes:
                net.reshape_wan(one_way_ms, mbit)
                time.sleep(5.0)  # the scheduler's round-trip window (8 probes) sees the new link
                rows += _seed_rows(net, hosts, "hybrid", args.rate, args, f"w{int(one_way_ms)}m{int(mbit)}",
                                   {"wan_one_way_ms": one_way_ms, "wan_mbit": mbit})
        finally:
            stop_processes(procs, sig=signal.SIGTERM)
    finally:
        net.close()
    result = {"method": net.method, "args": vars(args), "rows": rows}
    (work / "hybrid_wan.json").write_text(json.dumps(result, indent=1))
    return result


def _points(rows: list[dict], *fields: str) -> dict[tuple, list[dict]]:
    """The rows with a result, grouped by the values of `fields`, in the order they were run."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["mean_s"]:
            groups.setdefault(tuple(r[f] for f in fields), []).append(r)
    return groups


def _mean(pts: list[dict], field: str) -> float:
    return statistics.fmean(p[field] for p in pts)


def wan_table(result: dict) -> str:
    out = ["| WAN one way (ms) | WAN Mbit/s | offloaded | mean (s) | P95 (s) | seeds |", "|---|---|---|---|---|---|"]
    for (one_way_ms, mbit), pts in _points(result["rows"], "wan_one_way_ms", "wan_mbit").items():
        out.append(f"| {one_way_ms:g} | {mbit:g} | {100 * _mean(pts, 'offload_share'):.0f} % | "
                   f"{_mean(pts, 'mean_s'):.2f} | {_mean(pts, 'p95_s'):.2f} | {len(pts)} |")
    return "\n".join(out)


def scaleout(args) -> dict:
    """One site: n edge engine processes behind one scheduler (pooled) against n independent servers
    with a static assignment of tasks, at the same load per GPU."""
    import yaml

    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    net = Topology(work)
    edge_host = ROBOT_EDGE[1]
    cluster, experiment, *_ = APP
    common = {"cluster_uuid": cluster, "experiment_tag": experiment, "telemetry_period_s": 0,
              "sessions": {"idle_timeout_s": 5, "liveliness_grace_s": 1}, "same_host": False}
    rows = []
    net.start()
    try:
        for n in [int(x) for x in args.engines.split(",")]:
            for layout in ("pooled", "static"):
                procs, files = [], []
                if layout == "pooled":
                    for i in range(n):
                        files.append((f"gpu{i}", {**common, "role": "engine", "engine_id": f"gpu{i}",
                                                  "zenoh": {"listen": [f"tcp/127.0.0.1:{8060 + i}"], "multicast_scouting": False},
                                                  "server": [_entry(EDGE_PROFILE_MS, EDGE_CAPACITY)]}))
                    engines = [{"engine_id": f"gpu{i}", "tier": "edge", "capacity": EDGE_CAPACITY,
                                "endpoint": f"tcp/127.0.0.1:{8060 + i}", "profile": EDGE_PROFILE_MS} for i in range(n)]
                    files.append(("scheduler", {**common, "server_id": "edge0",
                                                "zenoh": {"listen": [f"tcp/{edge_host}:{EDGE_PORT}"], "multicast_scouting": False},
                                                "server": [{**_entry(EDGE_PROFILE_MS, EDGE_CAPACITY), "engines": engines,
                                                            "dispatch": {"start_timeout_s": 60}}]}))
                    endpoints = [f"tcp/{edge_host}:{EDGE_PORT}"]
                else:
                    for i in range(n):
                        files.append((f"server{i}", {**common, "server_id": f"server{i}",
                                                     "zenoh": {"listen": [f"tcp/{edge_host}:{8070 + i}"], "multicast_scouting": False},
                                                     "server": [_entry(EDGE_PROFILE_MS, EDGE_CAPACITY)]}))
                    endpoints = [f"tcp/{edge_host}:{8070 + i}" for i in range(n)]
                for name, data in files:
                    path = work / f"scale{n}-{layout}-{name}.yaml"
                    path.write_text(yaml.safe_dump(data))
                    log = open(work / f"scale{n}-{layout}-{name}.log", "w")
                    procs.append(subprocess.Popen([*net.prefix("edge"), sys.executable, "-m", "lerobot_zenoh.cli.server",
                                                   f"--manifest={path}", "--log_level=WARNING"],
                                                  stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT))
                    if name.startswith("gpu") and name == f"gpu{n - 1}":
                        time.sleep(3.0)  # the engines' start-up profiles, before the scheduler checks them
                try:
                    rows += _seed_rows(net, (edge_host,), layout, args.rate_per_engine * n, args, f"n{n}{layout}",
                                       {"engines": n, "layout": layout}, endpoints=",".join(endpoints))
                finally:
                    stop_processes(procs, sig=signal.SIGTERM)
    finally:
        net.close()
    result = {"method": net.method, "args": vars(args), "rows": rows}
    (work / "hybrid_scaleout.json").write_text(json.dumps(result, indent=1))
    return result


def scaleout_table(result: dict) -> str:
    out = ["| GPUs | tasks/s | layout | mean (s) | P25 (s) | P95 (s) | tasks | seeds |", "|---|---|---|---|---|---|---|---|"]
    for (n, layout), pts in _points(result["rows"], "engines", "layout").items():
        out.append(f"| {n} | {pts[0]['rate']:g} | {layout} | {_mean(pts, 'mean_s'):.2f} | {_mean(pts, 'p25_s'):.2f} | "
                   f"{_mean(pts, 'p95_s'):.2f} | {sum(p['tasks'] for p in pts)} | {len(pts)} |")
    return "\n".join(out)


def study(args) -> dict:
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    net = Loopback() if args.no_netns else Topology(work, wan=(args.wan_ms, args.wan_mbit))
    hosts = ("127.0.0.1", "127.0.0.1") if args.no_netns else (ROBOT_EDGE[1], EDGE_CLOUD[1])
    rows = []
    net.start()
    try:
        for mode in args.modes.split(","):
            procs = start_servers(net, mode, work, hosts, _real(args), args.profile, args.cloud_in_flight,
                                  args.edge_cpus)
            try:
                for rate in [float(r) for r in args.rates.split(",")]:
                    rows += _seed_rows(net, hosts, mode, rate, args, f"{mode}{int(rate * 10)}")
            finally:
                stop_processes(procs, sig=signal.SIGTERM)
    finally:
        net.close()
    result = {"method": net.method, "args": vars(args), "rows": rows}
    (work / "hybrid.json").write_text(json.dumps(result, indent=1))
    return result


def table(result: dict) -> str:
    rows = result["rows"]
    rates = sorted({r["rate"] for r in rows})
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    out = ["| tasks/s | mode | mean (s) | P25 (s) | P95 (s) | offloaded | tasks | seeds |",
           "|---|---|---|---|---|---|---|---|"]
    summary = {}
    for rate in rates:
        for mode in modes:
            pts = [r for r in rows if r["rate"] == rate and r["mode"] == mode and r["mean_s"] is not None]
            if not pts:
                continue
            mean = [p["mean_s"] for p in pts]
            summary[(rate, mode)] = statistics.fmean(mean)
            sd = f" ± {statistics.stdev(mean):.2f}" if len(mean) > 1 else ""
            out.append(f"| {rate:g} | {mode} | {statistics.fmean(mean):.2f}{sd} | "
                       f"{statistics.fmean(p['p25_s'] for p in pts):.2f} | {statistics.fmean(p['p95_s'] for p in pts):.2f} | "
                       f"{100 * statistics.fmean(p['offload_share'] for p in pts):.0f} % | {sum(p['tasks'] for p in pts)} | {len(pts)} |")
    engines = [(r, m, e) for r in rates for m in modes for e in ("local", "cloud0")
               if any(f"engine.{e}.actual_ms_mean" in p.get("engines", {}) for p in rows
                      if p["rate"] == r and p["mode"] == m)]
    if engines:  # placement's estimate against what happened, per engine (the edge's telemetry)
        out += ["", "| tasks/s | mode | engine | estimate ms (mean) | actual ms (mean) | estimate / actual |",
                "|---|---|---|---|---|---|"]
        for rate, mode, engine in engines:
            pairs = [(p["engines"][f"engine.{engine}.estimate_ms_mean"], p["engines"][f"engine.{engine}.actual_ms_mean"])
                     for p in rows if p["rate"] == rate and p["mode"] == mode
                     and p.get("engines", {}).get(f"engine.{engine}.actual_ms_mean")]
            if pairs:
                est, act = statistics.fmean(e for e, _ in pairs), statistics.fmean(a for _, a in pairs)
                out.append(f"| {rate:g} | {mode} | {engine} | {est:.0f} | {act:.0f} | {est / act:.2f} |")
    top = rates[-1] if rates else None
    if top is not None and all((top, m) in summary for m in MODES):
        h, e, c = summary[(top, "hybrid")], summary[(top, "edge")], summary[(top, "cloud")]
        out.append("")
        out.append(f"At {top:g} tasks/s, hybrid mean task latency is {100 * (1 - h / e):.1f} % lower than edge-only "
                   f"and {100 * (1 - h / c):.1f} % lower than cloud-only (Kairos' target: >= 35 % and >= 50 %).")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("study", help="every mode at every rate and seed; prints a Markdown table")
    st.add_argument("--modes", default=",".join(MODES))
    st.add_argument("--rates", default="2,4,6,8", help="task arrival rates, tasks/s")
    st.add_argument("--seeds", type=int, default=3)
    st.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1 (fresh seeds)")
    st.add_argument("--duration-s", type=float, default=20.0, help="arrivals for this long per run")
    st.add_argument("--warmup-s", type=float, default=4.0, help="tasks arriving before this are not counted")
    st.add_argument("--rounds", type=int, default=6, help="rounds (requests) per task")
    st.add_argument("--steps", type=int, default=10, help="actions executed per round, at 30 Hz")
    st.add_argument("--resend-s", type=float, default=RESEND_S,
                    help="a robot sends its observation again after this long without a chunk (counted: resends)")
    st.add_argument("--wan-ms", type=float, default=EDGE_CLOUD[2],
                    help="edge <-> cloud ONE-WAY delay, ms (Kairos' 100 ms base latency; a round trip is twice it)")
    st.add_argument("--wan-mbit", type=float, default=EDGE_CLOUD[3], help="edge <-> cloud bandwidth, Mbit/s")
    st.add_argument("--no-netns", action="store_true", help="loopback, no shaped links (smoke run)")
    st.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "lz_hybrid"))
    wn = sub.add_parser("wan", help="the hybrid mode under several edge-cloud links (Kairos Fig. 17)")
    wn.add_argument("--wan", default="25:1000,100:1000,200:1000,100:100,100:300",
                    help="edge-cloud links, <ONE-WAY ms>:<Mbit/s>, comma-separated (Kairos Fig. 17: 25-200 ms at "
                         "1 Gbit/s, 100 Mbit/s-1 Gbit/s at 100 ms)")
    wn.add_argument("--rate", type=float, default=10.0, help="task arrival rate, tasks/s")
    for parser_ in (st, wn):
        parser_.add_argument("--profile", choices=sorted(PROFILES), default="gpu",
                             help="the synthetic GPUs' profiles: gpu (A6000/A100-like, the module docstring) or vla "
                                  "(the tiny SmolVLA's measured shape, scaled to the same batch-1 times)")
        parser_.add_argument("--cloud-in-flight", type=int, default=0,
                             help=f"the cloud engine's max_in_flight (0: its capacity, {CLOUD_CAPACITY}: one batch, "
                                  "Kairos' rule; more: the next batch waits in its inbox through the round trip)")
        parser_.add_argument("--checkpoint", default=None,
                             help="a LeRobot checkpoint both tiers load instead of the synthetic policies")
        parser_.add_argument("--device", default="cuda", help="with --checkpoint: the cloud engine's device")
        parser_.add_argument("--dtype", default="bfloat16", help="with --checkpoint: the cloud engine's dtype")
        parser_.add_argument("--edge-cpus", default=None,
                             help="pin the edge server to these CPUs (e.g. 0,1), as many torch threads: an edge-class "
                                  "box beside the cloud GPU")
    so = sub.add_parser("scaleout", help="n edge engines behind one scheduler against n independent servers")
    so.add_argument("--engines", default="1,2,4", help="GPUs (engine processes, or servers) per run")
    so.add_argument("--rate-per-engine", type=float, default=5.0, help="task arrivals per GPU, tasks/s")
    for parser_ in (wn, so):
        parser_.add_argument("--seeds", type=int, default=2)
        parser_.add_argument("--first-seed", type=int, default=0)
        parser_.add_argument("--duration-s", type=float, default=12.0)
        parser_.add_argument("--warmup-s", type=float, default=3.0)
        parser_.add_argument("--rounds", type=int, default=6)
        parser_.add_argument("--steps", type=int, default=10)
        parser_.add_argument("--resend-s", type=float, default=RESEND_S)
        parser_.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "lz_hybrid"))
    dr = sub.add_parser("drive", help="(internal) the robots of one run")
    dr.add_argument("--endpoint", required=True)
    dr.add_argument("--rate", type=float, required=True)
    dr.add_argument("--seed", type=int, required=True)
    dr.add_argument("--duration-s", type=float, required=True)
    dr.add_argument("--warmup-s", type=float, required=True)
    dr.add_argument("--rounds", type=int, required=True)
    dr.add_argument("--steps", type=int, required=True)
    dr.add_argument("--tag", required=True)
    dr.add_argument("--resend-s", type=float, default=RESEND_S)
    args = parser.parse_args(argv)
    if getattr(args, "edge_cpus", None):
        try:
            cpus, available = {int(c) for c in args.edge_cpus.split(",")}, os.sched_getaffinity(0)
        except ValueError:
            parser.error(f"--edge-cpus: a comma-separated list of CPU numbers, got {args.edge_cpus!r}")
        if not cpus <= available:
            parser.error(f"--edge-cpus: {sorted(cpus - available)} not among the CPUs this process may use "
                         f"{sorted(available)}")
    if args.cmd == "drive":
        print(json.dumps(drive(args.endpoint, args.rate, args.seed, args.duration_s, args.warmup_s, args.rounds,
                               args.steps, args.tag, args.resend_s)), flush=True)
        return 0
    if args.cmd == "scaleout":
        if os.geteuid() != 0:
            print("the scale-out run shapes the robots' link: it needs root (ip netns)", file=sys.stderr)
            return 2
        result = scaleout(args)
        print(f"\nlinks: {result['method']}\n")
        print(scaleout_table(result))
        return 0
    if args.cmd == "wan":
        if os.geteuid() != 0:
            print("the WAN sweep shapes links: it needs root (ip netns)", file=sys.stderr)
            return 2
        result = wan_sweep(args)
        print(f"\nlinks: {result['method']}, {args.rate:g} tasks/s\n")
        print(wan_table(result))
        return 0
    if not args.no_netns and os.geteuid() != 0:
        print("shaped links need root (ip netns); --no-netns runs on loopback without them", file=sys.stderr)
        return 2
    result = study(args)
    print(f"\nlinks: {result['method']}; edge <-> cloud {args.wan_ms:g} ms one way ({2 * args.wan_ms:g} ms round trip), "
          f"{args.wan_mbit:g} Mbit/s\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
