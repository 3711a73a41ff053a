"""Manifest words that YAML 1.1 reads as booleans (`compile: off`): read as the words written, on
every enum/Literal field of the manifest (found by walking its pydantic models, so a new field is
covered without touching this file), while yes-or-no fields keep taking yes/no/on/off."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, TypeAdapter

from lerobot_zenoh.config import TypedBlock, yes_no_fields
from lerobot_zenoh.server.config import manifest as manifest_module
from lerobot_zenoh.server.config.manifest import Manifest, parse_manifest, read_yaml

ROOT = Path(__file__).resolve().parents[1]


def _models(annotation, seen: set) -> None:
    """Every pydantic model reachable from `annotation` (nested blocks, lists and maps of them, and
    the types a TypedBlock picks from) into `seen`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if annotation in seen:
            return
        seen.add(annotation)
        if issubclass(annotation, TypedBlock) and annotation is not TypedBlock:
            for kind in annotation.types().values():
                _models(kind, seen)
        for info in annotation.model_fields.values():
            _models(info.annotation, seen)
        return
    for arg in typing.get_args(annotation):
        _models(arg, seen)


def _literals(annotation) -> list[str]:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return [v for v in typing.get_args(annotation) if isinstance(v, str)]
    if isinstance(annotation, type) and issubclass(annotation, str) and hasattr(annotation, "__members__"):
        return [m.value for m in annotation]  # a StrEnum
    return [v for arg in typing.get_args(annotation) for v in _literals(arg)]


def _fields():
    seen: set = set()
    _models(Manifest, seen)
    for model in sorted(seen, key=lambda m: m.__qualname__):
        for name, info in model.model_fields.items():
            yield model, name, info


WORD_FIELDS = [(m, n, i, w) for m, n, i in _fields() for w in _literals(i.annotation)]


def test_the_walk_finds_the_fields_a_user_meets():
    names = {(m.__name__, n) for m, n, _, _ in WORD_FIELDS}
    assert ("CompileSettings", "mode") in names and ("EngineEntry", "tier") in names
    assert any(w == "off" for *_, w in WORD_FIELDS)  # the word that started this


@pytest.mark.parametrize("model,name,info,word", WORD_FIELDS,
                         ids=[f"{m.__name__}.{n}={w}" for m, n, _, w in WORD_FIELDS])
def test_every_word_of_every_enum_field_arrives_as_written(model, name, info, word):
    value = read_yaml(f"{name}: {word}\n")[name]
    assert value == word and isinstance(value, str), value
    field_type = typing.Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
    assert TypeAdapter(field_type).validate_python(value) == word


def test_yes_no_fields_keep_taking_the_yaml_1_1_words():
    checked = 0
    for model, name, info in _fields():
        if name not in yes_no_fields(model):
            continue
        field_type = typing.Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
        for word, meaning in {"yes": True, "no": False, "on": True, "off": False, "true": True, "false": False}.items():
            for spelling in (word, word.capitalize(), word.upper()):
                data = model._bool_words(read_yaml(f"{name}: {spelling}\n"))
                assert TypeAdapter(field_type).validate_python(data[name]) is meaning, (model, name, spelling)
        checked += 1
    assert checked >= 5


MANIFEST = """
cluster_uuid: c
experiment_tag: e
zenoh: {multicast_scouting: off}
server:
  - model_id: m
    model_version: v1
    application_tag: a
    synthetic: {rtc: yes, state_dim: 6}
    compile: off
    accept_unknown_clients: on
"""


def test_a_yes_given_in_python_is_still_refused_by_a_strict_field():
    """Only a manifest's bare word is read as a boolean; a Python string stays a string."""
    from lerobot_zenoh.errors import ConfigError
    from lerobot_zenoh.server.runners.synthetic import SyntheticPolicyConfig

    assert SyntheticPolicyConfig.model_validate(read_yaml("rtc: yes")).rtc is True
    with pytest.raises(ConfigError, match="rtc"):
        SyntheticPolicyConfig(rtc="yes")


def test_a_manifest_written_with_off_and_yes_parses_as_meant():
    entry = parse_manifest(read_yaml(MANIFEST)).server[0]
    assert entry.compile.mode == "off" and entry.synthetic.rtc is True and entry.accept_unknown_clients is True
    for words in ("compile: {mode: off, fallback: eager}", "compile: 'off'", "compile: default"):
        entry = parse_manifest(read_yaml(MANIFEST.replace("compile: off", words))).server[0]
        assert entry.compile.mode in ("off", "default")


def test_the_manifest_reference_example_parses():
    example = manifest_module.__doc__.split("\n\n")[1]
    text = "\n".join(line[4:] for line in example.splitlines())
    data = read_yaml(text)
    data["server"][0].pop("pretrained_path")
    data["server"][0]["synthetic"] = {}
    entry = parse_manifest(data).server[0]
    assert entry.compile.mode == "off"


@pytest.mark.parametrize("doc", ["docs/server.md", "docs/policies.md"])
def test_the_docs_yaml_examples_read_without_a_boolean_where_a_word_is_meant(doc):
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / doc).read_text(), re.S)
    assert blocks
    words = {n for _, n, _, _ in WORD_FIELDS}

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                assert not (key in words and isinstance(value, bool)), (doc, key, value)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    for block in blocks:
        walk(read_yaml(block))
