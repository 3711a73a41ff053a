"""Real-time chunking (RTC) against blending, on a SmolVLA trained here, over real Zenoh.

Two stages; `all` runs both (``make bench-rtc``).

``prepare`` (the benchmark input, cached under ``outputs/rtc/<key>/``, keyed by `PrepareSettings`):
the pipeline a user runs, record -> ``lerobot-train`` -> serve.

1. ``lerobot-zenoh-build-checkpoint --policy_type=smolvla``: a tiny random-weight SmolVLA (0.4 M
   parameters, a local VLM config and tokenizer) shaped for the simulated robot.
2. ``lerobot-policy-server`` serves the synthetic policy in its scripted ``circle`` mode
   (`lerobot_zenoh.server.runners.synthetic.circle_actions`: every joint follows a sinusoid whose phase
   is read from the state, one turn every 4 s) and ``lerobot-robot-client --robot.type=zenoh_sim
   --dataset.*`` records episodes of the simulated robot following it.
3. ``lerobot-train --policy.path=<the tiny SmolVLA>`` on that dataset, on this CPU, for a few minutes.

``measure``: virtual robots in one driver process, each a real `SimRobot` (first-order joints,
rendered camera, JPEG) around the reference client's own `ActionBuffer`, `SendTrigger` and
`ChunkIntake` (the code `client/client.py` runs), talking to ``lerobot-policy-server`` serving the
trained checkpoint. Four ways to take chunks in, side by side in one run (one robot each, same
server, same moment):

- ``rtc``: observations carry the leftover and the predicted delay (docs/protocol.md §10.6); a chunk that
  echoes ``rtc_delay_steps`` replaces the buffer from the step it actually starts at. A server that
  does not apply RTC answers without the echo and the chunk is blended (counted: ``fallback``).
- ``weighted_average`` / ``latest_only``: the client's blending (``--aggregate.type``), with its
  RTT trim and stale-row drop (the default client without RTC).
- ``no_trim``: neither trim nor stale-row drop: row 0 of a chunk is executed at the step it arrives
  (weighted_average over the overlap), i.e. a client that ignores the inference delay. Not a client
  flag: built here from `ChunkIntake.plan` + `ActionBuffer.merge`.

The inference delay is raised by an extra latency (0, 100, 200, 300 ms) that the driver adds on the
return path (a chunk is handed to the intake that long after it arrived, so the measured RTT and the
predicted delay include it), on top of the real round trip (JPEG, Zenoh, queueing, SmolVLA on the CPU).

Measures per mode, over the measurement window (after a warm-up):

- boundary jump: after each chunk is merged, the steps whose action it changed (from the first step
  not yet executed to one past the previously buffered ones); per boundary the largest
  ``max_j |a[k, j] - a[k-1, j]|`` over them; reported as max and p95 over boundaries;
- in-chunk step: the same difference for consecutive executed actions outside every boundary window
  (median), and the model's own row-to-row step inside the chunks it sent (median, p95);
- mean jerk: mean of ``max_j |third difference of a|`` over executed steps (action units / step^3);
- tracking error: mean ``max_j |a[k] - r[k]|``, ``r[k]`` the scripted motion's command for the state
  the robot was in when it executed ``a[k]`` (row 0 of `circle_actions`);
- stalled: control steps with an empty buffer after the first action, %.

Then batched RTC against one robot per forward pass (``max_batch_size: 1``, what LeRobot's draft
server does): 4, 8, 16 robots, all in ``rtc`` mode; chunks/s, RTT p50/p99, stalled %, the server's
mean batch. Timing figures depend on the machine's load: each point runs ``--seeds`` times and the
spread is printed.

    python -m benchmarks.studies.rtc all --write-docs docs/studies/rtc.md
    python -m benchmarks.studies.rtc prepare                 # only the checkpoint (cached)
    python -m benchmarks.studies.rtc measure --delays-ms 0 300 --seeds 1 --measure-s 10
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import os
import queue
import secrets
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

from benchmarks.harness.processes import ServerProcess  # noqa: E402
from testbed.ports import free_port  # noqa: E402
from benchmarks.harness.driver import driver_ticks, telemetry_metrics  # noqa: E402
from benchmarks.harness.results import machine  # noqa: E402
from benchmarks.harness.docs_blocks import write_docs_block  # noqa: E402
from benchmarks.harness.robot import SimulatedRobot  # noqa: E402
from lerobot_zenoh.client.config_sim_robot import SO101_JOINTS, SimRobotConfig  # noqa: E402
from lerobot_zenoh.client.sim_robot import SimRobot  # noqa: E402
from lerobot_zenoh.errors import ProtocolError  # noqa: E402
from lerobot_zenoh.protocol import codec  # noqa: E402
from lerobot_zenoh.protocol.keys import AppKey  # noqa: E402
from lerobot_zenoh.scheduling.action_buffer import (  # noqa: E402
    LatestOnlyConfig,
    WeightedAverageConfig,
)
from lerobot_zenoh.scheduling.chunk_intake import MergeMode  # noqa: E402
from lerobot_zenoh.server.runners.synthetic import CircleMotion, circle_actions  # noqa: E402
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession  # noqa: E402
from lerobot_zenoh.transport.settings import loopback_settings  # noqa: E402

FPS = 30
DT_S = 1.0 / FPS
OUT = ROOT / "outputs" / "rtc"
BIN = Path(sys.executable).parent
TASK = "follow the circle"
MODES = ("rtc", "weighted_average", "latest_only", "no_trim")
CLUSTER, EXPERIMENT, SERVER_ID = "local", "rtcbench", "rtc-bench"


# ------------------------------------------------------------------------------------ prepare


@dataclass(frozen=True)
class PrepareSettings:
    """Everything the trained checkpoint depends on (its cache key)."""

    camera: tuple[int, int] = (48, 64)  # one camera, small: lerobot-train decodes it for every action row
    chunk_size: int = 50
    period_s: float = 4.0  # the scripted circle
    amplitude: float = 40.0
    lead_steps: float = 3.0
    episodes: int = 8
    episode_s: float = 12.0
    train_steps: int = 1200
    batch_size: int = 16
    lr: float = 1e-3
    seed: int = 0

    @property
    def motion(self) -> CircleMotion:
        return CircleMotion(period_s=self.period_s, amplitude=self.amplitude, lead_steps=self.lead_steps)

    def key(self) -> str:
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]

    def data_key(self) -> str:
        """What the base checkpoint and the dataset depend on (not the training settings)."""
        data = {k: v for k, v in asdict(self).items() if k not in ("train_steps", "batch_size", "lr")}
        return hashlib.sha1(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def start_position(motion: CircleMotion, phase: float) -> dict[str, float]:
    """Joint positions on the scripted circle at `phase` (so a robot starts on its path)."""
    return {j: float(motion.amplitude * math.cos(phase - i * math.pi / 2)) for i, j in enumerate(SO101_JOINTS)}


def _run(cmd: list[str], log: Path, what: str) -> None:
    print(f"rtc: {what} (log: {log})", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if rc != 0:
        raise RuntimeError(f"{what} failed (exit {rc}); see {log}")
    print(f"rtc: {what}: {time.perf_counter() - t0:.0f} s", flush=True)


def rtc_server(manifest: dict, port: int, log_path: Path, app: AppKey) -> ServerProcess:
    """The policy server on `manifest` in its own process, ready once its status answers."""
    def ready() -> bool:
        with ZenohSession(loopback_settings(connect_ports=(port,))).open() as probe:
            return bool(probe.query(app.status, 0.5))

    return ServerProcess(manifest, log_path, ready=ready, stop_timeout_s=15)


def prepare(s: PrepareSettings, out: Path = OUT) -> Path:
    """The trained checkpoint for `s`, built, recorded and trained unless cached. Returns its folder."""
    folder, data = out / f"train-{s.key()}", out / f"data-{s.data_key()}"
    for f in (folder, data):
        f.mkdir(parents=True, exist_ok=True)
    (folder / "settings.json").write_text(json.dumps(asdict(s), indent=1))
    base, dataset, train = data / "base_smolvla", data / "dataset", folder / "train"
    trained = train / "checkpoints" / "last" / "pretrained_model"
    if trained.exists():
        print(f"rtc: cached checkpoint {trained}", flush=True)
        return trained
    h, w = s.camera
    if not (base / "model.safetensors").exists():
        shutil.rmtree(base, ignore_errors=True)
        _run([str(BIN / "lerobot-zenoh-build-checkpoint"), "--policy_type=smolvla", f"--output={base}",
              f"--state_names={','.join(j + '.pos' for j in SO101_JOINTS)}",
              f"--action_names={','.join(j + '.pos' for j in SO101_JOINTS)}",
              f"--cameras=front:{h}x{w}", f"--chunk_size={s.chunk_size}", f"--fps={FPS}", f"--seed={s.seed}"],
             data / "build.log", "building the tiny SmolVLA")
    if not (dataset / "meta" / "info.json").exists() or not (data / "recorded").exists():
        shutil.rmtree(dataset, ignore_errors=True)
        port = free_port()
        app = AppKey(CLUSTER, EXPERIMENT, "circle", "v1", "record")
        manifest = {"cluster_uuid": CLUSTER, "experiment_tag": EXPERIMENT, "server_id": "scripted",
                    "zenoh": {"mode": "peer", "multicast_scouting": False},
                    "server": [{"model_id": app.model, "model_version": app.version, "application_tag": app.app,
                                "fps": FPS, "endpoint": f"tcp/127.0.0.1:{port}", "accept_unknown_clients": True,
                                "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": s.chunk_size,
                                              "cameras": {"front": [h, w]},
                                              "circle": {"period_s": s.period_s, "amplitude": s.amplitude,
                                                         "lead_steps": s.lead_steps}}}]}
        start = start_position(s.motion, 0.0)
        with rtc_server(manifest, port, data / "record_server.log", app):
            _run([str(BIN / "lerobot-robot-client"), "--robot.type=zenoh_sim", f"--robot.cameras={{front: [{h}, {w}]}}",
                  "--robot.initial_positions={" + ", ".join(f"{k}: {v:.4f}" for k, v in start.items()) + "}",
                  "--client_uuid=recorder", f"--cluster_uuid={CLUSTER}", f"--experiment_tag={EXPERIMENT}",
                  f"--model_id={app.model}", f"--model_version={app.version}", f"--application_tag={app.app}",
                  f"--endpoint=tcp/127.0.0.1:{port}", "--zenoh.multicast_scouting=false",
                  f"--dataset.repo_id=local/rtc_circle_{s.data_key()}", f"--dataset.root={dataset}",
                  f"--dataset.single_task={TASK}", f"--dataset.num_episodes={s.episodes}",
                  f"--dataset.episode_time_s={s.episode_s}", "--dataset.reset_time_s=0.5", "--dataset.video=false"],
                 data / "record.log", f"recording {s.episodes} episodes of {s.episode_s:g} s")
        (data / "recorded").write_text("ok\n")
    shutil.rmtree(train, ignore_errors=True)
    _run([str(BIN / "lerobot-train"), f"--dataset.repo_id=local/rtc_circle_{s.data_key()}", f"--dataset.root={dataset}",
          f"--policy.path={base}", "--policy.device=cpu", "--policy.push_to_hub=false",
          f"--policy.optimizer_lr={s.lr}", "--policy.scheduler_warmup_steps=30",
          f"--policy.scheduler_decay_steps={s.train_steps}", f"--output_dir={train}", f"--steps={s.train_steps}",
          f"--batch_size={s.batch_size}", f"--save_freq={s.train_steps}", "--num_workers=0", "--log_freq=50",
          "--wandb.enable=false", f"--seed={s.seed}"],
         folder / "train.log", f"lerobot-train, {s.train_steps} steps of {s.batch_size}")
    return trained


# ------------------------------------------------------------------------------------ measure


def rtc_manifest_supported() -> bool:
    """Whether this tree's manifest has per-model `rtc:` settings (server-side RTC for VLAs)."""
    from lerobot_zenoh.server.config.manifest import ModelEntry

    return "rtc" in ModelEntry.model_fields


