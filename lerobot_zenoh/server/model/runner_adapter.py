"""The runner adapter of one model, between the wire and its `PolicyRunner`: turns a batch the session
table picked into encoded answers. (Not an engine executor: every executor of this process calls it.)

    decode(payload, header)           the observation's body (the server's only msgpack decode of one),
                                      checked against the header admission read (`header_mismatch`)
    prepare_batch(items)              check each picked observation against the model's spec, decode
                                      the JPEG frames of all of them at once (server/model/jpeg_batch.py: every
                                      header checked first; on the CPU, frames of every request on
                                      parallel threads; on the model's CUDA device with
                                      `images_on_device`) or take views of their same-host frames (no
                                      copy, transport/same_host.py), build each runner request (with the
                                      observation's real-time-chunking inputs in its extras when the
                                      runner takes them), let the runner refuse it (`check_request`,
                                      e.g. task_too_long); `prepare(session_id, observation)`: the
                                      same for one observation
    infer(requests)                   one `runner.run` call for the whole batch; if it fails, each
                                      request again on its own so that only the bad one fails; a
                                      request whose same-host frames were rewritten while the model
                                      read them gets ProtocolError(Reason.SHM_STALE) instead of its result
    stream(first, join, emit)         for an iteration-level runner (pi0-FAST): requests join its running
                                      batch between decode steps and each result is emitted when done
    chunk(observation, result, ...)   cut to actions_per_chunk, execution horizon, ActionChunk bytes
    answer(observation, result, ...)  the bytes of what the runner's `capabilities.output` says it
                                      answers: an ActionChunk (`chunk`), a TextResult or a Verdict

Runs on the inference thread (and a model with engines: its local engine's thread, `server/dispatch/dispatcher.py`)
and holds no lock: the session table's bookkeeping is its callers' job (`server/engine/admission.py`).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from lerobot_zenoh.errors import PolicyError, ProtocolError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import (
    VERDICT_LABELS,
    ActionChunk,
    Observation,
    ObservationHeader,
    RtcInputs,
    TextResult,
    Verdict,
)
from lerobot_zenoh.protocol.reasons import OutputKind, Reason
from lerobot_zenoh.scheduling.horizon import HorizonPolicy
from lerobot_zenoh.server.model.jpeg_batch import JpegBatchDecoder
from lerobot_zenoh.server.runners.base import (
    RTC_EXTRA,
    RTC_EXTRA_DELAY,
    InferenceRequest,
    InferenceResult,
    PolicyRunner,
)
from lerobot_zenoh.telemetry.publisher import worth_logging
from lerobot_zenoh.transport import same_host

log = logging.getLogger(__name__)


def request_seed(client_id: str, seq_id: int) -> int:
    """The sampling seed of one request: a function of who asked and which observation, nothing else."""
    return (zlib.crc32(client_id.encode()) << 32) ^ (seq_id & 0xFFFFFFFF)


@dataclass(frozen=True)
class _Checked:
    """An observation that passed the checks made before its JPEG frames are decoded."""

    obs: Observation
    state: np.ndarray  # float32
    images: dict[str, np.ndarray]  # same-host frames: views of the client's ring
    history_frames: tuple  # the `HistoryFrame`s the model reads, oldest first
    history_states: tuple[np.ndarray, ...]  # their states, float32


class RunnerAdapter:
    def __init__(self, name: str, runner: PolicyRunner, *, actions_per_chunk: int, server_id: str,
                 horizon: HorizonPolicy | None = None, limits: codec.CodecLimits = codec.DEFAULT_LIMITS):
        self.name = name
        self.runner = runner
        self.spec = runner.spec
        self.actions_per_chunk = actions_per_chunk
        self.server_id = server_id
        self.horizon = horizon
        self.limits = limits
        # Refinement updates are captured only when the horizon policy reads them and the runner
        # reports them; otherwise the policy gets none (diffusion_confidence then vouches for the
        # whole chunk, with a warning at start-up).
        wants = horizon is not None and horizon.needs_updates
        self.capture_updates = wants and self.spec.capabilities.refinement_updates
        if wants and not self.capture_updates:
            log.warning("%s: %s reports no refinement updates; horizon %s will send the whole chunk",
                        name, self.spec.policy_type, horizon.name)
        elif horizon is not None:
            log.info("%s: execution horizon %r", name, horizon)  # shows the threshold a default picked
        # (engine_id, tier) written on every chunk this adapter runs itself, when its model
        # dispatches to several engines (server/dispatch/dispatcher.py); None: a server with one engine.
        self.served_by: tuple[str, str] | None = None
        self.batch_fallbacks = 0  # batches that failed and were served one request at a time
        # A batch's JPEG frames decode at once, on as many threads as the model has cameras (the
        # calling one included), or on the runner's CUDA device when it takes its images there.
        self._jpeg = JpegBatchDecoder(threads=len(self.spec.cameras), device=self.spec.capabilities.image_device,
                                      limits=limits)
        self._frames = same_host.FrameReader()  # same-host rings, mapped once each
        self._shared: dict[int, object] = {}  # id(request) -> its SharedFrames, until `infer` checks them

    @property
    def jpeg_device_fallbacks(self) -> int:
        """Batches whose JPEG frames nvJPEG could not decode, decoded on the CPU instead (telemetry)."""
        return self._jpeg.device_fallbacks

    @property
    def shared_memory_figures(self) -> dict[str, int]:
        """Same-host rings mapped now and in all, and files of dead clients removed (telemetry)."""
        return {"shm_rings_mapped": len(self._frames), "shm_rings_opened": self._frames.mapped_total,
                "shm_orphans_removed": self._frames.orphans_removed}

    def close(self) -> None:
        self._jpeg.close()
        self._frames.close()

    def decode(self, payload: bytes, header: ObservationHeader | None = None) -> Observation:
        """The observation in `payload` (the one copy out of Zenoh's buffer); ProtocolError if it is
        malformed, or (`header_mismatch`) if it is not what its header, read at admission, said."""
        obs = codec.decode_observation(bytes(payload), self.limits)
        if header is not None and not codec.header_matches(header, obs):
            raise ProtocolError(Reason.HEADER_MISMATCH, f"the header says seq_id {header.seq_id}, episode "
                                f"{header.episode_id!r}; the observation {obs.seq_id}, {obs.episode_id!r}")
        return obs

    def prepare(self, client_id: str, obs: Observation, extras: dict | None = None) -> InferenceRequest:
        """One observation's request (`prepare_batch` of one); ProtocolError if it cannot be served."""
        (request,) = self.prepare_batch([(client_id, obs, extras)])
        if isinstance(request, ProtocolError):
            raise request
        return request

    def prepare_batch(self, items: Sequence[tuple[str, Observation, dict | None]]
                      ) -> list[InferenceRequest | ProtocolError]:
        """Check each (client id, observation, extras) against the model's features, decode the JPEG
        frames of all of them at once, build each runner request: one result per item, in order, the
        request or the ProtocolError that refuses it (one bad observation never costs the others).

        `extras`: what the caller adds to the request's extras (a multi-model task's query,
        `server/model/routing.py`), there before the runner checks the request. Per observation, the first
        failing check gives the reason: the client id, the state, the camera names, its same-host
        frames, its history frames' states and cameras; then its JPEG frame headers (size, pixel
        limit: every header of the batch is read before any pixel is decoded), then their pixels;
        then its RTC inputs and the runner's own check (`check_request`, e.g. task_too_long).
        """
        checked: list[_Checked | ProtocolError] = []
        for client_id, obs, _ in items:
            try:
                checked.append(self._check(client_id, obs))
            except ProtocolError as exc:
                checked.append(exc)
        # One decode for the whole batch (server/model/jpeg_batch.py): each observation's cameras, then its
        # history frames, in that order: the first bad one gives the observation's reason.
        sets, owners = [], []
        for k, c in enumerate(checked):
            if not isinstance(c, ProtocolError):
                for frames in (c.obs.images, *(frame.images for frame in c.history_frames)):
                    sets.append(frames)  # an empty one (every camera same-host) decodes to {}
                    owners.append(k)
        decoded: dict[int, list] = {}
        for k, images in zip(owners, self._jpeg.decode(sets, self.spec.cameras), strict=True):
            decoded.setdefault(k, []).append(images)
        out: list[InferenceRequest | ProtocolError] = []
        for k, (c, (client_id, obs, extras)) in enumerate(zip(checked, items, strict=True)):
            if not isinstance(c, ProtocolError):
                try:
                    c = self._request(client_id, c, decoded[k], extras)
                except ProtocolError as exc:
                    c = exc
            out.append(c)
        return out

    def _check(self, client_id: str, obs: Observation) -> _Checked:
        """What can be checked of `obs` before its JPEG frames are decoded (ProtocolError otherwise);
        its same-host frames read (views of the client's ring)."""
        spec = self.spec
        if obs.client_uuid != client_id:
            raise ProtocolError(Reason.CLIENT_MISMATCH, f"client_uuid {obs.client_uuid!r} published on {client_id!r}'s key")
        if obs.state.shape != (spec.state_dim,):
            raise ProtocolError(Reason.WRONG_STATE_DIM, f"state has shape {obs.state.shape}, expected ({spec.state_dim},)")
        state = obs.state.astype(np.float32)
        if not np.all(np.isfinite(state)):
            raise ProtocolError(Reason.BAD_STATE, "state has NaN or infinite values")
        shared = obs.shared_frames
        sent = [*obs.images, *(shared.frames if shared is not None else ())]
        if len(sent) != len(set(sent)) or set(sent) != set(spec.cameras):
            raise ProtocolError(Reason.WRONG_CAMERAS, f"cameras {sorted(sent)}, expected {sorted(spec.cameras)}")
        # Same-host frames are read in place: read-only views of the client's ring, mapped once per
        # client (transport/same_host.py), checked again in `infer` after the model has read them.
        images = self._frames.read(shared, {c: spec.cameras[c] for c in shared.frames}) if shared is not None else {}
        # A model conditioning on n > 1 steps reads the client's last n - 1 frames (older ones and
        # any sent to a model without history are ignored, undecoded).
        wanted = spec.capabilities.history_length - 1
        frames = tuple(obs.history[-wanted:]) if wanted > 0 else ()
        history_states = []
        for frame in frames:
            if frame.state.shape != (spec.state_dim,):
                raise ProtocolError(Reason.BAD_HISTORY, f"history frame state has shape {frame.state.shape}, "
                                                   f"expected ({spec.state_dim},)")
            past = frame.state.astype(np.float32)
            if not np.all(np.isfinite(past)):
                raise ProtocolError(Reason.BAD_HISTORY, "a history frame's state has NaN or infinite values")
            if set(frame.images) != set(spec.cameras):
                raise ProtocolError(Reason.BAD_HISTORY, f"history frame cameras {sorted(frame.images)}, "
                                                   f"expected {sorted(spec.cameras)}")
            history_states.append(past)
        return _Checked(obs, state, images, frames, tuple(history_states))

    def _request(self, client_id: str, c: _Checked, decoded: list, extras: dict | None) -> InferenceRequest:
        """The runner's request of a checked observation whose JPEG frame sets were decoded
        (`decoded`: its cameras', then each history frame's: results of `JpegBatchDecoder.decode`)."""
        for result in decoded:
            if isinstance(result, ProtocolError):
                raise result
        obs, spec = c.obs, self.spec
        images = c.images | decoded[0]
        images = {camera: images[camera] for camera in spec.cameras}
        history = tuple(zip(c.history_states, decoded[1:], strict=True))
        rtc = self._rtc(obs)
        extras = dict(extras or {})
        if rtc is not None:
            extras[RTC_EXTRA] = rtc
        request = InferenceRequest(session_id=client_id, state=c.state, images=images, task=obs.task,
                                   seed=request_seed(client_id, obs.seq_id), episode_id=obs.episode_id,
                                   history=history, extras=extras)
        self.runner.check_request(request)  # e.g. task_too_long, before it can fail a whole batch
        if obs.shared_frames is not None:
            self._shared[id(request)] = obs.shared_frames
        return request

    def _rtc(self, obs: Observation) -> RtcInputs | None:
        """The observation's RTC inputs as the runner takes them (float32), checked against the model.

        None when the runner takes none (a client should not send them then; they are ignored). The
        codec already checked finiteness and ``0 <= delay_steps <= rows``.
        """
        if obs.rtc is None or not self.spec.capabilities.rtc:
            return None
        prefix = obs.rtc.prefix
        if prefix.ndim != 2 or prefix.shape[1] != self.spec.action_dim:
            raise ProtocolError(Reason.BAD_RTC_PREFIX,
                                f"rtc.prefix has shape {prefix.shape}, expected (n, {self.spec.action_dim})")
        if len(prefix) > self.actions_per_chunk:
            raise ProtocolError(Reason.BAD_RTC_PREFIX,
                                f"rtc.prefix has {len(prefix)} rows, more than a chunk ({self.actions_per_chunk})")
        return RtcInputs(np.ascontiguousarray(prefix, dtype=np.float32), int(obs.rtc.delay_steps))

    def infer(self, requests: Sequence[InferenceRequest]) -> list[InferenceResult | Exception]:
        """One result per request: its result, or the exception its inference raised (ProtocolError
        ``shm_stale`` for a request whose same-host frames the client rewrote while the model read them)."""
        shared = [self._shared.get(id(r)) for r in requests]
        self._shared.clear()  # only this batch's requests were prepared since the last call
        results = self._infer(requests)
        for i, ref in enumerate(shared):
            if ref is not None and not isinstance(results[i], Exception) and not self._frames.current(ref):
                results[i] = ProtocolError(Reason.SHM_STALE, f"{ref.segment} was rewritten while the model read it "
                                                        "(the server was a ring's length of observations behind)")
        return results

    def stream(self, first: Sequence[tuple[object, InferenceRequest]],
               join: Callable[[], Sequence[tuple[object, InferenceRequest]]],
               emit: Callable[[object, InferenceResult | Exception], None]) -> None:
        """Iteration-level serving (`RunnerCapabilities.iteration_level`): the runner decodes `first`,
        takes what `join()` returns between its steps, and each request's result (or exception) goes
        to `emit(key, ...)` the step it is done, checked like `infer`'s (``shm_stale``)."""
        def checked(key: object, result: InferenceResult | Exception) -> None:
            ref = shared.pop(key, None)
            if ref is not None and not isinstance(result, Exception) and not self._frames.current(ref):
                result = ProtocolError(Reason.SHM_STALE, f"{ref.segment} was rewritten while the model read it")
            emit(key, result)

        def take(items: Sequence[tuple[object, InferenceRequest]]) -> list[tuple[object, InferenceRequest]]:
            for key, request in items:
                ref = self._shared.pop(id(request), None)
                if ref is not None:
                    shared[key] = ref
            return list(items)

        shared: dict[object, object] = {}
        self.runner.stream(take(first), lambda: take(join()), checked)

    def _infer(self, requests: Sequence[InferenceRequest]) -> list[InferenceResult | Exception]:
        if len(requests) > 1:
            try:
                results = self.runner.run(requests, capture_updates=self.capture_updates)
                if len(results) != len(requests):
                    raise PolicyError(f"run returned {len(results)} results for {len(requests)} requests")
                return list(results)
            except Exception as exc:
                self.batch_fallbacks += 1
                if worth_logging(self.batch_fallbacks):
                    log.warning("%s: batch of %d failed (%s: %s); serving it one request at a time [%d so far]",
                                self.name, len(requests), type(exc).__name__, exc, self.batch_fallbacks)
        out: list[InferenceResult | Exception] = []
        for request in requests:
            try:
                (result,) = self.runner.run([request], capture_updates=self.capture_updates)
                out.append(result)
            except Exception as exc:
                out.append(exc)
        return out

    def answer(self, obs: Observation, result: InferenceResult, inference_ms: float, queue_ms: float) -> bytes:
        """The encoded answer to `obs` of the kind the runner declares (`capabilities.output`);
        PolicyError if the result does not hold one."""
        output = self.spec.capabilities.output
        if output == OutputKind.TEXT:
            if not isinstance(result.text, str):
                raise PolicyError(f"a text runner returned text {type(result.text).__name__}, expected str")
            return codec.encode(TextResult(response_to_seq_id=obs.seq_id, text=result.text,
                                           inference_time_ms=inference_ms, server_id=self.server_id,
                                           queue_time_ms=queue_ms))
        if output == OutputKind.VERDICT:
            if result.label not in VERDICT_LABELS:
                raise PolicyError(f"a verdict runner returned label {result.label!r}, "
                                  f"expected one of {', '.join(sorted(VERDICT_LABELS))}")
            score = None if result.score is None else float(result.score)
            if score is not None and not 0.0 <= score <= 1.0:
                raise PolicyError(f"a verdict runner returned score {score}, expected 0..1")
            return codec.encode(Verdict(response_to_seq_id=obs.seq_id, label=result.label,
                                        inference_time_ms=inference_ms, score=score, server_id=self.server_id,
                                        queue_time_ms=queue_ms))
        return self.chunk(obs, result, inference_ms, queue_ms)

    def chunk(self, obs: Observation, result: InferenceResult, inference_ms: float, queue_ms: float,
              served_by: tuple[str, str] | None = None) -> bytes:
        """The encoded ActionChunk answering `obs`; ProtocolError/ValueError if the result is not a chunk.

        `served_by`: (engine_id, tier) of the engine that computed it (default: `self.served_by`)."""
        if result.actions is None:
            raise PolicyError("the runner returned no actions")
        actions = np.asarray(result.actions)
        if actions.ndim != 2 or actions.shape[1] != self.spec.action_dim:
            raise PolicyError(f"the runner returned actions of shape {actions.shape}, "
                              f"expected (chunk, {self.spec.action_dim})")
        actions = np.ascontiguousarray(actions[: self.actions_per_chunk], dtype=np.float32)
        horizon = None
        if self.horizon is not None:
            updates = result.refinement_updates
            sent = updates[:, : len(actions)] if updates is not None else None
            horizon = int(self.horizon.horizon(len(actions), sent))
        rtc_delay = None
        if obs.rtc is not None and self.spec.capabilities.rtc:  # the request carried it (prepare)
            rtc_delay = int(result.extras.get(RTC_EXTRA_DELAY, obs.rtc.delay_steps))
        return codec.encode(ActionChunk(
            response_to_seq_id=obs.seq_id,
            inference_time_ms=inference_ms,
            actions=actions,
            server_id=self.server_id,
            queue_time_ms=queue_ms,
            execution_horizon=horizon,
            rtc_delay_steps=rtc_delay,
            **(dict(zip(("engine_id", "tier"), by)) if (by := served_by or self.served_by) else {}),
        ))
