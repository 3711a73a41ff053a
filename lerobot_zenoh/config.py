"""How settings are declared and validated: one pydantic base for every block a manifest holds.

A `Settings` subclass is the one declaration of a concern's settings: field types, bounds, defaults
and cross-field rules, written once beside the code that uses them (a runner's config, a
scheduler's config). The server manifest (server/config/manifest.py) holds these very classes as its
blocks (`server[i].synthetic` is a `SyntheticPolicyConfig`, `server[i].scheduler`'s settings are
the scheduler's own config class), and code that builds one directly (a test, a benchmark) gets
the same checks. Either way a mistake is one `ConfigError` naming the field: ``<prefix>.<field>``
when built directly (``rtc.execution_horizon``), the full path inside a manifest
(``server.0.rtc.execution_horizon``; docs/server.md, "Manifest reference").

Command-line flags are the other system, and only one: draccus dataclasses (command_line.py).
`ZenohSettings` (transport/settings.py) is a plain dataclass both read, so the manifest's `zenoh:`
block and every `--zenoh.*` flag are one declaration too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.protocol.messages import VERDICT_LABELS


class Settings(BaseModel):
    """A frozen block of settings; unknown keys are errors (a typo never falls back to a default).

    `config_prefix` starts the field path of errors raised when the class is built directly
    (``RtcSettings(execution_horizon=0)`` -> ``rtc.execution_horizon: ...``). Inside a manifest the
    manifest's own path is used instead (pydantic validates nested blocks without calling
    ``__init__``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    config_prefix: ClassVar[str] = ""

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise config_error(exc, type(self).config_prefix) from None

    def replace(self, **changes: Any) -> Settings:
        """A copy with `changes`, validated as a new one is (pydantic's model_copy checks nothing)."""
        return type(self)(**{**{name: getattr(self, name) for name in type(self).model_fields}, **changes})

    # Not a custom __init__ for pydantic: nested blocks keep being validated by pydantic itself, so
    # their errors keep their full path (server.0.rtc.execution_horizon) instead of becoming ours.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @model_validator(mode="before")
    @classmethod
    def _bool_words(cls, data: Any) -> Any:
        """A manifest's bare yes/no/on/off on a yes-or-no field is the yes or no it says (strict
        fields too), as YAML 1.1 read it; on any other field it is the word written.

        The manifest is read with YAML 1.2's booleans (server/config/manifest.py, `read_yaml`: only true
        and false), so `compile: off` is the word off; those words arrive as `YamlBoolWord`s. A
        string given in Python ("yes") is not one: a strict field still refuses it."""
        if not isinstance(data, dict) or not any(isinstance(v, YamlBoolWord) for v in data.values()):
            return data
        fields = yes_no_fields(cls)
        return {name: (value.as_bool if name in fields else str(value)) if isinstance(value, YamlBoolWord) else value
                for name, value in data.items()}


class YamlBoolWord(str):
    """yes, no, on or off (any case) written bare in a manifest: a boolean in YAML 1.1, a word in
    YAML 1.2 (server/config/manifest.py reads YAML 1.2 and makes these words this class)."""

    __slots__ = ()

    @property
    def as_bool(self) -> bool:
        return self.lower() in ("yes", "on")


def yes_no_fields(cls: type[BaseModel]) -> frozenset[str]:
    """The fields of `cls` whose type takes a bool and no string (`bool`, `bool | None`)."""
    found = cls.__dict__.get("_yes_no_cache")
    if found is None:
        found = frozenset(name for name, info in cls.model_fields.items()
                          if bool in (kinds := _leaf_types(info.annotation)) and str not in kinds)
        setattr(cls, "_yes_no_cache", found)
    return found


