"""What a served model is loaded from, checked once for every document that names one.

A model is served from exactly one source: `pretrained_path` (a LeRobot checkpoint folder or a hub id
`user/repo[@revision]`, resolved when the server starts: server/runners/hub.py) or `synthetic` (a torch-free policy
with a set latency). The blocks that change what a checkpoint is read as need a checkpoint and exclude each
other: `vlm` (a transformers VLM folder), `language` (a pi0.5 answering text too), `decode` (pi0-FAST's
continuous batching), `images_on_device` (a LeRobot checkpoint's frames decoded on the GPU).

Two documents name a model's source: the server manifest's entry (server/config/manifest.py, `ModelEntry`) and
the fleet planner's factory descriptor (pipelines/descriptor.py, `ServedModel`), which becomes such an
entry. Both call :func:`check_model_source`, so a source one accepts the other accepts too. The rules look
only at which fields are given; what each block holds is checked by its own settings class. It imports
nothing of ours (pipelines/ and server/ both sit above it).
"""

from __future__ import annotations


def check_model_source(pretrained_path: str | None, synthetic: object | None, *, vlm: object | None = None,
                       language: object | None = None, decode: object | None = None,
                       images_on_device: bool = False) -> None:
    """Raise ValueError (a pydantic validator's error) naming the first rule the given fields break."""
    if (pretrained_path is None) == (synthetic is None):
        raise ValueError("give exactly one of pretrained_path or synthetic")
    if vlm is not None and pretrained_path is None:
        raise ValueError("vlm needs pretrained_path (the VLM's folder)")
    if language is not None and (pretrained_path is None or vlm is not None):
        raise ValueError("language needs pretrained_path (a pi05 checkpoint) and no vlm")
    if decode is not None and (pretrained_path is None or vlm is not None or language):
        raise ValueError("decode needs pretrained_path (a pi0_fast checkpoint), no vlm and no language")
    if images_on_device and (pretrained_path is None or vlm is not None):
        raise ValueError("images_on_device needs pretrained_path (a LeRobot checkpoint) and no vlm")