@dataclass(frozen=True)
class ServeConfig:
    max_batch: int = 16
    rtc: bool = True  # server-side RTC settings in the manifest (when the manifest has them)
    execution_horizon: int = 20
    max_guidance_weight: float = 10.0
    schedule: str = "linear"


def serve_manifest(checkpoint: Path, prep: PrepareSettings, cfg: ServeConfig, port: int, app: AppKey,
                   policy: str) -> dict:
    if policy == "scripted":  # the scripted motion itself, with the synthetic stand-in for RTC guidance
        h, w = prep.camera
        source = {"synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": prep.chunk_size,
                                "cameras": {"front": [h, w]}, "rtc": cfg.rtc,
                                "circle": {"period_s": prep.period_s, "amplitude": prep.amplitude,
                                           "lead_steps": prep.lead_steps}}}
    else:
        base = OUT / f"data-{prep.data_key()}" / "base_smolvla"
        source = {"pretrained_path": str(checkpoint), "vlm_path": str(base / "vlm"),
                  "tokenizer_path": str(base / "tokenizer"), "device": "cpu"}
        if rtc_manifest_supported():
            source["rtc"] = {"enabled": cfg.rtc, "execution_horizon": cfg.execution_horizon,
                             "max_guidance_weight": cfg.max_guidance_weight,
                             "prefix_attention_schedule": cfg.schedule}
    entry = {"model_id": app.model, "model_version": app.version, "application_tag": app.app, "fps": FPS,
             "endpoint": f"tcp/127.0.0.1:{port}", "max_batch_size": cfg.max_batch, "scheduler": "round_robin",
             "accept_unknown_clients": True, "max_unknown_clients": 256, **source}
    return {"cluster_uuid": CLUSTER, "experiment_tag": EXPERIMENT, "server_id": SERVER_ID, "telemetry_period_s": 1.0,
            "zenoh": {"mode": "peer", "multicast_scouting": False}, "server": [entry]}


