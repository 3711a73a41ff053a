"""How settings are declared and validated: one pydantic base for every block a manifest holds.

A `Settings` subclass is the one declaration of a concern's settings: field types, bounds, defaults
and cross-field rules, written once beside the code that uses them (a runner's config, a
scheduler's config). The server manifest (server/manifest.py) holds these very classes as its
blocks (`server[i].synthetic` is a `SyntheticPolicyConfig`, `server[i].scheduler`'s settings are
the scheduler's own config class), and code that builds one directly (a test, a benchmark) gets
the same checks. Either way a mistake is one `ConfigError` naming the field: ``<prefix>.<field>``
when built directly (``rtc.execution_horizon``), the full path inside a manifest
(``server.0.rtc.execution_horizon``; docs/server.md, "Manifest reference").

Command-line flags are the other system, and only one: draccus dataclasses (cli/parsing.py).
`ZenohSettings` (transport/settings.py) is a plain dataclass both read, so the manifest's `zenoh:`
block and every `--zenoh.*` flag are one declaration too.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

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

    # Not a custom __init__ for pydantic: nested blocks keep being validated by pydantic itself, so
    # their errors keep their full path (server.0.rtc.execution_horizon) instead of becoming ours.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]


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


# -- value types several blocks share -------------------------------------------------------------


def _verdict_label(label: str) -> str:
    if label not in VERDICT_LABELS:
        raise ValueError(f"{label!r} is not a verdict label ({', '.join(sorted(VERDICT_LABELS))})")
    return label


def _distinct(labels: tuple[str, ...]) -> tuple[str, ...]:
    if len(labels) != len(set(labels)):
        raise ValueError(f"duplicate labels in {list(labels)}")
    return labels


#: One label of a verdict component (protocol/messages.py, VERDICT_LABELS).
VerdictLabel = Annotated[str, AfterValidator(_verdict_label)]
#: A component's label set: verdict labels, each once.
VerdictLabels = Annotated[tuple[VerdictLabel, ...], AfterValidator(_distinct)]
