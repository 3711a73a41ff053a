"""Measure a serving profile against a running server (`lerobot-zenoh-profile`; docs/pipelines.md).

Virtual clients (ids `profile-<i>`: the server must accept unknown clients or list them) send the
server's expected observation (zeros, JPEG-encoded cameras) over Zenoh:

1. saturation: every client keeps one request in flight for `saturation_s`; the completed rate is the
   server's maximum throughput at its configured batch size;
2. for each fraction (Rosa: 10% .. 100%), Poisson arrivals at that fraction of the maximum for
   `seconds_per_rate`, each on a client with nothing in flight (an arrival that finds none is counted
   as dropped); latency = answer arrival - observation send, on this process's clock.

The answer is what the server's status says it answers (`Status.output`, protocol 1.3): an action
chunk, a TextResult (System 2) or a Verdict (safety, monitor), each on its own topic; a multi-model
component's server is measured through its own app key, which it serves besides its tasks' streams.

Each rate gives one `ProfilePoint` (mean, p50, p90, p95, p99) labelled with the server's batch size
(`--batch_size`: the manifest's `max_batch_size`, which the status does not carry). A rate where more
than 1% (and more than 2) of arrivals were dropped or unanswered ends the sweep (the server is saturated there).
"""

from __future__ import annotations

import queue
import secrets
import time
from dataclasses import dataclass

import numpy as np

from lerobot_zenoh.errors import ProtocolError, TransportError
from lerobot_zenoh.pipelines.profiles import ModelProfile, ProfilePoint, Profiles
from lerobot_zenoh.protocol.keys import ANSWER_TOPICS
from lerobot_zenoh.protocol.reasons import OutputKind

FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def _answers() -> dict:
    from lerobot_zenoh.protocol import codec

    decoders = {OutputKind.ACTIONS: codec.decode_action_chunk, OutputKind.TEXT: codec.decode_text_result,
                OutputKind.VERDICT: codec.decode_verdict}
    return {kind: (ANSWER_TOPICS[kind], decode) for kind, decode in decoders.items()}


def latency_point(batch_size: int, rate_hz: float, samples_ms: list[float]) -> ProfilePoint:
    """One profile row from the latencies measured at one offered rate (pure)."""
    a = np.asarray(samples_ms, dtype=np.float64)
    if a.size == 0:
        raise ValueError("no latency measured")
    pct = {q: float(np.percentile(a, q)) for q in (50, 90, 95, 99)}
    return ProfilePoint(batch_size=batch_size, rate_hz=round(rate_hz, 6), mean_ms=round(float(a.mean()), 4),
                        **{f"p{q}_ms": round(v, 4) for q, v in pct.items()})


def add_points(profiles: Profiles | None, model: str, points: list[ProfilePoint], batching: str = "discrete",
               hardware: str = "gpu", memory_gb: float | None = None) -> Profiles:
    """`profiles` with `points` added to `model` (replacing rows of the same batch size); `memory_gb`,
    when given, replaces the model's."""
    models = dict(profiles.models) if profiles else {}
    sizes = {p.batch_size for p in points}
    old = models.get(model)
    kept = [p for p in old.points if p.batch_size not in sizes] if old else []
    models[model] = ModelProfile(batching=old.batching if old else batching,
                                 memory_gb=memory_gb if memory_gb is not None else (old.memory_gb if old else None),
                                 points=kept + list(points))
    return Profiles(hardware=profiles.hardware if profiles else hardware, models=models)


@dataclass
class ProfileRun:
    app_key: object                 # protocol.keys.AppKey
    batch_size: int
    clients: int = 32
    saturation_s: float = 3.0
    seconds_per_rate: float = 3.0
    fractions: tuple[float, ...] = FRACTIONS
    timeout_s: float = 10.0
    seed: int = 0


