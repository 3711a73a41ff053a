"""Measure a serving profile against a running server (`lerobot-zenoh-profile`; docs/pipelines.md).

Virtual clients (ids `profile-<i>`: the server must accept unknown clients or list them) send the
server's expected observation (zeros, JPEG-encoded cameras) over Zenoh:

1. saturation: every client keeps one request in flight for `saturation_s`; the completed rate is the
   server's maximum throughput at its configured batch size;
2. for each fraction (Rosa: 10% .. 100%), Poisson arrivals at that fraction of the maximum for
   `seconds_per_rate`, each on a client with nothing in flight (an arrival that finds none is counted
   as dropped); latency = answer arrival - observation send, on this process's clock.

The answer is what the server's status says it answers (`Status.output`, docs/protocol.md §5.3): an action
chunk, a TextResult (System 2) or a Verdict (safety, monitor), each on its own topic; a multi-model
component's server is measured through its own app key, which it serves besides its tasks' streams.

Each rate gives one `ProfilePoint` (mean, p50, p90, p95, p99) labelled with the server's batch size
(`--batch_size`: the manifest's `max_batch_size`, which the status does not carry). A rate where more
than 1% (and more than 2) of arrivals were dropped or unanswered ends the sweep (the server is saturated there).

A model serving System 1 and System 2 from one stream (a pi0.5 with a `language` block and a
pipeline item with `text`; `ProfileRun.text`): the clients publish on the task's observation stream
with a component mask (in the header and the key), asking actions every request and text with
every `every`-th request of a client that has no text being written; the rows are the actions'
latencies while text streams, and each has `text_mean_ms` (send to the final `TextResult`) and the decode cost from the server's
telemetry over the rate (``language.decode_ms``, ``step_ms``, ``step_rows``, ``tokens``,
``decode_steps``): `decode_ms_per_token`, `decode_step_ms`, `decode_batch_mean`. A rate where no
text finished ends the sweep.
"""

from __future__ import annotations

import dataclasses
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
               hardware: str = "gpu", memory_gb: float | None = None,
               components: list[str] | None = None) -> Profiles:
    """`profiles` with `points` added to `model` (replacing rows of the same batch size); `memory_gb`,
    when given, replaces the model's; `components` (``[system1, system2]``: one stream serving both)
    too. A model's rows of one kind only: a two-component model's rows all have `text_mean_ms`
    (ModelProfile refuses a mix)."""
    models = dict(profiles.models) if profiles else {}
    sizes = {p.batch_size for p in points}
    old = models.get(model)
    kept = [p for p in old.points if p.batch_size not in sizes] if old else []
    models[model] = ModelProfile(batching=old.batching if old else batching,
                                 memory_gb=memory_gb if memory_gb is not None else (old.memory_gb if old else None),
                                 components=list(components) if components is not None else (
                                     list(old.components) if old else []),
                                 points=kept + list(points))
    return Profiles(hardware=profiles.hardware if profiles else hardware, models=models)


@dataclass(frozen=True)
class TextProfile:
    """Profile System 1 and System 2 served from one stream: the task whose stream the server serves
    (its manifest's pipeline item with `text`), the two components' bits, and how often a client asks
    text (every `every`-th request)."""

    task: str
    action_bit: int = 0
    text_bit: int = 1
    every: int = 1


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
    text: TextProfile | None = None


