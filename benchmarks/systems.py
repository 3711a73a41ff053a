"""The three systems compared, each as a server side and a client side that run in worker processes.

ours     lerobot_zenoh's real code: `RobotClient` (outbox -> publisher thread: JPEG, msgpack, Zenoh put;
         receiver thread: decode, trim, `ActionBuffer.merge`) and `PolicyServer` with the synthetic policy
         at zero latency from a manifest. Hooks only observe: the outbox's `put` and the buffer's
         `merge` are wrapped to read the clock; nothing on the path is replaced.
lerobot  LeRobot 0.6.1's async inference: its gRPC `PolicyServer` (pickle, `SendObservations`,
         `GetActions`, its observation queue and pre/post-processing loop) and its `RobotClient`
         (`send_observation`, `receive_actions`, `_aggregate_action_queues`, `control_loop`). Only the
         model is replaced: `from_pretrained` returns a fake policy that answers a (1, 50, 6) chunk at
         once, and the pre/post-processors are identities (a real checkpoint's normalisers are model
         cost, not transport).
floor    what no middleware can beat: the same JPEG bytes put raw on Zenoh, a 1.2 KB reply (the 50x6
         float32 numbers), no encoding; and JPEG encoding/decoding measured alone.

Times compared are taken in one process (`perf_counter`), except the control-loop benchmark's kill
time, which uses CLOCK_MONOTONIC (`time.monotonic`), shared by every process on the host.
"""

from __future__ import annotations

import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks.harness.workloads import ACTION_DIM, CHUNK_SIZE, FPS, JPEG_QUALITY, WORKLOADS, make_frames, make_pool_robot, pool_size

CLUSTER = "bench"
EXPERIMENT = "lz"
MODEL = "synthetic"
VERSION = "v1"
FLOOR_PREFIX = "bench/floor"
INGEST_FLOOR_PREFIX = "bench/ingest"
REPLY_BYTES = CHUNK_SIZE * ACTION_DIM * 4  # the numbers of one chunk, float32


def _zenoh_settings(listen=(), connect=()):
    from lerobot_zenoh.transport.settings import ZenohSettings

    # No shared memory: a robot and its server are on different hosts, and on the shaped links
    # shared memory would bypass the link.
    return ZenohSettings(listen=list(listen), connect=list(connect), multicast_scouting=False, shared_memory=False)


def _app_key(app: str):
    from lerobot_zenoh.protocol.keys import AppKey

    return AppKey(CLUSTER, EXPERIMENT, MODEL, VERSION, app)


# ============================================================================= ours


