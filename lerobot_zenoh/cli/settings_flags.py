"""Command-line flags generated from a pydantic `Settings` class, so that a field added to the class
is a flag at once, with its help text and its default, and no second list to keep.

`flags_dataclass(SettingsClass)` builds the draccus dataclass of the class's fields: each field's
default is the class's default, its help is the field's `description` or else the comment written
beside or above it in the class's source, followed by its bounds (`ge`, `le`, ...); a nested
`Settings` block is a nested dataclass (``--mapping.state=...``). Types draccus cannot decode
as written (unions of several kinds, such as ``str | tuple[str, ...] | None``) are taken as YAML
and left for the class to validate. `settings_values(flags, SettingsClass)` gives the class's fields the
parsed flags set, only what differs from the defaults, so that the class's own validation (one
`ConfigError` naming the field) decides.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import tokenize
import types
import typing
from collections.abc import Mapping
from typing import Any

_SIMPLE = (str, int, float, bool)


def field_comments(cls: type) -> dict[str, str]:
    """`name: ...  # text` and `# text` lines right above `name: ...`, for each field of `cls` (and its
    bases) as written in its source; {} when the source cannot be read."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        above: list[str] = []
        lines = source.splitlines()
        comments: dict[int, str] = {}
        try:
            for tok in tokenize.generate_tokens(io.StringIO(source).readline):
                if tok.type == tokenize.COMMENT:
                    comments[tok.start[0]] = tok.string.lstrip("#").strip()
        except (tokenize.TokenError, IndentationError):
            continue
        for number, line in enumerate(lines, 1):
            stripped = line.strip()
            if stripped.startswith("#"):
                text = comments.get(number, "")
                above = [] if text.startswith("--") else [*above, text]  # a "-- section" line starts over
                continue
            m = re.match(r"\s+([a-z_][a-z0-9_]*)\s*:[^=]*?(=|$)", line)
            if m and not stripped.startswith(("def ", "@", "return")):
                inline = comments.get(number, "")
                text = " ".join(t for t in (*above, inline) if t)
                if text:
                    out[m.group(1)] = text
            above = []
    return out


def _bounds(info) -> str:
    words = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥", "max_length": "length ≤"}
    parts = []
    for item in info.metadata:
        for attr, sign in words.items():
            if (value := getattr(item, attr, None)) is not None:
                parts.append(f"{sign} {value}")
    return f" ({', '.join(parts)})" if parts else ""


def _is_settings(tp: Any) -> bool:
    from lerobot_zenoh.config import Settings

    return inspect.isclass(tp) and issubclass(tp, Settings)


def _flag_type(tp: Any) -> Any:
    """A type draccus decodes for the field's annotation `tp`, or Any (YAML, validated by the class)."""
    if tp in _SIMPLE:
        return tp
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and rest[0] in _SIMPLE:
            return rest[0] | None
        return Any
    if origin is dict and args and args[0] is str:
        return dict[str, args[1] if args[1] in _SIMPLE else Any]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] in _SIMPLE:
        return tuple[args[0], ...]
    if origin is list and args and args[0] in _SIMPLE:
        return list[args[0]]
    return Any


def flags_dataclass(cls: type, name: str | None = None, extra: list | None = None,
                    fallback_help: Mapping[str, str] | None = None, _path: str = "") -> type:
    """The draccus dataclass of `cls`'s fields (see the module's docstring). `extra`: more
    `(name, type, dataclasses.field(...))` entries, first (flags of the script itself).
    `fallback_help`: flag name (dotted: ``mapping.state``) -> help, for fields the class gives no
    `description` (it wins over the field's comment, which is often terse)."""
    fallback_help = fallback_help or {}
    comments = field_comments(cls)
    hints = typing.get_type_hints(cls)
    entries = list(extra or ())
    for field_name, info in cls.model_fields.items():
        tp = hints.get(field_name, Any)
        path = f"{_path}{field_name}"
        help_text = (info.description or fallback_help.get(path) or comments.get(field_name)
                     or f"The `{path}` setting of {cls.__name__}.") + _bounds(info)
        if _is_settings(tp):
            nested = flags_dataclass(tp, f"{tp.__name__}Flags", fallback_help=fallback_help, _path=f"{path}.")
            entries.append((field_name, nested, dataclasses.field(default_factory=nested,
                                                                  metadata={"help": help_text})))
            continue
        flag_type = _flag_type(tp)
        if info.default_factory is not None:
            factory = info.default_factory
            entries.append((field_name, flag_type, dataclasses.field(default_factory=factory,
                                                                     metadata={"help": help_text})))
        else:
            default = info.default
            if isinstance(default, (list, dict, set)):
                entries.append((field_name, flag_type, dataclasses.field(
                    default_factory=lambda d=default: type(d)(d), metadata={"help": help_text})))
            else:
                entries.append((field_name, flag_type, dataclasses.field(default=default, metadata={"help": help_text})))
    return dataclasses.make_dataclass(name or f"{cls.__name__}Flags", entries)


def settings_values(flags: Any, cls: type) -> dict[str, Any]:
    """The fields of `cls` the parsed `flags` set to something other than the class's default."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for field_name, info in cls.model_fields.items():
        value = getattr(flags, field_name)
        tp = hints.get(field_name)
        if _is_settings(tp):
            nested = settings_values(value, tp)
            if nested:
                out[field_name] = nested
            continue
        default = info.default_factory() if info.default_factory is not None else info.default
        if isinstance(value, tuple) and isinstance(default, list):
            value = list(value)
        if value != default:
            out[field_name] = value
    return out