class Profiler:
    """Drives the virtual clients from one thread of its own; Zenoh callbacks only enqueue."""

    def __init__(self, session, run: ProfileRun):
        self.session = session
        self.run = run
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sent: dict[tuple[str, int], float] = {}
        self._seq = 0
        self._nonce = secrets.randbits(63)

    def measure(self, log=lambda msg: None) -> list[ProfilePoint]:
        from lerobot_zenoh.protocol import codec
        from lerobot_zenoh.transport.session import OBSERVATION_QOS

        app = self.run.app_key
        replies = self.session.query(app.status, 2.0)
        if not replies:
            raise TransportError(f"no server answers {app.status}")
        status = codec.decode_status(replies[0][1])
        topic, decode = _answers()[status.output or OutputKind.ACTIONS]  # Status.output: what the server answers
        images = {name: codec.encode_jpeg(np.zeros((h, w, 3), dtype=np.uint8))
                  for name, (h, w) in status.expected_cameras.items()}
        state = np.zeros(status.state_dim or 1, dtype=np.float32)
        ids = [f"profile-{i}" for i in range(self.run.clients)]
        pubs = {cid: self.session.publisher(app.client(cid).obs, OBSERVATION_QOS) for cid in ids}
        sub = self.session.subscribe(f"{app.prefix}/*/{topic}",
                                     lambda key, payload: self._inbox.put((key, payload, time.perf_counter())))
        try:
            def send(cid: str) -> None:
                self._seq += 1
                self._sent[(cid, self._seq)] = time.perf_counter()
                pubs[cid].put(codec.encode(codec_observation(self._seq, cid, state, images, self._nonce)))

            busy: dict[str, int] = {}

            def drain(until: float, samples: list[float], refill: bool, settle: bool = False) -> None:
                """Take answers until `until` (or, with `settle`, until nothing is in flight)."""
                while True:
                    if settle and not busy:
                        return
                    left = until - time.perf_counter()
                    if left <= 0:
                        return
                    try:
                        key, payload, t = self._inbox.get(timeout=min(left, 0.05))
                    except queue.Empty:
                        continue
                    try:
                        answer = decode(payload)
                    except ProtocolError:
                        continue
                    cid = key.rsplit("/", 2)[-2]
                    t0 = self._sent.pop((cid, answer.response_to_seq_id), None)
                    if t0 is None:
                        continue
                    busy.pop(cid, None)
                    samples.append((t - t0) * 1000.0)
                    if refill:
                        send(cid)
                        busy[cid] = self._seq

            # 1. saturation, closed loop
            warm: list[float] = []
            for cid in ids:
                send(cid)
                busy[cid] = self._seq
            drain(time.perf_counter() + 0.5, warm, refill=True)
            done: list[float] = []
            t_start = time.perf_counter()
            drain(t_start + self.run.saturation_s, done, refill=True)
            max_rate = len(done) / self.run.saturation_s
            drain(time.perf_counter() + self.run.timeout_s, [], refill=False, settle=True)
            busy.clear()
            self._sent.clear()
            log(f"saturation: {max_rate:.2f} requests/s at {self.run.clients} clients")
            if max_rate <= 0:
                raise TransportError("the server answered nothing while saturated")
            # 2. open-loop Poisson arrivals at each fraction
            rng = np.random.default_rng(self.run.seed)
            points = []
            for frac in self.run.fractions:
                rate = frac * max_rate
                samples: list[float] = []
                arrivals = dropped = 0
                t = time.perf_counter()
                end = t + self.run.seconds_per_rate
                while t < end:
                    t += rng.exponential(1.0 / rate)
                    drain(min(t, end), samples, refill=False)
                    if t >= end:
                        break
                    arrivals += 1
                    free = next((c for c in ids if c not in busy), None)
                    if free is None:
                        dropped += 1
                        continue
                    send(free)
                    busy[free] = self._seq
                drain(time.perf_counter() + self.run.timeout_s, samples, refill=False, settle=True)
                unanswered = len(busy)
                busy.clear()
                self._sent.clear()
                lost = dropped + unanswered
                log(f"{frac:.0%} ({rate:.2f}/s): {len(samples)} answered, {lost} dropped or unanswered")
                if samples:
                    points.append(latency_point(self.run.batch_size, rate, samples))
                if lost > max(2, 0.01 * arrivals):  # a lost best-effort sample or two is not saturation
                    break
            return points
        finally:
            sub.close()
            for p in pubs.values():
                p.close()


def codec_observation(seq: int, cid: str, state, images, nonce: int):
    from lerobot_zenoh.protocol.messages import Observation

    return Observation(seq, cid, state, images, "", None, episode_id="profile", session_nonce=nonce)