class OursServer:
    """`PolicyServer` from a manifest: one synthetic model per entry (app, workload, latency_ms, max_clients).

    Counts how many observations it msgpack-decodes and how many JPEG frames it decodes (by wrapping
    the codec functions the server calls), and times each `runner.run` (the policy's own time, given to
    every request of the call).
    """

    def __init__(self, listen: list[str], models: list[dict]):
        self.listen = listen
        self.models = models
        self.policy_ms: dict[str, float] = {}
        self.decoded_observations = 0
        self.decoded_jpegs = 0
        self._count_lock = threading.Lock()
        self.server = None

    def start(self) -> dict:
        from lerobot_zenoh.protocol import codec
        from lerobot_zenoh.server.config.manifest import parse_manifest
        from lerobot_zenoh.server.shell.policy_server import PolicyServer

        entries = []
        for m in self.models:
            wl = WORKLOADS[m["workload"]]
            entries.append({
                "model_id": MODEL, "model_version": VERSION, "application_tag": m["app"], "fps": FPS,
                "accept_unknown_clients": True, "max_unknown_clients": m.get("max_unknown_clients", 64),
                "synthetic": {"state_dim": 6, "action_dim": ACTION_DIM, "chunk_size": CHUNK_SIZE,
                              "cameras": {n: [h, w] for n, h, w in wl.cameras}, "latency_ms": m.get("latency_ms", 0.0)},
            })
        manifest = parse_manifest({
            "cluster_uuid": CLUSTER, "experiment_tag": EXPERIMENT, "server_id": "bench-server",
            "zenoh": {"listen": self.listen, "multicast_scouting": False, "shared_memory": False},
            "server": entries,
        })
        decode_observation, decode_jpeg = codec.decode_observation, codec.decode_jpeg

        def counting_decode_observation(*a, **kw):
            with self._count_lock:
                self.decoded_observations += 1
            return decode_observation(*a, **kw)

        def counting_decode_jpeg(*a, **kw):
            with self._count_lock:
                self.decoded_jpegs += 1
            return decode_jpeg(*a, **kw)

        codec.decode_observation = counting_decode_observation
        codec.decode_jpeg = counting_decode_jpeg
        self.server = PolicyServer(manifest).start()
        for model in self.server.models:
            run = model.runner.run

            def timed(requests, *, capture_updates=False, _run=run):
                t0 = time.perf_counter()
                out = _run(requests, capture_updates=capture_updates)
                elapsed_ms = (time.perf_counter() - t0) * 1000
                for r in requests:
                    self.policy_ms[f"{r.session_id}:{r.seed & 0xFFFFFFFF}"] = elapsed_ms
                return out

            model.runner.run = timed
        return {"listen": self.listen}

    def take_policy_ms(self) -> dict[str, float]:
        out, self.policy_ms = self.policy_ms, {}
        return out

    def stats(self) -> dict:
        received = superseded = served = rejected = 0
        for model in self.server.stats().values():
            for c in model["clients"].values():
                received += c["received"]
                superseded += c["superseded"]
                served += c["served"]
                rejected += sum(c["rejected"].values())
        return {"received": received, "superseded": superseded, "served": served, "rejected": rejected,
                "decoded_observations": self.decoded_observations, "decoded_jpegs": self.decoded_jpegs,
                "samples": sum(getattr(sub, "received", 0) for model in self.server.models  # liveliness watchers count none
                               for subs in model.subscriptions.values() for sub in subs)}

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


class StampingRobot:
    """A robot that notes the monotonic time of each `get_observation` (the start of a control step)."""

    def __init__(self, robot, stamps: list[float]):
        self._robot = robot
        self._stamps = stamps

    def get_observation(self):
        self._stamps.append(time.monotonic())
        return self._robot.get_observation()

    def __getattr__(self, name):
        return getattr(self._robot, name)


class _CountingPublisher:
    """A publisher that notes each payload's size before putting it."""

    def __init__(self, publisher, sizes: list[int]):
        self._publisher = publisher
        self._sizes = sizes

    def put(self, payload, attachment=None):
        self._sizes.append(len(payload))
        return self._publisher.put(payload, attachment=attachment)

    def __getattr__(self, name):
        return getattr(self._publisher, name)


