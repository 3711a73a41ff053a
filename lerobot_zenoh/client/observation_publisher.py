"""The observation publisher: the newest capture from the control loop -> JPEG (or /dev/shm) -> msgpack -> put.

The control loop hands a :class:`Capture` to the :class:`Outbox` (one queue put, never blocks); the
publisher's own thread takes the newest one, encodes it and puts it with best effort and congestion
DROP (``transport/session.py``, ``OBSERVATION_QOS``), so a slow link never reaches the control loop.
Constructed with the publisher it puts through (anything with ``put(payload, attachment=...)``: a
Zenoh publisher in production, a counting or slowed wrapper in a test or a benchmark).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from lerobot_zenoh.client.discovery import RobotFeatures
from lerobot_zenoh.client.reporting import ClientCounters
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import ExecutionInfo, HistoryFrame, Observation, RtcInputs
from lerobot_zenoh.telemetry.publisher import worth_logging
from lerobot_zenoh.transport import same_host

log = logging.getLogger(__name__)

__all__ = ["Capture", "ObservationPublisher", "Outbox"]


@dataclass
class Capture:
    """One observation the control loop hands over: what the robot sensed and how to label it."""

    seq_id: int
    step: int
    captured_s: float
    observation: dict
    execution: ExecutionInfo
    episode_id: str
    session_nonce: int | None = None
    rtc: RtcInputs | None = None
    # The robot's raw observations of the control steps just before this one, oldest first (for a
    # model that conditions on several consecutive observations: Status.history_length > 1).
    history: tuple[dict, ...] = ()
    refreshes_seq_id: int | None = None  # re-fetch: the waiting request this capture refreshes
    # A multi-model task (client/pipeline.py): the components asked, and System 1's task string now.
    component_mask: int | None = None
    task: str | None = None


class Outbox:
    """Newest-only hand-over from the control loop to the publisher thread.

    `put` is one `SimpleQueue.put` (C code, no Python-level lock or condition): it is the only cost
    the control loop pays per observation, 24 us median vs 67 us for a Condition-based slot on the
    2-core development VM. `take` drains the queue and keeps the newest item; older ones count as
    dropped.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.dropped = 0  # written by the taking thread only

    def put(self, item: Capture) -> None:
        self._queue.put(item)

    def take(self, timeout_s: float) -> Capture | None:
        try:
            item = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None
        while True:
            try:
                newer = self._queue.get_nowait()
            except queue.Empty:
                return item
            if newer is None:  # a wake-up, not an observation
                continue
            if item is not None:
                self.dropped += 1
            item = newer

    def wake(self) -> None:
        """Unblock a waiting `take` (it returns None)."""
        self._queue.put(None)


def as_jpeg(frame, quality: int) -> bytes:
    """A camera's frame as JPEG: an image array encoded, or a JPEG the robot already gave (bytes, e.g.
    a ROS 2 CompressedImage whose size the robot checked) passed through without re-encoding."""
    if isinstance(frame, bytes):
        return frame
    return codec.encode_jpeg(np.asarray(frame), quality)