@dataclass
class Trace:
    """What one robot did in the measurement window."""

    steps: list = field(default_factory=list)  # executed step labels
    actions: list = field(default_factory=list)  # executed actions
    refs: list = field(default_factory=list)  # the scripted command for the state at that step
    windows: list = field(default_factory=list)  # (first, last) steps a merged chunk changed
    stalled: int = 0
    ticks: int = 0
    rtts_s: list = field(default_factory=list)
    chunk_steps: list = field(default_factory=list)  # row-to-row max-abs steps inside received chunks
    chunks: int = 0
    fallback: int = 0  # rtc observations answered without rtc_delay_steps (blended)
    rejected: int = 0
    reasons: dict = field(default_factory=dict)  # rejected chunks by reason
    presumed_lost: int = 0  # requests the send trigger gave up on (timed out), whole run
    delays: list = field(default_factory=list)  # (predicted, actual) steps per RTC chunk


class VirtualRobot:
    """A simulated robot (the harness's, the reference client's buffer, trigger and intake) on the
    project's simulated arm, sending its camera and joints (see the module docstring)."""

    def __init__(self, client_id: str, mode: str, publisher, motion: CircleMotion, camera: tuple[int, int],
                 phase: float, chunk_size: int):
        self.client_id, self.mode, self.publisher, self.motion = client_id, mode, publisher, motion
        self.names = [f"{j}.pos" for j in SO101_JOINTS]
        self.arm = SimRobot(SimRobotConfig(id=client_id, cameras={"front": camera},
                                           initial_positions=start_position(motion, phase)))
        self.arm.connect()
        aggregate = LatestOnlyConfig() if mode == "latest_only" else WeightedAverageConfig()
        self.robot = SimulatedRobot(client_id, dt_s=DT_S, aggregate=aggregate, action_dim=len(self.names),
                                    merge=mode if mode in ("rtc", "no_trim") else "blend", rtc_rows=chunk_size)
        self.robot.episode = 1
        self.t = Trace()

    def tick(self, now: float, counting: bool) -> None:
        obs = self.arm.get_observation()
        state = np.array([obs[n] for n in self.names], dtype=np.float32)
        capture = self.robot.capture(now)
        if capture is not None:
            self.publisher.put(codec.encode(self.robot.observation(
                capture, state, {"front": codec.encode_jpeg(obs["front"], 90)}, TASK)))
        moving = self.robot.moving
        popped = self.robot.act()
        t = self.t
        if popped is None:
            self.arm.send_action(self.arm.fail_safe_action())
            if moving and counting:
                t.stalled += 1
                t.ticks += 1
            return
        step, action = popped
        self.arm.send_action(dict(zip(self.names, (float(x) for x in action))))
        if counting:
            t.ticks += 1
            t.steps.append(step)
            t.actions.append(np.asarray(action, dtype=np.float64))
            t.refs.append(circle_actions(state, 1, len(self.names), self.motion, DT_S)[0].astype(np.float64))

    def on_chunk(self, payload: bytes, now: float, counting: bool) -> None:
        t = self.t
        try:
            chunk = codec.decode_action_chunk(payload)
        except ProtocolError:
            t.rejected += 1
            return
        actions = chunk.actions
        buffer = self.robot.buffer
        before = buffer.next_step, buffer.depth
        result = self.robot.take(chunk, now)
        if not result.accepted:
            t.rejected += 1
            t.reasons[result.reason] = t.reasons.get(result.reason, 0) + 1
            return
        first, depth = before
        if self.mode == "rtc" and result.merge is not None and result.merge.next_step is not None:
            first = result.merge.next_step
        t.windows.append((first, first + depth))
        if counting:
            t.chunks += 1
            t.fallback += self.mode == "rtc" and result.mode is not MergeMode.RTC
            if result.rtt_s is not None:
                t.rtts_s.append(result.rtt_s)
            if result.mode is MergeMode.RTC:
                t.delays.append((result.predicted_delay_steps, result.actual_delay_steps))
            if len(actions) > 1:
                t.chunk_steps.extend(np.abs(np.diff(actions.astype(np.float64), axis=0)).max(axis=1).tolist())