class OursClient:
    """A real `RobotClient` on a replaying robot.

    `send_every_step`: the send trigger's buffer time is set so high that an observation goes out on
    every control step unless one is already in flight (the heaviest setting for the loop).
    """

    def __init__(self, workload: str, endpoint: str, client_uuid: str = "robot_1", app: str | None = None,
                 same_host: bool = False):
        self.workload = WORKLOADS[workload]
        self.endpoint = endpoint
        # False: JPEG over the network even when the server is on this host (the network path);
        # True: the same-host path (raw frames through /dev/shm) when the server offers it.
        self.same_host = same_host
        self.client_uuid = client_uuid
        self.app = app or workload
        self.client = None
        self._puts: list[tuple[int, float, float]] = []  # (seq_id, t_handover, blocked_s)
        self._merged = threading.Event()
        self._merged_at: dict[int, float] = {}
        self._steps: list[float] = []
        self.payload_bytes: list[int] = []

    def start(self) -> dict:
        from lerobot_zenoh.client.client import RobotClient
        from lerobot_zenoh.client.config import RobotClientConfig
        from lerobot_zenoh.client.config_sim_robot import SimRobotConfig
        from lerobot_zenoh.client.link import open_session
        from lerobot_zenoh.client.task import Task
        from lerobot_zenoh.scheduling.send_trigger import SendTriggerConfig

        wl = self.workload
        robot = make_pool_robot(wl)
        key = _app_key(self.app)
        config = RobotClientConfig(
            robot=SimRobotConfig(cameras=dict(wl.camera_shapes), fps=FPS), client_uuid=self.client_uuid,
            cluster_uuid=key.cluster, experiment_tag=key.experiment, model_id=key.model, model_version=key.version,
            application_tag=key.app, endpoint=self.endpoint, zenoh=_zenoh_settings(), fps=FPS,
            actions_per_chunk=CHUNK_SIZE, jpeg_quality=JPEG_QUALITY, same_host=self.same_host,
            send=SendTriggerConfig(buffer_time_s=1000.0, max_in_flight=1))
        bench = self

        class NotingTask(Task):
            """The plain task, noting when each chunk went into the buffer (after the merge)."""

            def on_chunk(self, seq_id, arrived_s):
                bench._merged_at[seq_id] = time.perf_counter()
                bench._merged.set()

        class CountingSession:
            """The client's own session; its observation publisher notes each payload's size."""

            def __init__(self, settings):
                self._session = open_session(settings, config.discovery_timeout_s)

            def publisher(self, key, qos):
                publisher = self._session.publisher(key, qos)
                return _CountingPublisher(publisher, bench.payload_bytes) if key == config.client_key.obs else publisher

            def __getattr__(self, name):
                return getattr(self._session, name)

        # The robot notes the start of each control step (its observation is the step's first act).
        self.client = client = RobotClient(config, StampingRobot(robot, self._steps), task=NotingTask(),
                                           session_factory=CountingSession).start()
        if self.same_host and not client.same_host_active:
            raise RuntimeError("the same-host path was asked for but not chosen (server offers it? /dev/shm?)")

        # Observe, do not replace: the hand-over keeps its own code.
        put = client.outbox.put

        def timed_put(item):
            t0 = time.perf_counter()
            put(item)
            self._puts.append((item.seq_id, t0, time.perf_counter() - t0))

        client.outbox.put = timed_put
        return {"server_id": client.status.server_id}

    def round_trips(self, n: int, timeout_s: float = 3.0) -> dict:
        """`n` observations, each handed over once the previous chunk is in the buffer."""
        client = self.client
        t0 = time.perf_counter()
        rtts, blocked, seqs, lost = [], [], [], 0
        self.payload_bytes.clear()
        cpu0 = time.process_time()
        for _ in range(n):
            self._merged.clear()
            before = len(self._puts)
            deadline = time.perf_counter() + timeout_s
            while len(self._puts) == before and time.perf_counter() < deadline:
                client.loop.step(time.perf_counter(), t0)  # the control loop's own step: capture, hand over, act
                if len(self._puts) == before:
                    time.sleep(0.002)  # a request still in flight (a lost one expires after its timeout)
            if len(self._puts) == before:
                lost += 1
                continue
            seq, t_put, b = self._puts[-1]
            if not self._merged.wait(timeout_s) or seq not in self._merged_at:
                lost += 1
                continue
            rtts.append((self._merged_at.pop(seq) - t_put) * 1000)
            blocked.append(b * 1e6)
            seqs.append(f"{self.client_uuid}:{seq}")
        cpu = time.process_time() - cpu0
        return {"rtt_ms": rtts, "handover_us": blocked, "keys": seqs, "lost": lost, "client_cpu_s": cpu,
                "obs_bytes": float(np.mean(self.payload_bytes)) if self.payload_bytes else None}

    def control_loop(self, duration_s: float) -> dict:
        """`RobotClient.run` for `duration_s`; every step's start time and every hand-over's blocking time."""
        client = self.client
        self._puts.clear()
        self._steps.clear()
        t_mono, t_perf = time.monotonic(), time.perf_counter()
        counters = client.run(duration_s)
        # hand-overs on the monotonic clock (the driver's kill time is on that clock)
        handovers = [(t_mono + (t - t_perf), b * 1e6) for _, t, b in self._puts]
        return {"steps": self._steps, "handovers": handovers, "overruns": counters.overruns,
                "empty_cycles": counters.empty_cycles, "chunks": counters.chunks_received,
                "watchdog_events": counters.watchdog_events}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


# ============================================================================= LeRobot


class _Identity:
    def __call__(self, x):
        return x


