"""Camera frames onto a CUDA device: JPEG decode there (nvJPEG) and pinned, non-blocking copies.

Only for a LeRobot model served with ``images_on_device: true`` on a CUDA device (`LoadOptions`,
`RunnerCapabilities.image_device`); every other model takes LeRobot's rollout path unchanged
(``prepare_observation_for_inference``: each frame made float32 on the CPU, then copied).

    decode_stream(device)              the private CUDA stream a decoder decodes on (one per model)
    decode_on_device(frames, device,   JPEG bytes -> uint8 (H, W, 3) tensors on the device, one batched
        stream)                        nvJPEG call (torchvision) on that stream, finished before the
                                       tensors are handed to the caller's stream (see "Stream order");
                                       the server's batch decoder calls it (server/model/jpeg_batch.py) and
                                       falls back to the CPU when it raises
    observation_tensors(spec, states,  LeRobot's ``prepare_observation_for_inference`` tensors for B
        images, device)                observations at once: frames already on the device are taken
                                       where they are; frames in host memory (same-host frames, frames
                                       the CPU decoded) are copied as uint8 into one pinned staging
                                       buffer per camera and sent with one non-blocking copy; then made
                                       float32 in [0, 1] on the device

The values equal LeRobot's path (tested on the CPU): the conversion is elementwise, and the division
by 255 is by a tensor on the device, so that CUDA divides element by element as the CPU does (with a
Python number CUDA multiplies by its reciprocal, which can differ in the last bit). nvJPEG's pixels,
though, are not libjpeg-turbo's bit for bit. Not run on a GPU yet: no figure of this path is measured.

Stream order (two models on one GPU, or a model and its own queued kernels). torchvision 0.26's CUDA
``decode_jpeg`` allocates its output tensors through torch's caching allocator *on the stream current
at the call*, then decodes on a stream of torch's pool and makes the current stream wait for it. The
caching allocator hands out a block as soon as it was freed on the same stream, because later work on
that stream is ordered after the earlier readers; but nvJPEG's hardware (batched) decoder writes into
the block when the call is made, without waiting for the stream's queued work (pytorch/vision#9606;
meta-pytorch/torchcodec#1634: device-side waits do not gate the write, a host wait does). Decoding with
the inference thread's stream current could therefore overwrite a tensor that kernels already queued on
that stream (this model's, or another model's sharing the default stream) are still to read. So:

- the decode runs with a private stream of this decoder current (`decode_stream`): its outputs come from
  blocks only this decoder's stream frees, never from a block the models' streams still read;
- each output is marked as used by the caller's stream (``record_stream``): when the model frees it,
  the allocator gives the block back to the decoder only once an event recorded on the caller's stream
  has completed, a check made on the host, so the next decode cannot write into pixels the model's
  queued kernels still read;
- the decode stream is synchronised (a host wait) before the tensors are handed over, so their pixels
  are complete whatever the hardware engine does with stream order; the inference thread waits for the
  decode anyway, as the model needs its pixels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lerobot_zenoh.server.runners.base import OBS_IMAGES_PREFIX, OBS_STATE_KEY, PolicySpec

if TYPE_CHECKING:
    import torch


def decode_stream(device: str) -> torch.cuda.Stream:
    """A new CUDA stream on `device` for one decoder's decodes (see "Stream order")."""
    import torch

    return torch.cuda.Stream(device=device)


def decode_on_device(frames: Sequence[Any], device: str, stream: torch.cuda.Stream) -> list[torch.Tensor]:
    """Each JPEG of `frames` (bytes-like, already checked by `codec.check_jpeg`) as RGB uint8 (H, W, 3)
    on `device` (views of the (3, H, W) tensors nvJPEG writes), decoded in one batched call on `stream`
    (`decode_stream`, the decoder's own) and complete when this returns; the caller's current stream
    may use them at once (see "Stream order" in the module docstring).
    Raises what torchvision raises (RuntimeError) when any frame cannot be decoded there: it returns
    no partial result."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    # torchvision reads the bytes from (unpinned) host tensors; a copy of each JPEG's few KB.
    data = [torch.frombuffer(bytearray(frame), dtype=torch.uint8) for frame in frames]
    caller = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):  # outputs allocated from this stream's blocks, not the caller's
        decoded = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    stream.synchronize()  # a host wait: the pixels are written before anyone reads them
    for chw in decoded:
        chw.record_stream(caller)  # freed later: not reused by a decode until the caller's reads are done
    return [chw.permute(1, 2, 0) for chw in decoded]


def observation_tensors(spec: PolicySpec, states: Sequence[np.ndarray], images: Sequence[Mapping[str, Any]],
                        device: torch.device) -> dict[str, torch.Tensor]:
    """``observation.state`` float32 ``(B, state_dim)`` and ``observation.images.<camera>`` float32
    ``(B, 3, H, W)`` in [0, 1] on `device`, in the order LeRobot's rollout path builds them (state,
    then the cameras in the spec's order): what ``prepare_observation_for_inference`` gives for each
    observation, concatenated. `images[i][camera]`: uint8 (H, W, 3), a numpy array or a tensor
    already on `device`."""
    import torch

    state = np.stack([np.asarray(s, dtype=np.float32) for s in states])
    out = {OBS_STATE_KEY: torch.from_numpy(state).to(device)}
    divisor = torch.full((), 255.0, dtype=torch.float32, device=device)  # see the module docstring
    for camera in spec.cameras:
        frames = [row[camera] for row in images]
        stacked = torch.stack(_on_device(frames, device))  # (B, H, W, 3) uint8
        out[f"{OBS_IMAGES_PREFIX}{camera}"] = (stacked.to(torch.float32) / divisor).permute(0, 3, 1, 2).contiguous()
    return out


def _on_device(frames: Sequence[Any], device: torch.device) -> list[torch.Tensor]:
    """`frames` as uint8 tensors on `device`, in order: host frames through one pinned staging buffer
    and one non-blocking copy (pinned only on CUDA), device frames as they are."""
    import torch

    host = [k for k, f in enumerate(frames) if isinstance(f, np.ndarray)]
    out = list(frames)
    if host:
        pinned = device.type == "cuda" and torch.cuda.is_available()
        staging = torch.empty((len(host), *frames[host[0]].shape), dtype=torch.uint8, pin_memory=pinned)
        view = staging.numpy()
        for row, k in enumerate(host):
            np.copyto(view[row], frames[k])
        # Freeing `staging` when this returns is safe: torch's pinned-memory allocator keeps the block
        # until the copy's event has completed. From pageable memory the copy would be synchronous.
        sent = staging.to(device, non_blocking=pinned)
        for row, k in enumerate(host):
            out[k] = sent[row]
    return out