def smoothness(t: Trace) -> dict:
    """The figures of one robot's trace (see the module docstring)."""
    steps = np.asarray(t.steps)
    a = np.asarray(t.actions)
    nan = math.nan
    if len(a) < 4:
        return {"executed": len(a)}
    consecutive = np.diff(steps) == 1
    jump = np.abs(np.diff(a, axis=0)).max(axis=1)  # transition into steps[1:]
    into = steps[1:]
    in_window = np.zeros(len(into), dtype=bool)
    boundary_max = []
    for first, last in t.windows:
        sel = (into >= first) & (into <= last) & consecutive
        if sel.any():
            in_window |= sel
            boundary_max.append(float(jump[sel].max()))
    inner = jump[consecutive & ~in_window]
    jerk = []
    for k in range(3, len(a)):
        if steps[k] - steps[k - 3] == 3:
            jerk.append(float(np.abs(a[k] - 3 * a[k - 1] + 3 * a[k - 2] - a[k - 3]).max()))
    track = np.abs(a - np.asarray(t.refs)).max(axis=1)
    rtt = np.asarray(t.rtts_s) * 1000
    bm = np.asarray(boundary_max)
    errors = [actual - pred for pred, actual in t.delays if pred is not None and actual is not None]
    return {
        "executed": len(a),
        "boundaries": len(bm),
        "boundary_jump_max": float(bm.max()) if len(bm) else nan,
        "boundary_jump_p95": float(np.percentile(bm, 95)) if len(bm) else nan,
        "boundary_jump_p50": float(np.percentile(bm, 50)) if len(bm) else nan,
        "inner_step_p50": float(np.median(inner)) if len(inner) else nan,
        "chunk_step_p50": float(np.median(t.chunk_steps)) if t.chunk_steps else nan,
        "chunk_step_p95": float(np.percentile(t.chunk_steps, 95)) if t.chunk_steps else nan,
        "jerk_mean": float(np.mean(jerk)) if jerk else nan,
        "track_mean": float(track.mean()),
        "stalled_pct": 100.0 * t.stalled / t.ticks if t.ticks else nan,
        "rtt_p50_ms": float(np.percentile(rtt, 50)) if len(rtt) else nan,
        "rtt_p99_ms": float(np.percentile(rtt, 99)) if len(rtt) else nan,
        "chunks": t.chunks,
        "fallback": t.fallback,
        "rejected": t.rejected,
        "rejected_reasons": t.reasons,
        "presumed_lost": t.presumed_lost,
        "delay_error_p50": float(np.median(errors)) if errors else nan,
        "delay_actual_p50": float(np.median([x for _, x in t.delays])) if t.delays else nan,
    }