def _patch_lerobot_server(recorder: dict) -> None:
    """Keep LeRobot's server as it is, except the model: a fake from `from_pretrained`, identity processors."""
    import torch
    from lerobot.async_inference import policy_server
    from lerobot.configs import FeatureType, PolicyFeature

    class FakeConfig:
        def __init__(self, workload):
            self.image_features = {f"observation.images.{n}": PolicyFeature(type=FeatureType.VISUAL, shape=(3, h, w))
                                   for n, h, w in workload.cameras}

    class FakePolicy:
        """What `predict_action_chunk` of a zero-cost ACT would return: (1, 50, 6) at once."""

        def __init__(self, workload):
            self.config = FakeConfig(workload)

        @classmethod
        def from_pretrained(cls, path: str):
            return cls(WORKLOADS[path.removeprefix("fake://")])

        def to(self, device):
            return self

        def predict_action_chunk(self, batch):
            t0 = time.perf_counter()
            state = batch["observation.state"].to(torch.float32)
            chunk = state[:, None, :ACTION_DIM].repeat(1, CHUNK_SIZE, 1)
            recorder["ms"][recorder["key"]] = (time.perf_counter() - t0) * 1000
            return chunk

    policy_server.get_policy_class = lambda policy_type: FakePolicy
    policy_server.make_pre_post_processors = lambda *a, **kw: (_Identity(), _Identity())


class LeRobotServer:
    """LeRobot's `PolicyServer` servicer on a gRPC server built as its `serve()` builds it."""

    def __init__(self, addresses: list[str], obs_queue_timeout_s: float = 2.0):
        self.addresses = addresses
        self.obs_queue_timeout_s = obs_queue_timeout_s
        self._recorder = {"ms": {}, "key": None}
        self.received = 0

    def start(self) -> dict:
        from concurrent import futures

        import grpc
        from lerobot.async_inference.configs import PolicyServerConfig
        from lerobot.async_inference.policy_server import PolicyServer
        from lerobot.transport import services_pb2_grpc

        _patch_lerobot_server(self._recorder)
        host, port = self.addresses[0].rsplit(":", 1)
        self.policy_server = ps = PolicyServer(PolicyServerConfig(host=host, port=int(port), fps=FPS, inference_latency=0.0,
                                                                  obs_queue_timeout=self.obs_queue_timeout_s))
        predict = ps._predict_action_chunk

        def keyed_predict(observation_t):
            self._recorder["key"] = f"lerobot:{observation_t.get_timestep()}"
            return predict(observation_t)

        ps._predict_action_chunk = keyed_predict
        enqueue = ps._enqueue_observation

        def counting_enqueue(obs):
            self.received += 1
            return enqueue(obs)

        ps._enqueue_observation = counting_enqueue
        self.grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))  # as lerobot's serve()
        services_pb2_grpc.add_AsyncInferenceServicer_to_server(ps, self.grpc_server)
        for addr in self.addresses:
            self.grpc_server.add_insecure_port(addr)
        self.grpc_server.start()
        return {"addresses": self.addresses}

    def take_policy_ms(self) -> dict[str, float]:
        out, self._recorder["ms"] = self._recorder["ms"], {}
        return out

    def stats(self) -> dict:
        return {"received": self.received}

    def close(self) -> None:
        self.policy_server.stop()
        self.grpc_server.stop(grace=0.5)


