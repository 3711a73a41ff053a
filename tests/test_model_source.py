"""A model's source (lerobot_zenoh/model_source.py) is checked once: the server manifest's entry and the
fleet planner's factory descriptor accept and refuse the same sources, with the same words."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.model_source import check_model_source
from lerobot_zenoh.pipelines.descriptor import PipelineModel
from lerobot_zenoh.server.config.manifest import parse_manifest

pytestmark = pytest.mark.core

SYNTHETIC = {"state_dim": 2, "action_dim": 2, "chunk_size": 4, "cameras": {}}
VLM = {"output": "text"}
LANGUAGE = {"max_new_tokens": 8}
EXACTLY_ONE = "give exactly one of pretrained_path or synthetic"

# (the model's source fields, None when accepted or the words of the refusal)
SOURCES = [
    ({"pretrained_path": "checkpoints/demo_act"}, None),
    ({"pretrained_path": "/abs/checkpoint"}, None),
    ({"pretrained_path": "lerobot/smolvla_base"}, None),
    ({"pretrained_path": "lerobot/smolvla_base@main"}, None),
    ({"synthetic": SYNTHETIC}, None),
    ({"pretrained_path": "vlm_folder", "vlm": VLM}, None),
    ({"pretrained_path": "lerobot/pi05_base", "language": LANGUAGE}, None),
    ({"pretrained_path": "lerobot/pi05_base", "tokenizer_path": "tokenizers/paligemma"}, None),
    ({}, EXACTLY_ONE),
    ({"pretrained_path": "x", "synthetic": SYNTHETIC}, EXACTLY_ONE),
    ({"synthetic": SYNTHETIC, "vlm": VLM}, "vlm needs pretrained_path (the VLM's folder)"),
    ({"synthetic": SYNTHETIC, "language": LANGUAGE}, "language needs pretrained_path (a pi05 checkpoint) and no vlm"),
    ({"pretrained_path": "x", "vlm": VLM, "language": LANGUAGE},
     "language needs pretrained_path (a pi05 checkpoint) and no vlm"),
]


def _manifest_refusal(fields: dict) -> str | None:
    entry = {"model_id": "m", "model_version": "v", "application_tag": "a", "accept_unknown_clients": True, **fields}
    try:
        parse_manifest({"cluster_uuid": "c", "experiment_tag": "e", "server": [entry]})
    except ConfigError as exc:
        return str(exc)
    return None


def _descriptor_refusal(fields: dict) -> str | None:
    try:
        PipelineModel.model_validate({"model_id": "m", **fields})
    except ValidationError as exc:
        return str(exc.errors()[0]["msg"])
    return None


@pytest.mark.parametrize("fields,refusal", SOURCES, ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_the_manifest_and_the_descriptor_accept_and_refuse_the_same_sources(fields, refusal):
    by_manifest, by_descriptor = _manifest_refusal(fields), _descriptor_refusal(fields)
    if refusal is None:
        assert by_manifest is None and by_descriptor is None
    else:
        assert by_manifest is not None and refusal in by_manifest
        assert by_descriptor is not None and refusal in by_descriptor


@pytest.mark.parametrize("fields,refusal", [
    ({"pretrained_path": "lerobot/pi0fast_base", "decode": {}}, None),
    ({"synthetic": SYNTHETIC, "decode": {}}, "decode needs pretrained_path"),
    ({"pretrained_path": "x", "vlm": VLM, "decode": {}}, "decode needs pretrained_path"),
    ({"pretrained_path": "x", "images_on_device": True, "device": "cuda"}, None),
    ({"pretrained_path": "x", "vlm": VLM, "images_on_device": True, "device": "cuda"},
     "images_on_device needs pretrained_path"),
])
def test_the_manifest_only_blocks_follow_the_same_rules(fields, refusal):
    """`decode` and `images_on_device` exist only in the manifest (a factory descriptor refuses them as
    unknown fields); their rules are the same function's."""
    by_manifest = _manifest_refusal(fields)
    assert (by_manifest is None) if refusal is None else (refusal in by_manifest)
    try:
        check_model_source(fields.get("pretrained_path"), fields.get("synthetic"), vlm=fields.get("vlm"),
                           decode=fields.get("decode"), images_on_device=fields.get("images_on_device", False))
    except ValueError as exc:
        assert refusal is not None and refusal in str(exc)
    else:
        assert refusal is None
    assert _descriptor_refusal(fields) is not None