def drive(port: int, app: AppKey, robots_modes: list[str], prep: PrepareSettings, extra_ms: float, seed: int,
          warmup_s: float, measure_s: float) -> dict:
    """One run: robots with the given modes against the server at `port`. Returns per-robot figures,
    the server's telemetry over the window, and the driver's lateness."""
    rng = np.random.default_rng(seed)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    telemetry: list[tuple[float, bytes]] = []
    tag = secrets.token_hex(3)
    with ZenohSession(loopback_settings(connect_ports=(port,))).open() as session:
        session.subscribe(f"{app.prefix}/*/action", lambda key, payload: inbox.put((key, payload, time.perf_counter())))
        session.subscribe(app.server_metrics(SERVER_ID), lambda key, payload: telemetry.append((time.perf_counter(), payload)))
        phases = rng.uniform(0, 2 * math.pi, size=len(robots_modes))
        robots = [VirtualRobot(f"s{seed}{tag}r{i:02d}", mode, session.publisher(app.client(f"s{seed}{tag}r{i:02d}").obs,
                                                                          OBSERVATION_QOS),
                               prep.motion, prep.camera, float(phases[i]), prep.chunk_size)
                  for i, mode in enumerate(robots_modes)]
        by_id = {r.client_id: r for r in robots}
        offsets = rng.permutation(len(robots)) % 10  # control loops spread over 10 phases of the period
        time.sleep(0.5)  # subscriptions reach the server before the first observation
        held: list[tuple[float, int, str, bytes]] = []  # the extra-latency delay line (release time first)
        lateness = []
        t0 = time.perf_counter()
        w0, w1 = t0 + warmup_s, t0 + warmup_s + measure_s
        n = 0
        for i, now, counting in driver_ticks(t0, DT_S / 10, w0, w1, lateness):
            while True:
                try:
                    key, payload, arrived = inbox.get_nowait()
                except queue.Empty:
                    break
                n += 1
                heapq.heappush(held, (arrived + extra_ms / 1000.0, n, key, payload))
            while held and held[0][0] <= now:
                _, _, key, payload = heapq.heappop(held)
                robot = by_id.get(key.rsplit("/", 2)[-2])
                if robot is not None:
                    robot.on_chunk(payload, now, counting)
            for k, robot in enumerate(robots):
                if offsets[k] == i % 10:
                    robot.tick(now, counting)
        time.sleep(1.2)
        for robot in robots:
            robot.t.presumed_lost = robot.robot.trigger.stats().presumed_lost
    figures = telemetry_metrics(telemetry)
    inside = [m for t, m in figures if w0 <= t <= w1 + 1.5]
    first = next((m for t, m in figures if t >= w0), {})
    last = inside[-1] if inside else {}
    served = (last.get("inferences", 0) - first.get("inferences", 0)) if first and last else math.nan
    return {"robots": [{"mode": r.mode, **smoothness(r.t)} for r in robots],
            "server_batch_mean": float(last.get("batch_size_mean", math.nan) or math.nan),
            "server_inferences_per_s": served / measure_s if served == served else math.nan,
            "driver_late_p99_ms": float(np.percentile(lateness, 99) * 1000) if lateness else math.nan}