class LeRobotClient:
    """LeRobot's `RobotClient` on the same replaying robot.

    `chunk_size_threshold=1.0` makes its control loop send an observation on every step, as `OursClient`.
    """

    def __init__(self, workload: str, address: str, chunk_size_threshold: float = 1.0):
        self.workload = WORKLOADS[workload]
        self.address = address
        self.chunk_size_threshold = chunk_size_threshold
        self._merged = threading.Event()
        self._merged_at = 0.0
        self._timestep = 0
        self._last_chunk = None
        self._sends: list[tuple[float, float]] = []
        self._iterations: list[float] = []

    def start(self) -> dict:
        from lerobot.async_inference import robot_client
        from lerobot.async_inference.configs import RobotClientConfig

        from lerobot_zenoh.client.config_sim_robot import SimRobotConfig

        wl = self.workload
        robot = make_pool_robot(wl, connect=False)
        robot_client.make_robot_from_config = lambda cfg: robot
        config = RobotClientConfig(
            policy_type="act", pretrained_name_or_path=f"fake://{wl.key}",
            robot=SimRobotConfig(cameras=dict(wl.camera_shapes), fps=FPS), actions_per_chunk=CHUNK_SIZE,
            task="bench", server_address=self.address, fps=FPS, chunk_size_threshold=self.chunk_size_threshold,
            aggregate_fn_name="weighted_average")
        self.client = client = robot_client.RobotClient(config)
        if not client.start():
            raise RuntimeError(f"LeRobot client could not reach {self.address}")
        aggregate = client._aggregate_action_queues

        def timed_aggregate(incoming, aggregate_fn=None):
            aggregate(incoming, aggregate_fn)
            self._merged_at = time.perf_counter()
            self._last_chunk = incoming
            self._merged.set()

        client._aggregate_action_queues = timed_aggregate
        send = client.send_observation

        def timed_send(obs):
            t0 = time.perf_counter()
            ok = send(obs)
            self._sends.append((t0, time.perf_counter() - t0))
            return ok

        client.send_observation = timed_send
        self._receiver = threading.Thread(target=client.receive_actions, daemon=True)
        self._receiver.start()
        return {"address": self.address}

    def round_trips(self, n: int, timeout_s: float = 5.0) -> dict:
        from lerobot.async_inference.helpers import TimedObservation

        client = self.client
        if self._timestep == 0:
            client.start_barrier.wait()  # the receiver waits for a control loop; this is it
        rtts, blocked, keys, lost = [], [], [], 0
        cpu0 = time.process_time()
        obs = None
        for _ in range(n):
            raw = client.robot.get_observation()
            raw["task"] = "bench"
            obs = TimedObservation(timestamp=time.time(), observation=raw, timestep=self._timestep)
            obs.must_go = True  # never filtered as "similar": every observation gets a chunk
            self._timestep += 1
            self._merged.clear()
            n_sends = len(self._sends)
            client.send_observation(obs)
            t0, b = self._sends[n_sends]
            if not self._merged.wait(timeout_s):
                lost += 1
                continue
            rtts.append((self._merged_at - t0) * 1000)
            blocked.append(b * 1e6)
            keys.append(f"lerobot:{obs.get_timestep()}")
        cpu = time.process_time() - cpu0
        obs_bytes = len(pickle.dumps(obs)) if obs is not None else None
        reply_bytes = len(pickle.dumps(self._last_chunk)) if self._last_chunk is not None else None
        return {"rtt_ms": rtts, "handover_us": blocked, "keys": keys, "lost": lost, "client_cpu_s": cpu,
                "obs_bytes": obs_bytes, "reply_bytes": reply_bytes}

    def control_loop(self, duration_s: float) -> dict:
        """LeRobot's own `control_loop` for `duration_s`: iteration start times and send blocking times."""
        client = self.client
        available = client.actions_available

        def stamped_available():
            self._iterations.append(time.monotonic())
            return available()

        client.actions_available = stamped_available
        self._sends.clear()
        t_mono, t_perf = time.monotonic(), time.perf_counter()
        threading.Timer(duration_s, client.shutdown_event.set).start()
        client.control_loop(task="bench")
        handovers = [(t_mono + (t - t_perf), b * 1e6) for t, b in self._sends]
        return {"steps": self._iterations, "handovers": handovers}

    def close(self) -> None:
        try:
            self.client.stop()
        except Exception:
            pass


# ============================================================================= the floor


