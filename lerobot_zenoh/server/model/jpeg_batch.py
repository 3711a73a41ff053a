"""The JPEG frames of a whole batch, decoded at once: the server's one image decode.

The runner adapter hands `JpegBatchDecoder.decode` every JPEG frame set of the batch it prepares (each
request's cameras, and the history frames a model reads) and gets one result per set, in order:
the set's images, or the `ProtocolError` of its first bad frame (camera order).

    checks first   every frame's header is read and checked (`codec.check_jpeg`: bytes, a readable
                   frame header, the pixel limit, the camera's size: ``bad_jpeg``,
                   ``wrong_image_shape``) before any pixel of the batch is decoded; a set with a
                   bad header has none of its frames decoded
    on the CPU     every checked frame of the batch is decoded by libjpeg-turbo (`codec.decode_checked_jpeg`,
                   the codec's pixels bit for bit) on `threads` threads, the calling one included, each
                   taking the next frame: libjpeg-turbo releases the GIL, so frames of different requests
                   decode at the same time, not only the cameras of one request. A batch of fewer than
                   `PARALLEL_MIN_PIXELS` pixels decodes on the calling thread alone: handing frames to
                   other threads costs more than decoding them
    on a CUDA      (a model served with ``images_on_device: true``, `RunnerCapabilities.image_device`) the
    device         checked frames decode in one batched nvJPEG call (torchvision) straight into device
                   memory: uint8 (H, W, 3) tensors there. When that call fails (a frame nvJPEG cannot
                   read: progressive, CMYK, corrupt), the whole batch decodes on the CPU instead, so
                   each frame is served as libjpeg-turbo reads it or rejected with the CPU path's
                   reason; counted (`device_fallbacks`). The decode runs on a CUDA stream of this
                   decoder's own and is finished before its tensors are handed to the caller's stream,
                   so that nvJPEG cannot write into memory another model's (or this model's) queued
                   kernels still read (runners/device_images.py, "Stream order"). nvJPEG's pixels are
                   not libjpeg-turbo's bit for bit, and this path has not been run on a GPU yet
                   (docs/policies.md, "Images on the device").

Runs on the thread that prepares a batch (the inference thread); holds no lock.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.telemetry.publisher import worth_logging

log = logging.getLogger(__name__)

#: Pixels a batch needs before its frames are decoded on several threads. Measured side by side on
#: 2 cores (`benchmarks/studies/jpeg_batch.py`): at 2 x 96x128 one thread took half the time of two,
#: at 2 x 224x224 (100,352 pixels) they were even, from 3 x 224x224 (150,528) two threads were faster.
PARALLEL_MIN_PIXELS = 120_000

#: One frame set: camera name -> its JPEG bytes (or a memoryview of them).
Frames = Mapping[str, Any]
#: One checked frame: (set index, camera, data, height, width).
_Job = tuple[int, str, Any, int, int]


class JpegBatchDecoder:
    """Decodes a batch's JPEG frame sets; see the module docstring.

    `threads`: at most how many threads decode a batch on the CPU (the caller and helpers), and never
    more than the cores this process may use; the runner adapter gives it the model's camera count.
    `device`: a CUDA device (``"cuda:0"``) to decode on, or None for the CPU.
    """

    def __init__(self, *, threads: int = 1, device: str | None = None, limits: codec.CodecLimits = codec.DEFAULT_LIMITS):
        self.threads = max(1, min(int(threads), _usable_cores()))
        self.device = device
        self.limits = limits
        self.device_fallbacks = 0  # batches nvJPEG could not decode, decoded on the CPU instead
        self._stream: Any = None  # the CUDA stream this decoder decodes on, made at its first device decode
        self._pool = (ThreadPoolExecutor(max_workers=self.threads - 1, thread_name_prefix="jpeg")
                      if self.threads > 1 else None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def decode(self, sets: Sequence[Frames], shapes: Mapping[str, tuple[int, int]]) -> list[dict[str, Any] | ProtocolError]:
        """One result per set of `sets`, in order: ``{camera: image}`` (cameras in `shapes`' order;
        uint8 (H, W, 3), numpy on the CPU, a tensor on the device), or the ProtocolError of its first
        bad frame. `shapes`: each camera's (height, width); every camera of a set must be in it."""
        results: list[dict[str, Any] | ProtocolError] = []
        jobs: list[_Job] = []
        for i, frames in enumerate(sets):
            try:
                checked = [(i, name, frames[name], *codec.check_jpeg(frames[name], shape, self.limits))
                           for name, shape in shapes.items() if name in frames]
            except ProtocolError as exc:
                results.append(exc)
                continue
            results.append({})
            jobs.extend(checked)
        if not jobs:
            return results
        pixels = self._on_device(jobs) if self.device is not None else self._on_cpu(jobs)
        for (i, name, *_), image in zip(jobs, pixels, strict=True):
            out = results[i]
            if isinstance(out, ProtocolError):
                continue  # an earlier camera of the set failed: that is its reason
            if isinstance(image, ProtocolError):
                results[i] = image
            else:
                out[name] = image
        return results

    def _on_cpu(self, jobs: Sequence[_Job]) -> list[Any]:
        out: list[Any] = [None] * len(jobs)
        # One iterator shared by the threads: each takes the next frame (next() on a range
        # iterator is atomic under the GIL), so a slow frame never holds the others back.
        todo = iter(range(len(jobs)))

        def work() -> None:
            for k in todo:
                _, _, data, height, width = jobs[k]
                try:
                    out[k] = codec.decode_checked_jpeg(data, height, width)
                except ProtocolError as exc:
                    out[k] = exc

        pixels = sum(height * width for *_, height, width in jobs)
        threads = min(self.threads, len(jobs)) if pixels >= PARALLEL_MIN_PIXELS else 1
        helpers = [self._pool.submit(work) for _ in range(threads - 1)] if self._pool is not None else []
        work()
        for helper in helpers:
            helper.result()
        return out

    def _on_device(self, jobs: Sequence[_Job]) -> list[Any]:
        from lerobot_zenoh.server.runners.device_images import decode_on_device, decode_stream

        if self._stream is None:
            self._stream = decode_stream(self.device)
        try:
            images = decode_on_device([data for _, _, data, _, _ in jobs], self.device, self._stream)
        except (RuntimeError, ValueError) as exc:  # nvJPEG refused a frame; torchvision reports no partial result
            self.device_fallbacks += 1
            if worth_logging(self.device_fallbacks):
                log.warning("nvJPEG could not decode a batch of %d frames (%s); decoded on the CPU [%d so far]",
                            len(jobs), exc, self.device_fallbacks)
            return self._on_cpu(jobs)
        return [image if tuple(image.shape[:2]) == (height, width)
                else ProtocolError(Reason.BAD_JPEG, "decoded size differs from the frame header")
                for image, (_, _, _, height, width) in zip(images, jobs, strict=True)]


def _usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