def pooled(runs: list[dict], mode: str | None = None) -> dict:
    """Per-run figures of the robots in `mode` (all robots when None), combined per run: max for
    maxima, mean for the rest."""
    out = []
    for run in runs:
        rows = [r for r in run["robots"] if mode is None or r["mode"] == mode]
        if not rows:
            continue
        keys = [k for k in rows[0] if k not in ("mode", "rejected_reasons")]
        combined = {}
        for k in keys:
            vals = [r.get(k, math.nan) for r in rows]
            combined[k] = float(np.nanmax(vals)) if k.endswith("_max") else float(np.nanmean(vals))
        combined["chunks_total"] = sum(r.get("chunks", 0) for r in rows)
        combined.update({k: run[k] for k in ("server_batch_mean", "server_inferences_per_s", "driver_late_p99_ms")})
        out.append(combined)
    return out


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """``mean (min-max)`` over seeds, or the value alone for one seed."""
    v = [x for x in values if x == x]
    if not v:
        return "-"
    if len(v) == 1:
        return fmt.format(v[0])
    return f"{fmt.format(np.mean(v))} ({fmt.format(min(v))}-{fmt.format(max(v))})"


def measure(args, checkpoint: Path, prep: PrepareSettings) -> tuple[str, dict]:
    app = AppKey(CLUSTER, EXPERIMENT, "smolvla_circle" if args.policy == "trained" else "circle", "v1", "rtc")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data: dict = {"machine": machine(), "prepare": asdict(prep), "policy": args.policy,
                  "server_rtc_settings": args.policy == "scripted" or rtc_manifest_supported(),
                  "smoothness": {}, "batching": {}}
    serve = ServeConfig(max_batch=16, execution_horizon=args.execution_horizon,
                        max_guidance_weight=args.guidance_weight, schedule=args.schedule)
    if "smoothness" in args.parts:
        port = free_port()
        with rtc_server(serve_manifest(checkpoint, prep, serve, port, app, args.policy), port,
                        out / "server_smoothness.log", app):
            for extra in args.delays_ms:
                runs = []
                for seed in range(args.seeds):
                    run = drive(port, app, list(MODES) * args.robots_per_mode, prep, extra, seed,
                                args.warmup_s, args.measure_s)
                    runs.append(run)
                    for mode in MODES:
                        p = pooled([run], mode)[0]
                        print(f"extra {extra:>3.0f} ms seed {seed} {mode:16s} boundary max {p['boundary_jump_max']:6.2f} "
                              f"p95 {p['boundary_jump_p95']:6.2f} inner {p['inner_step_p50']:.2f} chunk-step "
                              f"{p['chunk_step_p50']:.2f} jerk {p['jerk_mean']:.3f} track {p['track_mean']:.2f} "
                              f"stalled {p['stalled_pct']:.1f} % rtt {p['rtt_p50_ms']:.0f} ms "
                              f"fallback {p['fallback']:.0f} d-err {p['delay_error_p50']} rejected "
                              f"{[r['rejected_reasons'] for r in run['robots'] if r['mode'] == mode]} lost {p['presumed_lost']:.0f}",
                              flush=True)
                data["smoothness"][str(extra)] = runs
                (out / "rtc.json").write_text(json.dumps(data, indent=1, default=float))
    if "batching" in args.parts:
        for batch in (16, 1):
            port = free_port()
            with rtc_server(serve_manifest(checkpoint, prep, ServeConfig(max_batch=batch, execution_horizon=serve.execution_horizon,
                                                                            max_guidance_weight=serve.max_guidance_weight,
                                                                            schedule=serve.schedule), port, app, args.policy),
                               port, out / f"server_batch{batch}.log", app):
                for n in args.fleets:
                    runs = []
                    for seed in range(args.seeds):
                        run = drive(port, app, ["rtc"] * n, prep, 0.0, 100 + seed, args.warmup_s, args.batch_measure_s)
                        runs.append(run)
                        p = pooled([run])[0]
                        print(f"max_batch {batch:2d} robots {n:2d} seed {seed}: {p['chunks_total'] / args.batch_measure_s:.1f} "
                              f"chunks/s, rtt p50 {p['rtt_p50_ms']:.0f} p99 {p['rtt_p99_ms']:.0f} ms, stalled "
                              f"{p['stalled_pct']:.1f} %, boundary p95 {p['boundary_jump_p95']:.2f}, server batch "
                              f"{p['server_batch_mean']:.1f}, driver late p99 {p['driver_late_p99_ms']:.1f} ms", flush=True)
                    data["batching"][f"{batch}/{n}"] = runs
                    (out / "rtc.json").write_text(json.dumps(data, indent=1, default=float))
    return report(data, args), data