class FloorServer:
    """Raw Zenoh: replies 1.2 KB to every sample on `bench/floor/*/obs`; counts `bench/ingest/*/obs`."""

    def __init__(self, listen: list[str]):
        self.listen = listen
        self.ingested = 0

    def start(self) -> dict:
        import zenoh

        from lerobot_zenoh.transport.session import ACTION_QOS

        self.session = zenoh.open(_zenoh_settings(listen=self.listen).to_zenoh_config())
        self._sub = self.session.declare_subscriber(f"{FLOOR_PREFIX}/*/obs", zenoh.handlers.FifoChannel(64))
        self._ingest = self.session.declare_subscriber(f"{INGEST_FLOOR_PREFIX}/*/obs", self._count)
        self._pubs = {}
        self._qos = ACTION_QOS
        threading.Thread(target=self._reply_loop, daemon=True).start()
        return {"listen": self.listen}

    def _count(self, sample) -> None:
        self.ingested += 1

    def _reply_loop(self) -> None:
        import zenoh

        reply = bytes(REPLY_BYTES)
        while True:
            try:
                sample = self._sub.recv()
            except Exception:
                return
            key = str(sample.key_expr)[: -len("obs")] + "act"
            pub = self._pubs.get(key)
            if pub is None:
                pub = self._pubs[key] = self.session.declare_publisher(
                    key, congestion_control=zenoh.CongestionControl.BLOCK, priority=self._qos.priority,
                    express=True, reliability=zenoh.Reliability.RELIABLE)
            pub.put(reply)

    def take_policy_ms(self) -> dict:
        return {}

    def stats(self) -> dict:
        return {"received": self.ingested, "samples": self.ingested}

    def close(self) -> None:
        self.session.close()


def _encode_pool(workload) -> tuple[dict[str, list[np.ndarray]], list[list[bytes]]]:
    """The workload's frames, and per frame index the JPEG of every camera (as the client encodes them)."""
    from lerobot_zenoh.protocol import codec

    frames = make_frames(workload, pool_size(workload))
    n = pool_size(workload)
    jpegs = [[codec.encode_jpeg(frames[name][k], JPEG_QUALITY) for name, _, _ in workload.cameras] for k in range(n)]
    return frames, jpegs


class FloorClient:
    """Puts the concatenated JPEG bytes of one observation, waits for the 1.2 KB reply in a callback."""

    def __init__(self, workload: str, endpoint: str):
        self.workload = WORKLOADS[workload]
        self.endpoint = endpoint
        self._event = threading.Event()
        self._t_reply = 0.0

    def start(self) -> dict:
        import zenoh

        from lerobot_zenoh.transport.session import OBSERVATION_QOS

        self.frames, jpegs = _encode_pool(self.workload)
        state = np.zeros(6, dtype=np.float32).tobytes()
        self.payloads = [b"".join(js) + state for js in jpegs]
        self.session = zenoh.open(_zenoh_settings(connect=[self.endpoint]).to_zenoh_config())
        key = f"{FLOOR_PREFIX}/{self.workload.key}"
        self._pub = self.session.declare_publisher(
            f"{key}/obs", congestion_control=zenoh.CongestionControl.DROP, priority=OBSERVATION_QOS.priority,
            express=True, reliability=zenoh.Reliability.BEST_EFFORT)
        self._sub = self.session.declare_subscriber(f"{key}/act", self._on_reply)
        # The subscriber's declaration must reach the other side before the first put.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            self._event.clear()
            self._pub.put(self.payloads[0])
            if self._event.wait(0.2):
                break
        return {"payload_bytes": float(np.mean([len(p) for p in self.payloads]))}

    def _on_reply(self, sample) -> None:
        self._t_reply = time.perf_counter()
        self._event.set()

    def round_trips(self, n: int, timeout_s: float = 3.0) -> dict:
        rtts, blocked, lost = [], [], 0
        cpu0 = time.process_time()
        for i in range(n):
            payload = self.payloads[i % len(self.payloads)]
            self._event.clear()
            t0 = time.perf_counter()
            self._pub.put(payload)
            t1 = time.perf_counter()
            if not self._event.wait(timeout_s):
                lost += 1
                continue
            rtts.append((self._t_reply - t0) * 1000)
            blocked.append((t1 - t0) * 1e6)
        return {"rtt_ms": rtts, "handover_us": blocked, "keys": [], "lost": lost,
                "client_cpu_s": time.process_time() - cpu0,
                "obs_bytes": float(np.mean([len(p) for p in self.payloads])), "reply_bytes": REPLY_BYTES}

    def jpeg_costs(self, repeats: int = 1, frames: int | None = None) -> dict:
        """Encode and decode pooled frames with the project's codec: per frame, per observation one
        camera after the other, and per observation with one thread per camera. Lists of ms."""
        from lerobot_zenoh.protocol import codec

        cams = [name for name, _, _ in self.workload.cameras]
        shapes = self.workload.camera_shapes
        n = min(frames or len(self.frames[cams[0]]), len(self.frames[cams[0]]))
        enc, dec, enc_seq, dec_seq, enc_par, dec_par, sizes = [], [], [], [], [], [], []
        pool = ThreadPoolExecutor(max_workers=len(cams))
        for _ in range(repeats):
            for k in range(n):
                t_obs = time.perf_counter()
                jpegs = []
                for c in cams:
                    t0 = time.perf_counter()
                    jpegs.append(codec.encode_jpeg(self.frames[c][k], JPEG_QUALITY))
                    enc.append((time.perf_counter() - t0) * 1000)
                enc_seq.append((time.perf_counter() - t_obs) * 1000)
                sizes.extend(len(j) for j in jpegs)
                t_obs = time.perf_counter()
                for c, j in zip(cams, jpegs, strict=True):
                    t0 = time.perf_counter()
                    codec.decode_jpeg(j, shapes[c])
                    dec.append((time.perf_counter() - t0) * 1000)
                dec_seq.append((time.perf_counter() - t_obs) * 1000)
                t0 = time.perf_counter()
                list(pool.map(lambda c, k=k: codec.encode_jpeg(self.frames[c][k], JPEG_QUALITY), cams))
                enc_par.append((time.perf_counter() - t0) * 1000)
                t0 = time.perf_counter()
                list(pool.map(lambda cj: codec.decode_jpeg(cj[1], shapes[cj[0]]), zip(cams, jpegs, strict=True)))
                dec_par.append((time.perf_counter() - t0) * 1000)
        pool.shutdown()
        return {"encode_frame_ms": enc, "decode_frame_ms": dec, "encode_obs_seq_ms": enc_seq, "decode_obs_seq_ms": dec_seq,
                "encode_obs_par_ms": enc_par, "decode_obs_par_ms": dec_par, "jpeg_bytes": sizes}

    def close(self) -> None:
        self.session.close()


