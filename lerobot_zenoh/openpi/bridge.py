"""One robot session of the fleet per OpenPI connection, over the project's own Zenoh protocol.

The front door is one more Zenoh client of the policy server (docs/protocol.md): each websocket
connection gets a client id of its own (``<prefix>-<n>``, the lowest free n, so a manifest can list
``openpi-0`` .. ``openpi-7``), a fresh session nonce, a liveliness token on its metrics key, a
publisher on its ``obs`` key and a subscriber on its ``action`` key. The server therefore batches,
schedules, limits and reports it exactly as it does a robot.

An OpenPI request is synchronous (one in flight per connection): :meth:`RobotLink.infer` encodes
the cameras as JPEG, puts the observation (best effort, as a robot does) and waits for the chunk
answering it. Observations are best effort, so an unanswered one is sent again as a new request
(a new seq_id) after `resend_after_s`; a chunk answering any of them ends the wait.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.openpi.wire import OpenPIReason
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import AppKey
from lerobot_zenoh.protocol.messages import ActionChunk, ExecutionInfo, Observation
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession

__all__ = ["Answer", "ClientIds", "RobotLink"]


@dataclass(frozen=True)
class Answer:
    chunk: ActionChunk
    encode_ms: float  # JPEG encoding of the request's cameras, in the front door
    round_trip_ms: float  # first put -> chunk decoded
    sends: int  # 1, or more when best-effort observations were lost and sent again


class ClientIds:
    """The lowest free ``<prefix>-<n>`` for each new connection, up to `capacity` at once."""

    def __init__(self, prefix: str, capacity: int):
        self.prefix = prefix
        self.capacity = capacity
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def take(self) -> str | None:
        with self._lock:
            for n in range(self.capacity):
                if n not in self._used:
                    self._used.add(n)
                    return f"{self.prefix}-{n}"
        return None

    def give_back(self, client_id: str) -> None:
        with self._lock:
            self._used.discard(int(client_id.rsplit("-", 1)[1]))

    def in_use(self) -> int:
        with self._lock:
            return len(self._used)


class RobotLink:
    """A connection's robot session on the fleet: `infer` (one at a time; the first declares the
    session on the fleet, so a connection that never sends a valid request costs the fleet
    nothing), then `close()`."""

    def __init__(self, session: ZenohSession, app: AppKey, client_id: str, *, jpeg_quality: int,
                 resend_after_s: float, timeout_s: float, control_period_s: float | None,
                 jpeg_pool: ThreadPoolExecutor | None = None, stop: threading.Event | None = None):
        self.session = session
        self.key = app.client(client_id)
        self.client_id = client_id
        self.jpeg_quality = jpeg_quality
        self.resend_after_s = resend_after_s
        self.timeout_s = timeout_s
        self.control_period_s = control_period_s
        self._jpeg_pool = jpeg_pool
        self._stop = stop if stop is not None else threading.Event()  # the front door closing: give up
        self._nonce = secrets.randbits(63)
        self._seq = 0
        self._chunks: queue.Queue = queue.Queue(maxsize=64)
        self._owned: list = []
        self._t0 = time.monotonic()

    def open(self) -> RobotLink:
        s = self.session
        self._publisher = s.publisher(self.key.obs, OBSERVATION_QOS)
        self._owned = [self._publisher, s.subscribe(self.key.action, self._on_chunk),
                       s.declare_token(self.key.metrics)]  # the server's session follows this token
        return self

    def _on_chunk(self, key: str, payload: bytes) -> None:
        """Zenoh callback: hand over, nothing else."""
        try:
            self._chunks.put_nowait(payload)
        except queue.Full:
            pass  # nobody waits for them: answers to requests already given up

    def _encode(self, images: dict[str, np.ndarray]) -> dict[str, bytes]:
        names = list(images)
        if self._jpeg_pool is None or len(names) < 2:
            return {n: codec.encode_jpeg(images[n], self.jpeg_quality) for n in names}
        # OpenCV releases the GIL while it encodes: the other cameras on helper threads.
        others = [(n, self._jpeg_pool.submit(codec.encode_jpeg, images[n], self.jpeg_quality)) for n in names[1:]]
        out = {names[0]: codec.encode_jpeg(images[names[0]], self.jpeg_quality)}
        out.update((n, f.result()) for n, f in others)
        return out

    def infer(self, state: np.ndarray, images: dict[str, np.ndarray], task: str) -> Answer:
        """The chunk answering this observation; ProtocolError(UNANSWERED) after `timeout_s`."""
        t0 = time.perf_counter()
        if not self._owned:
            self.open()
        jpegs = self._encode(images)
        encode_ms = (time.perf_counter() - t0) * 1000
        while not self._chunks.empty():  # late answers to an earlier request given up on
            self._chunks.get_nowait()
        asked: set[int] = set()
        start = time.perf_counter()
        deadline = start + self.timeout_s
        while True:
            now = time.perf_counter()
            if self._stop.is_set():
                raise ProtocolError(OpenPIReason.UNANSWERED, "the front door is closing")
            if now >= deadline:
                raise ProtocolError(OpenPIReason.UNANSWERED, f"no chunk from the fleet in {self.timeout_s:g} s "
                                    f"({len(asked)} observations sent as {self.client_id})")
            self._seq += 1
            execution = ExecutionInfo(task_elapsed_s=time.monotonic() - self._t0,
                                      control_period_s=self.control_period_s)
            message = Observation(self._seq, self.client_id, state, jpegs, task, execution, episode_id="0",
                                  session_nonce=self._nonce)
            self._publisher.put(codec.encode(message), attachment=codec.encode_observation_header(message))
            asked.add(self._seq)
            resend_at = min(time.perf_counter() + self.resend_after_s, deadline)
            while (left := resend_at - time.perf_counter()) > 0 and not self._stop.is_set():
                try:
                    payload = self._chunks.get(timeout=min(left, 0.1))
                except queue.Empty:
                    continue
                try:
                    chunk = codec.decode_action_chunk(payload)
                except ProtocolError as exc:
                    raise ProtocolError(OpenPIReason.SERVER_ERROR, f"undecodable chunk from the fleet: {exc}") from exc
                if chunk.response_to_seq_id in asked:
                    return Answer(chunk, encode_ms, (time.perf_counter() - start) * 1000, len(asked))

    def close(self) -> None:
        """Undeclare this connection's publisher, subscriber and token (the session stays open)."""
        for entity in self._owned:
            self.session.release(entity)
        self._owned = []
        while not self._chunks.empty():
            self._chunks.get_nowait()