def _leaf_types(annotation: Any) -> set:
    """The plain types a field annotation can hold (unions and Annotated unwrapped, a Literal's
    values by their type)."""
    import typing

    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _leaf_types(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return {type(v) for v in typing.get_args(annotation)}
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        return set().union(*(_leaf_types(a) for a in typing.get_args(annotation)))
    if isinstance(annotation, type) and issubclass(annotation, str):  # a StrEnum, say
        return {str}
    return {annotation}


def config_error(exc: ValidationError, prefix: str = "", *, source: str | None = None) -> ConfigError:
    """The first error of a pydantic validation as one `ConfigError` naming the field (``prefix.loc``),
    with a count of the others."""
    err = exc.errors()[0]
    parts, message = list(err["loc"]), err["msg"].removeprefix("Value error, ")
    if parts and parts[-1] == "[key]":  # a bad key of a mapping: {0: 10.0} -> batch_latency_ms.0
        parts.pop()
        message = f"the key: {message}"
    field = ".".join(p for p in (prefix, ".".join(str(p) for p in parts)) if p) or "<top level>"
    if err["type"] == "unexpected_keyword_argument":  # an unknown key of a dataclass block (zenoh)
        message = "Extra inputs are not permitted"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return ConfigError(field, message + more, source=source)


# -- a block that picks a type, with that type's own settings ----------------------------------------


class TypedBlock(Settings):
    """A block written ``{type: <name>, <that type's settings>}``, or as the name alone (its defaults).

    A subclass says which types exist (`types()`: name -> the type's `Settings` class, e.g. the
    scheduler registry's config classes) and which is the default. The other keys are validated by
    the chosen type's class and kept as an instance of it in `settings`; dumped, the block is flat
    again. Errors: an unknown type on ``<block>.type`` (on the block when written as a name), a bad or
    unknown setting on its key, a setting of another type on the block.
    """

    kind: ClassVar[str] = "type"  # what a type is called in messages ("scheduler", "horizon")
    default_type: ClassVar[str]

    type: str
    settings: SerializeAsAny[Settings]

    @classmethod
    def types(cls) -> Mapping[str, type[Settings]]:
        raise NotImplementedError

    @model_validator(mode="wrap")
    @classmethod
    def _by_type(cls, data, handler):
        if isinstance(data, cls):
            return data
        named = isinstance(data, str)
        if named:
            data = {"type": data}
        if not isinstance(data, dict):
            raise ValueError(f"a {cls.kind} name or a mapping {{type: ..., <settings>}}, got {data!r}")
        settings = dict(data)
        name = settings.pop("type", cls.default_type)
        types = cls.types()
        if name not in types:
            if named:
                raise ValueError(cls._unknown(name))
            return handler({"type": name})  # reported on `type`
        misplaced = misplaced_settings(name, settings, types, cls.kind)
        if misplaced:
            raise ValueError(misplaced)
        return handler({"type": name, "settings": types[name].model_validate(settings)})

    @field_validator("type")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in cls.types():
            raise ValueError(cls._unknown(v))
        return v

    @model_serializer(mode="wrap")
    def _flat(self, handler):
        data = handler(self)
        return {"type": data["type"], **data["settings"]}

    @classmethod
    def _unknown(cls, name) -> str:
        return f"unknown {cls.kind} {name!r}; choose one of {', '.join(sorted(cls.types()))}"


def misplaced_settings(name: str, settings: Mapping[str, Any], types: Mapping[str, type[Settings]],
                       kind: str = "type") -> str | None:
    """Why `settings` cannot go with type `name` because they are another type's (e.g. `buckets` on
    scheduler fifo), or None. A key no type takes is left to the type's class (named on the key)."""
    own = set(types[name].model_fields)
    others = {f for cls in types.values() for f in cls.model_fields}
    wrong = sorted(k for k in settings if k not in own and k in others)
    if not wrong:
        return None
    return f"{', '.join(wrong)} does not apply to {kind} {name!r} (its settings: {', '.join(sorted(own)) or 'none'})"


# -- value types several blocks share -------------------------------------------------------------


def verdict_labels(labels, *, distinct: bool = True):
    """`labels` if each is a verdict label (protocol/messages.py, VERDICT_LABELS) and, with
    `distinct`, none comes twice; else ValueError naming the first bad one (reported on the list)."""
    for label in labels:
        if label not in VERDICT_LABELS:
            raise ValueError(f"{label!r} is not a verdict label ({', '.join(sorted(VERDICT_LABELS))})")
    if distinct and len(labels) != len(set(labels)):
        raise ValueError(f"duplicate labels in {list(labels)}")
    return labels


def _request_labels(by_request: dict[int, str]) -> dict[int, str]:
    for k in by_request:
        if k < 1:
            raise ValueError(f"request numbers start at 1, got {k}")
    verdict_labels(list(by_request.values()), distinct=False)
    return by_request


#: A component's label set: verdict labels, each once.
VerdictLabels = Annotated[tuple[str, ...], AfterValidator(verdict_labels)]
#: A script of verdicts: one label per step, repeats allowed.
VerdictSequence = Annotated[tuple[str, ...], AfterValidator(lambda v: verdict_labels(v, distinct=False))]
#: Single verdicts by request number (1-based).
VerdictsByRequest = Annotated[dict[int, str], AfterValidator(_request_labels)]