# ============================================================================= ingest publishers


#: A seq_id that MessagePack writes as uint64 (0xcf + 8 bytes), so a larger one fits in its place.
_SEQ_SENTINEL = 0x0100_0000_0000_0000


class _SeqStamped:
    """An encoded observation whose seq_id can be rewritten in place (found once, by its bytes)."""

    def __init__(self, payload: bytes):
        marker = b"\xcf" + _SEQ_SENTINEL.to_bytes(8, "big")
        self.offset = payload.index(marker) + 1
        self.payload = bytearray(payload)

    def with_seq(self, seq_id: int) -> bytes:
        self.payload[self.offset:self.offset + 8] = seq_id.to_bytes(8, "big")
        return bytes(self.payload)


class IngestPublisher:
    """N simulated clients at 30 Hz each, publishing pre-encoded observations (no per-message work).

    system "ours": lerobot_zenoh wire format on each client's `.../<client>/obs` key (Zenoh, one session);
    "floor": the same bytes on a key the floor server only counts; "lerobot": pre-pickled
    `TimedObservation`s through `SendObservations`, one gRPC channel and thread per client.
    """

    def __init__(self, system: str, endpoint: str, workload: str, max_clients: int, app: str):
        self.system = system
        self.endpoint = endpoint
        self.workload = WORKLOADS[workload]
        self.max_clients = max_clients
        self.app = app

    def start(self) -> dict:
        wl = self.workload
        frames, jpegs = _encode_pool(wl)
        self.variants = 2  # distinct payloads per client, alternated
        if self.system == "lerobot":
            from lerobot.async_inference.helpers import TimedObservation

            robot = make_pool_robot(wl, frames=frames)
            self.payloads = []
            for k in range(self.variants):
                raw = robot.get_observation()
                raw["task"] = "bench"
                self.payloads.append(pickle.dumps(TimedObservation(timestamp=time.time(), observation=raw, timestep=k)))
            return {"payload_bytes": len(self.payloads[0])}
        import zenoh

        from lerobot_zenoh.protocol import codec
        from lerobot_zenoh.protocol.messages import ExecutionInfo, Observation

        self.session = zenoh.open(_zenoh_settings(connect=[self.endpoint]).to_zenoh_config())
        key = _app_key(self.app)
        self.clients = []
        state = np.linspace(-1, 1, 6).astype(np.float32)
        cams = [n for n, _, _ in wl.cameras]
        for i in range(self.max_clients):
            cid = f"c{i:03d}"
            k_expr = key.client(cid).obs if self.system == "ours" else f"{INGEST_FLOOR_PREFIX}/{cid}/obs"
            pub = self.session.declare_publisher(k_expr, congestion_control=zenoh.CongestionControl.DROP,
                                                 express=True, reliability=zenoh.Reliability.BEST_EFFORT)
            # The server drops a seq_id it has served already (`replayed`), so every message needs a
            # new one: each payload is encoded once with a sentinel seq_id (8 bytes on the wire), and
            # `publish` writes the message's own seq_id over it (a copy, no encoding per message).
            payloads = [_SeqStamped(codec.encode(Observation(_SEQ_SENTINEL, cid, state,
                                                             dict(zip(cams, jpegs[k % len(jpegs)], strict=True)), "bench",
                                                             ExecutionInfo(actions_buffered=0, control_period_s=1 / FPS),
                                                             episode_id="0")))
                        for k in range(self.variants)]
            self.clients.append((pub, payloads))
        time.sleep(1.0)  # let the declarations reach the server
        return {"payload_bytes": len(self.clients[0][1][0].payload)}

    def publish(self, n_clients: int, duration_s: float) -> dict:
        """Publish for `duration_s`; client i at t0 + k/30 + i/(30 n): evenly spread, like independent robots."""
        if self.system == "lerobot":
            return self._publish_grpc(n_clients, duration_s)
        period = 1.0 / FPS
        offsets = [i * period / n_clients for i in range(n_clients)]
        cpu0 = time.process_time()
        t0 = time.perf_counter() + 0.05
        published = late = 0
        k = 0
        while True:
            base = t0 + k * period
            if base - t0 >= duration_s:
                break
            for i in range(n_clients):
                due = base + offsets[i]
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                elif wait < -period:
                    late += 1
                pub, payloads = self.clients[i]
                pub.put(payloads[k % self.variants].with_seq(_SEQ_SENTINEL + 1 + k))
                published += 1
            k += 1
        elapsed = time.perf_counter() - t0
        return {"published": published, "late": late, "elapsed_s": elapsed, "cpu_s": time.process_time() - cpu0}

    def _publish_grpc(self, n_clients: int, duration_s: float) -> dict:
        import grpc
        from lerobot.transport import services_pb2, services_pb2_grpc
        from lerobot.transport.utils import grpc_channel_options, send_bytes_in_chunks

        period = 1.0 / FPS
        counts = [0] * n_clients
        errors = [0] * n_clients
        late = [0] * n_clients
        t0 = time.perf_counter() + 0.5
        cpu0 = time.process_time()

        def one(i: int) -> None:
            channel = grpc.insecure_channel(self.endpoint, grpc_channel_options())
            stub = services_pb2_grpc.AsyncInferenceStub(channel)
            k = 0
            while True:
                due = t0 + k * period + i * period / n_clients
                if due - t0 >= duration_s:
                    break
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                elif wait < -period:
                    late[i] += 1
                try:
                    # A deadline, because LeRobot's server can stop answering: its `_enqueue_observation`
                    # checks `full()`, then `get_nowait()`, then a blocking `put()` on a one-slot queue with
                    # no lock, so two clients at once can leave every gRPC worker thread blocked in `put`.
                    stub.SendObservations(send_bytes_in_chunks(self.payloads[k % self.variants], services_pb2.Observation,
                                                               silent=True), timeout=2.0)
                    counts[i] += 1
                except grpc.RpcError:
                    errors[i] += 1
                k += 1
            channel.close()

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=duration_s + 10)
        return {"published": sum(counts), "errors": sum(errors), "late": sum(late),
                "elapsed_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0}

    def close(self) -> None:
        if self.system != "lerobot":
            self.session.close()