def report(data: dict, args) -> str:
    lines: list[str] = []
    say = lines.append
    if data["smoothness"]:
        say("Smoothness against the scripted motion (action units: joint targets in LeRobot's +-100 range; the "
            "circle has amplitude 40, so the motion's own step is 40 x 2 pi / 120 = 2.09 per control step). "
            "Each cell: mean over seeds (min-max).\n")
        say("| extra latency | RTT p50 ms | mode | boundary jump max | boundary jump p95 | max jump / in-chunk step | "
            "executed in-chunk step p50 | mean jerk | tracking error | stalled % | RTC fallbacks |")
        say("|---|---|---|---|---|---|---|---|---|---|---|")
        for extra, runs in data["smoothness"].items():
            for mode in MODES:
                ps = pooled(runs, mode)
                ratio = [p["boundary_jump_max"] / p["chunk_step_p50"] for p in ps]
                say(f"| {float(extra):.0f} ms | {spread([p['rtt_p50_ms'] for p in ps], '{:.0f}')} | {mode} | "
                    f"{spread([p['boundary_jump_max'] for p in ps])} | {spread([p['boundary_jump_p95'] for p in ps])} | "
                    f"{spread(ratio, '{:.1f}')} | {spread([p['inner_step_p50'] for p in ps])} | "
                    f"{spread([p['jerk_mean'] for p in ps], '{:.3f}')} | {spread([p['track_mean'] for p in ps])} | "
                    f"{spread([p['stalled_pct'] for p in ps], '{:.1f}')} | "
                    f"{'-' if mode != 'rtc' else spread([p['fallback'] for p in ps], '{:.0f}')} |")
        allruns = [r for runs in data["smoothness"].values() for r in runs]
        steps = pooled(allruns)
        say("")
        say(f"The policy's own chunks: row-to-row step (max over joints) median "
            f"{spread([p['chunk_step_p50'] for p in steps])}, p95 {spread([p['chunk_step_p95'] for p in steps])} "
            "(all runs; the ratio column divides by this run's median).\n")
    if data["batching"]:
        say("Batched RTC against one robot per forward pass (all robots in `rtc` mode, no extra latency). "
            "Each cell: mean over seeds (min-max).\n")
        say("| robots | max_batch_size | chunks/s | RTT p50 ms | RTT p99 ms | stalled % | server batch (mean) | "
            "boundary jump p95 | driver late p99 ms |")
        say("|---|---|---|---|---|---|---|---|---|")
        for n in args.fleets:
            for batch in (16, 1):
                runs = data["batching"].get(f"{batch}/{n}")
                if not runs:
                    continue
                ps = pooled(runs)
                say(f"| {n} | {batch} | {spread([p['chunks_total'] / args.batch_measure_s for p in ps], '{:.1f}')} | "
                    f"{spread([p['rtt_p50_ms'] for p in ps], '{:.0f}')} | {spread([p['rtt_p99_ms'] for p in ps], '{:.0f}')} | "
                    f"{spread([p['stalled_pct'] for p in ps], '{:.1f}')} | {spread([p['server_batch_mean'] for p in ps], '{:.1f}')} | "
                    f"{spread([p['boundary_jump_p95'] for p in ps])} | {spread([p['driver_late_p99_ms'] for p in ps], '{:.1f}')} |")
        say("")
    return "\n".join(lines)