class Profiler:
    """Drives the virtual clients from one thread of its own; Zenoh callbacks only enqueue."""

    def __init__(self, session, run: ProfileRun):
        self.session = session
        self.run = run
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sent: dict[tuple[str, int], float] = {}
        self._seq = 0
        self._nonce = secrets.randbits(63)
        # With `run.text`: requests asking text, (client, seq) -> send time, until their final text.
        self._text_sent: dict[tuple[str, int], float] = {}
        self._asked: dict[str, int] = {}  # requests sent per client
        self._telemetry: tuple[float, dict] | None = None  # (arrival, metrics) of the newest

    def measure(self, log=lambda msg: None) -> list[ProfilePoint]:
        from lerobot_zenoh.protocol import codec
        from lerobot_zenoh.protocol.keys import pipeline_app
        from lerobot_zenoh.transport.session import OBSERVATION_QOS

        app = self.run.app_key
        text = self.run.text
        replies = self.session.query(app.status, 2.0)
        if not replies:
            raise TransportError(f"no server answers {app.status}")
        status = codec.decode_status(replies[0][1])
        output = status.output or OutputKind.ACTIONS  # Status.output: what the server answers
        if text is not None and output != OutputKind.ACTIONS:
            raise TransportError(f"{app.prefix} answers {output}: profiling System 1 and System 2 from one stream "
                                 "needs a pi0.5 answering actions (and text on its task stream)")
        topic, decode = _answers()[output]
        images = {name: codec.encode_jpeg(np.zeros((h, w, 3), dtype=np.uint8))
                  for name, (h, w) in status.expected_cameras.items()}
        state = np.zeros(status.state_dim or 1, dtype=np.float32)
        ids = [f"profile-{i}" for i in range(self.run.clients)]
        obs_app = pipeline_app(app.cluster, app.experiment, text.task) if text is not None else app
        # On a task stream keyed by the components asked (protocol.md §2.2): only their server hears them.
        masks = (None,) if text is None else (1 << text.action_bit, 1 << text.action_bit | 1 << text.text_bit)
        pubs = {(cid, mask): self.session.publisher(obs_app.client(cid).obs_for(mask), OBSERVATION_QOS)
                for cid in ids for mask in masks}
        subs = [self.session.subscribe(f"{app.prefix}/*/{topic}",
                                       lambda key, payload: self._inbox.put((key, payload, time.perf_counter())))]
        if text is not None:
            subs.append(self.session.subscribe(
                f"{app.prefix}/*/text", lambda key, payload: self._inbox.put((key, payload, time.perf_counter()))))
            subs.append(self.session.subscribe(f"{app.prefix}/server/*/metrics", self._on_telemetry))
        try:
            def send(cid: str) -> None:
                self._seq += 1
                now = time.perf_counter()
                self._sent[(cid, self._seq)] = now
                obs = codec_observation(self._seq, cid, state, images, self._nonce)
                if text is None:
                    pubs[cid, None].put(codec.encode(obs))
                    return
                k = self._asked[cid] = self._asked.get(cid, 0) + 1
                mask = 1 << text.action_bit
                writing = any(c == cid for c, _ in self._text_sent)
                if (k - 1) % text.every == 0 and not writing:
                    mask |= 1 << text.text_bit
                    self._text_sent[(cid, self._seq)] = now
                obs = dataclasses.replace(obs, component_mask=mask)
                pubs[cid, mask].put(codec.encode(obs), codec.encode_observation_header(obs))

            busy: dict[str, int] = {}

            def drain(until: float, samples: list[float], refill: bool, settle: bool = False,
                      texts: list[float] | None = None) -> None:
                """Take answers until `until` (or, with `settle`, until nothing is in flight)."""
                while True:
                    if settle and not busy and not (texts is not None and self._text_sent):
                        return
                    left = until - time.perf_counter()
                    if left <= 0:
                        return
                    try:
                        key, payload, t = self._inbox.get(timeout=min(left, 0.05))
                    except queue.Empty:
                        continue
                    cid = key.rsplit("/", 2)[-2]
                    if text is not None and key.endswith("/text"):
                        try:
                            answer = codec.decode_text_result(payload)
                        except ProtocolError:
                            continue
                        t0 = None if answer.partial else self._text_sent.pop((cid, answer.response_to_seq_id), None)
                        if t0 is not None and texts is not None:
                            texts.append((t - t0) * 1000.0)
                        continue
                    try:
                        answer = decode(payload)
                    except ProtocolError:
                        continue
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
            drain(time.perf_counter() + self.run.timeout_s, [], refill=False, settle=True, texts=[])
            busy.clear()
            self._sent.clear()
            self._text_sent.clear()
            log(f"saturation: {max_rate:.2f} requests/s at {self.run.clients} clients")
            if max_rate <= 0:
                raise TransportError("the server answered nothing while saturated" + (
                    f" (observations went to task {text.task!r}'s stream: does the server serve it, a pipeline "
                    "item with `text`, and accept the profile-N clients?)" if text is not None else ""))
            # 2. open-loop Poisson arrivals at each fraction
            rng = np.random.default_rng(self.run.seed)
            points = []
            for frac in self.run.fractions:
                rate = frac * max_rate
                samples: list[float] = []
                texts: list[float] = []
                before = self._telemetry
                arrivals = dropped = 0
                t = time.perf_counter()
                end = t + self.run.seconds_per_rate
                while t < end:
                    t += rng.exponential(1.0 / rate)
                    drain(min(t, end), samples, refill=False, texts=texts)
                    if t >= end:
                        break
                    arrivals += 1
                    free = next((c for c in ids if c not in busy), None)
                    if free is None:
                        dropped += 1
                        continue
                    send(free)
                    busy[free] = self._seq
                drain(time.perf_counter() + self.run.timeout_s, samples, refill=False, settle=True, texts=texts)
                unanswered, texts_lost = len(busy), len(self._text_sent)
                busy.clear()
                self._sent.clear()
                self._text_sent.clear()
                lost = dropped + unanswered + texts_lost
                log(f"{frac:.0%} ({rate:.2f}/s): {len(samples)} answered"
                    + (f", {len(texts)} texts ({texts_lost} unanswered)" if text is not None else "")
                    + f", {dropped} dropped (no idle client), {unanswered} unanswered")
                if samples and (text is None or texts):
                    point = latency_point(self.run.batch_size, rate, samples)
                    if text is not None:
                        point = point.model_copy(update={"text_mean_ms": round(float(np.mean(texts)), 4),
                                                         **self._decode_cost(before)})
                    points.append(point)
                if lost > max(2, 0.01 * arrivals) or (text is not None and not texts):
                    break  # saturated (a text profile: no text finished at this rate)
            return points
        finally:
            for sub in subs:
                sub.close()
            for p in pubs.values():
                p.close()

    def _on_telemetry(self, key: str, payload: bytes) -> None:  # Zenoh callback: keep the newest
        from lerobot_zenoh.protocol import codec

        try:
            self._telemetry = (time.perf_counter(), codec.decode_telemetry(payload).metrics)
        except ProtocolError:
            pass

    def _decode_cost(self, before: tuple[float, dict] | None, wait_s: float = 3.0) -> dict:
        """The decode cost between telemetry `before` and the next one after now (the server's
        ``language.*`` counters); empty when the server sends no telemetry."""
        asked = time.perf_counter()
        deadline = asked + wait_s
        while time.perf_counter() < deadline and (self._telemetry is None or self._telemetry[0] < asked):
            time.sleep(0.05)
        after = self._telemetry
        if before is None or after is None or after[0] < asked:
            return {}
        d = {k: after[1].get(f"language.{k}", 0) - before[1].get(f"language.{k}", 0)
             for k in ("decode_ms", "step_ms", "step_rows", "tokens", "decode_steps")}
        out = {}
        if d["tokens"] > 0:
            out["decode_ms_per_token"] = round(d["decode_ms"] / d["tokens"], 4)
        if d["decode_steps"] > 0:
            out["decode_step_ms"] = round(d["step_ms"] / d["decode_steps"], 4)
            out["decode_batch_mean"] = round(d["step_rows"] / d["decode_steps"], 4)
        return out


def codec_observation(seq: int, cid: str, state, images, nonce: int):
    from lerobot_zenoh.protocol.messages import Observation

    return Observation(seq, cid, state, images, "", None, episode_id="profile", session_nonce=nonce)