class ObservationPublisher:
    """Encodes and puts what the outbox holds, on its own thread (`run` until `stop` is set).

    Args:
        publisher: where observations go (``put(payload, attachment=...)``).
        route: where an observation asking components (`Capture.component_mask`) goes instead: the
            publisher of its key on a multi-model task's stream (one per mask, `Task.observation_route`).
        outbox: the hand-over from the control loop.
        features: the robot's cameras and state names.
        client_uuid, task_text, jpeg_quality: labels and encoding (the client's config).
        counters: published / same-host / errors are counted here.
        same_host_active: a callable saying whether raw frames through /dev/shm are in use now
            (the server watch decides from the server's status).
        on_same_host_failed: called once when shared memory fails here (JPEG from then on).
    """

    def __init__(self, publisher, outbox: Outbox, features: RobotFeatures, *, client_uuid: str, task_text: str,
                 jpeg_quality: int, counters: ClientCounters, same_host_active: Callable[[], bool] = lambda: False,
                 on_same_host_failed: Callable[[], None] = lambda: None,
                 route: Callable[[int], object] | None = None, refusals: bool = False) -> None:
        self.publisher = publisher
        self.refusals = refusals  # the observations say this client reads Refusals (protocol 1.5)
        self._route = route
        self.outbox = outbox
        self.features = features
        self.client_uuid = client_uuid
        self.task_text = task_text
        self.jpeg_quality = jpeg_quality
        self.counters = counters
        self._same_host_active = same_host_active
        self._on_same_host_failed = on_same_host_failed

    def run(self, stop: threading.Event) -> None:
        names = self.features
        quality = self.jpeg_quality
        cameras = list(names.cameras)
        # The first camera is encoded on this thread and the others at the same time on helper threads:
        # OpenCV releases the GIL while it converts and encodes, so with a free core two 480x640 cameras
        # cost one encode of wall time instead of two (docs/benchmarks.md).
        helpers = (ThreadPoolExecutor(max_workers=len(cameras) - 1, thread_name_prefix=f"{self.client_uuid}:jpeg")
                   if len(cameras) > 1 else None)

        def state_of(obs: dict) -> np.ndarray:
            return np.fromiter((obs[n] for n in names.state_names), dtype=np.float32, count=len(names.state_names))

        def encode_frame(obs: dict) -> tuple[np.ndarray, dict[str, bytes]]:
            others = [(cam, helpers.submit(as_jpeg, obs[cam], quality)) for cam in cameras[1:]]
            images = {cameras[0]: as_jpeg(obs[cameras[0]], quality)} if cameras else {}
            for cam, encoded in others:
                images[cam] = encoded.result()
            return state_of(obs), images

        ring: same_host.FrameRing | None = None  # this loop's shared-memory files, removed when it ends

        def shared_frame(obs: dict):
            """(state, {}, SharedFrames) through /dev/shm, or None when shared memory just failed."""
            nonlocal ring
            try:
                if ring is None:
                    ring = same_host.FrameRing()
                shared = ring.write({cam: np.asarray(obs[cam]) for cam in cameras})
            except OSError as exc:
                self._on_same_host_failed()
                log.warning("%s: shared memory failed (%s); sending JPEG over the network from now on",
                            self.client_uuid, exc)
                if ring is not None:
                    ring.close()
                    ring = None
                return None
            return state_of(obs), {}, shared

        try:
            while not stop.is_set():
                item = self.outbox.take(0.1)
                if item is None:
                    continue
                obs = item.observation
                try:
                    framed = shared_frame(obs) if self._same_host_active() and cameras else None
                    state, images, shared = framed or (*encode_frame(obs), None)
                    history = tuple(HistoryFrame(*encode_frame(past)) for past in item.history)
                    message = Observation(item.seq_id, self.client_uuid, state, images,
                                          self.task_text if item.task is None else item.task,
                                          item.execution, episode_id=item.episode_id,
                                          session_nonce=item.session_nonce, rtc=item.rtc, history=history,
                                          shared_frames=shared, refreshes_seq_id=item.refreshes_seq_id,
                                          component_mask=item.component_mask, refusals=self.refusals)
                    # The header lets the server rank it without decoding it (protocol.md §5.1.1).
                    publisher = (self.publisher if item.component_mask is None or self._route is None
                                 else self._route(item.component_mask))
                    publisher.put(codec.encode(message), attachment=codec.encode_observation_header(message))
                    self.counters.observations_published += 1
                    self.counters.observations_same_host += shared is not None
                except Exception as exc:  # one observation's failure must not end publishing for good
                    self.counters.publish_errors += 1
                    n = self.counters.publish_errors
                    if worth_logging(n):
                        log.warning("%s: could not publish observation %d (%s: %s) [%d so far]", self.client_uuid,
                                    item.seq_id, type(exc).__name__, exc, n)
        finally:
            if helpers is not None:
                helpers.shutdown(wait=True)
            if ring is not None:
                ring.close()