BEGIN, END = "<!-- rtc:begin (generated by benchmarks/studies/rtc.py) -->", "<!-- rtc:end -->"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("prepare", "measure", "all"))
    p.add_argument("--out", default=str(OUT / "results"))
    p.add_argument("--train-steps", type=int, default=PrepareSettings.train_steps)
    p.add_argument("--episodes", type=int, default=PrepareSettings.episodes)
    p.add_argument("--policy", choices=("trained", "scripted"), default="trained",
                   help="serve the trained SmolVLA, or the scripted motion itself (a control: consistent chunks)")
    p.add_argument("--parts", nargs="+", default=["smoothness", "batching"])
    p.add_argument("--delays-ms", type=float, nargs="+", default=[0, 100, 200, 300])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--robots-per-mode", type=int, default=1)
    p.add_argument("--fleets", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--measure-s", type=float, default=15.0)
    p.add_argument("--batch-measure-s", type=float, default=12.0)
    p.add_argument("--execution-horizon", type=int, default=20)
    p.add_argument("--guidance-weight", type=float, default=10.0)
    p.add_argument("--schedule", default="linear", choices=("zeros", "ones", "linear", "exp"))
    p.add_argument("--control-seeds", type=int, default=1,
                   help="`all`: also run the smoothness part with the scripted motion itself as the policy (a "
                        "control: consistent chunks, the synthetic stand-in for RTC) with this many seeds; 0: skip")
    p.add_argument("--write-docs", help="rewrite the generated block of this markdown file")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # nan statistics of empty selections
    prep = PrepareSettings(train_steps=args.train_steps, episodes=args.episodes)
    t0 = time.perf_counter()
    checkpoint = prepare(prep) if args.policy == "trained" or args.command == "prepare" else Path()
    if args.command == "prepare":
        return 0
    body, data = measure(args, checkpoint, prep)
    if args.command == "all" and args.control_seeds > 0 and args.policy == "trained":
        control = argparse.Namespace(**{**vars(args), "policy": "scripted", "parts": ["smoothness"],
                                        "seeds": args.control_seeds, "out": str(Path(args.out) / "control")})
        control_body, data["control"] = measure(control, Path(), prep)
        body += ("\n**Control: the scripted motion itself as the policy** (the synthetic runner's `circle` chunks, "
                 "consistent from one chunk to the next, and its stand-in for RTC guidance: rows `0 .. d-1` copied "
                 "from the prefix; " + f"{args.control_seeds} seed(s)). What the measure gives for chunks that agree:\n\n"
                 + control_body)
    print(body)
    print(f"({(time.perf_counter() - t0) / 60:.1f} min)", file=sys.stderr)
    if args.write_docs:
        m = data["machine"]
        command = "python -m benchmarks.studies.rtc " + " ".join(argv if argv is not None else sys.argv[1:])
        head = (f"Command: `{command.strip()}` ({m['date']}, commit {m['git_commit']}, {m['cores']} cores "
                f"{m['cpu']}, load average at start {', '.join(f'{x:.2f}' for x in m['load_avg_at_start'] or [])}; "
                f"policy: {data['policy']} ({data['prepare']['train_steps']} training steps); server-side RTC settings in the manifest: "
                f"{'yes' if data['server_rtc_settings'] else 'no (this tree has none: every rtc chunk fell back to blending)'})\n")
        write_docs_block(Path(args.write_docs), BEGIN, END, "\n" + head + "\n" + body, heading="Real-time chunking")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
