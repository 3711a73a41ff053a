"""Command-line parsing shared by the console scripts: draccus, as LeRobot's own CLIs, with one-line errors.

Every console script takes `--field=value` flags (nested with dots, e.g. `--dataset.repo_id=...`),
prints its options with `--help`, and turns every configuration mistake into one line on stderr
naming the flag, then exits with :data:`EXIT_CONFIG` (2). draccus itself would print a 40-line
traceback (a bad value) or the 150-line usage (an unknown flag) and exit 1.

Exit codes shared by the console scripts (docs/client.md):

    0  done (or stopped by SIGINT/SIGTERM)
    2  a configuration mistake: bad value, wrong type, unknown or missing flag, a device that
       cannot be reached or opened (robot port, Prometheus port, Zenoh endpoint)
    3  the robot client found no server that serves it (nothing was sent to the robot), or the
       server refuses every request like the robot's (a permanent Refusal, protocol 1.5)
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar

EXIT_CONFIG = 2
EXIT_NO_SERVER = 3
#: What every script's `--log_level` takes (any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def check_log_level(value: str) -> None:
    """Every script's `--log_level` rule: a `ConfigError` naming the flag for anything else."""
    from lerobot_zenoh.errors import ConfigError

    if value.upper() not in LOG_LEVELS:
        raise ConfigError("log_level", f"{value!r} is not one of DEBUG, INFO, WARNING, ERROR")

T = TypeVar("T")


class UsageError(Exception):
    """A command-line mistake, already phrased for a person: `flag` names what to fix."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(f"{flag}: {message}" if flag else message)


def fail(prog: str, message: str, code: int = EXIT_CONFIG) -> NoReturn:
    """Print `prog: message` (one line) and exit with `code`."""
    print(f"{prog}: {one_line(message)}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def one_line(text: str, limit: int = 400) -> str:
    """A multi-line message (a YAML parser's, say) folded into one line."""
    parts = [line.strip() for line in str(text).splitlines()]
    folded = " ".join(p for p in parts if p and set(p) - {"^"})
    return folded if len(folded) <= limit else folded[: limit - 3] + "..."


def _flag(path: str) -> str:
    path = path.strip("`").strip()
    return path if path.startswith("--") else f"--{path}"


def explain(exc: BaseException) -> str:
    """One line naming the flag for any error draccus, argparse or a config's validation raises."""
    from lerobot_zenoh.errors import ConfigError, KeyExprError

    # The innermost cause carries the field: draccus wraps a __post_init__ error in "Couldn't
    # instantiate class X".
    chain = []
    e: BaseException | None = exc
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or (e.__context__ if not e.__suppress_context__ else None)
    for e in chain:
        if isinstance(e, UsageError):
            return str(e)
        if isinstance(e, ConfigError):
            message = str(e).split(": ", 1)[1] if str(e).startswith(f"{e.field}: ") else str(e)
            return f"{_flag(e.field)}: {message}"
        if isinstance(e, KeyExprError):
            return f"{_flag(e.field)}: {e}"
    # draccus nests decoding errors (an Optional field tries each type): the deepest names the flag.
    for e in reversed(chain):
        if (m := re.match(r"`([^`]+)`: (.+)", str(e).strip())) and "into any of the given types" not in m.group(2):
            return f"{_flag(m.group(1))}: {m.group(2)[:1].lower()}{m.group(2)[1:]}"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if m := re.match(r"Missing required field\(s\) (.+?) for (\w+)", text):
        fields = [f.strip("` ") for f in m.group(1).split(",")]
        hint = " (e.g. --robot.type=so101_follower; --help lists the types)" if fields == ["robot"] else ""
        return "missing required flag " + ", ".join(
            _flag(f) + (".type" if f == "robot" else "") for f in fields) + hint
    if m := re.match(r"`([^`]+)`: (.+)", text):  # DecodingError: `num_episodes`: Couldn't parse 'two' into an int
        return f"{_flag(m.group(1))}: {m.group(2)[:1].lower()}{m.group(2)[1:]}"
    if m := re.match(r"unrecognized arguments: (.+)", text):
        return f"unknown flag {m.group(1)} (--help lists every flag)"
    if m := re.match(r"argument (\S+?)(?:/\S+)?: (.+)", text):  # argparse: invalid choice, expected one argument
        return f"{m.group(1)}: {m.group(2)}"
    # Anything else a config class raised while being built (e.g. a LeRobot robot config's
    # ValueError): draccus only says "Couldn't instantiate class X"; the cause says why.
    if m := re.search(r"instantiate class (\w+)", text):
        root = chain[-1]
        why = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
        return f"{m.group(1)}: {why}"
    return text


_METADATA_HELP = False


def use_metadata_help() -> None:
    """Let `--help` show `field(metadata={"help": ...})` texts too.

    draccus 0.11 reads a field's help only from the comment above it; our dataclasses shared with
    pydantic and argparse (ZenohSettings, SendTriggerConfig, the simulated robot, ...) carry it in
    `metadata["help"]`, as LeRobot's own configs sometimes do. A comment, when present, still wins.
    """
    global _METADATA_HELP
    if _METADATA_HELP:
        return
    from draccus.wrappers.field_wrapper import FieldWrapper

    comment_help = FieldWrapper.help.fget

    def help_text(self):
        text = comment_help(self)
        return text if text and text.strip() else (self.field.metadata or {}).get("help", text)

    FieldWrapper.help = property(help_text, FieldWrapper.help.fset)
    _METADATA_HELP = True


@dataclass(frozen=True)
class Spellings:
    """What a script accepts besides draccus' own ``--field=value`` (its flags stay those of its config
    dataclass; these only rewrite the command line before draccus reads it).

    `aliases`: an older spelling -> the flag (``--listen`` -> ``--zenoh.listen``). `switches`: a flag
    without a value -> what it stands for (``--no-scouting`` -> ``--zenoh.multicast_scouting=false``).
    `repeatable`: list flags that may be given once per item (``--zenoh.listen A --zenoh.listen B``),
    collected into draccus' ``--zenoh.listen=["A", "B"]``. `pairs`: mapping flags given once per
    ``KEY=VALUE`` item, collected into ``{KEY: VALUE}``. A value already written as draccus takes it
    (``[...]``, ``{...}``) is kept as it is.
    """

    aliases: Mapping[str, str] = field(default_factory=dict)
    switches: Mapping[str, str] = field(default_factory=dict)
    repeatable: frozenset[str] = frozenset()
    pairs: frozenset[str] = frozenset()

    def rewrite(self, argv: list[str]) -> list[str]:
        out: list[str] = []
        collected: dict[str, list[str] | dict[str, str]] = {}
        i = 0
        while i < len(argv):
            arg = argv[i]
            i += 1
            if arg in self.switches:
                arg = self.switches[arg]
            name, eq, value = arg.partition("=")
            flag = self.aliases.get(name, name)
            if flag not in self.repeatable and flag not in self.pairs:
                out.append(f"{flag}{eq}{value}" if flag != name else arg)
                continue
            if not eq:  # --flag VALUE
                if i >= len(argv):
                    raise UsageError(flag, "expected one argument")
                value = argv[i]
                i += 1
            if value.lstrip()[:1] in ("[", "{"):  # written the draccus way: taken as it is
                out.append(f"{flag}={value}")
                continue
            if flag in self.pairs:
                key, sep, item = value.partition("=")
                if not sep or not key:
                    raise UsageError(flag, f"{value!r} is not KEY=VALUE")
                collected.setdefault(flag, {})[key] = item  # type: ignore[index]
            else:
                collected.setdefault(flag, []).append(value)  # type: ignore[union-attr]
        # JSON is YAML, which draccus reads: every value stays a string, whatever it holds.
        return out + [f"{flag}={json.dumps(value)}" for flag, value in collected.items()]


#: The robot client's and the monitor's: `--zenoh.connect` may be given once per endpoint, as the
#: router's (`--zenoh.connect=tcp/ra:7447 --zenoh.connect=tcp/rb:7447`: several routers), besides
#: draccus' `--zenoh.connect=[tcp/ra:7447, tcp/rb:7447]`.
CONNECT_SPELLINGS = Spellings(repeatable=frozenset({"--zenoh.connect"}))


#: Words YAML 1.1 reads as booleans and YAML 1.2 as strings (true and false are booleans in both).
_YAML11_WORDS = re.compile(r"^(?:y|Y|yes|Yes|YES|n|N|no|No|NO|on|On|ON|off|Off|OFF)$")


def _field_type(config_class: type, dotted: str) -> object | None:
    """The annotated type of a config's field named by a flag's dotted path, or None if none is."""
    import dataclasses
    import typing

    cls: object = config_class
    hint: object = None
    for part in dotted.split("."):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return None
        try:
            hint = typing.get_type_hints(cls).get(part)
        except Exception:  # noqa: BLE001 - an annotation that does not resolve: left to draccus
            return None
        if hint is None:
            return None
        cls = hint
    return hint


def _keep_words(config_class: type, args: list[str]) -> list[str]:
    """`--compile=off` means the word off, as a manifest's `compile: off` does (YAML 1.2): draccus
    reads a flag's value as YAML 1.1, where off, on, yes and no are booleans, and a string field
    then got 'False'. Such a word given to a field that is not a boolean is quoted first."""
    out = []
    for arg in args:
        name, eq, value = arg.partition("=")
        if eq and name.startswith("--") and _YAML11_WORDS.match(value.strip()):
            hint = _field_type(config_class, name[2:])
            if hint is not None and hint is not bool and "bool" not in str(hint):
                arg = f"{name}={json.dumps(value.strip())}"
        out.append(arg)
    return out


def parse(config_class: type[T], argv: list[str] | None, prog: str, spellings: Spellings | None = None) -> T:
    """draccus.parse with one-line errors (exit 2); `--help` prints every option as usual. `spellings`
    rewrites a script's other accepted spellings into draccus flags first."""
    import draccus

    use_metadata_help()

    args = sys.argv[1:] if argv is None else list(argv)
    if "-h" in args or "--help" in args:
        print(help_text(config_class, prog), end="")
        raise SystemExit(0)
    try:
        if spellings is not None:
            args = spellings.rewrite(args)
        return draccus.parse(config_class=config_class, args=_keep_words(config_class, args), prog=prog,
                             exit_on_error=False)
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - every parse error becomes one line, none a traceback
        fail(prog, explain(exc))


def help_text(config_class: type, prog: str) -> str:
    """draccus' `--help` text, less the second copy of each nested group's "Config file for ..."
    line (draccus 0.10 registers that option once for the parent and once for the group)."""
    import contextlib
    import io

    import draccus

    use_metadata_help()
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        draccus.parse(config_class=config_class, args=["--help"], prog=prog)
    lines: list[str] = []
    for line in text.getvalue().splitlines(keepends=True):
        if not (lines and line == lines[-1] and line.lstrip().startswith("--")):
            lines.append(line)
    return "".join(lines)


def require_role(prog: str, module: str, extra: str) -> None:
    """Exit 2 in one line when this install lacks what `prog` needs (`module` and torch, from the
    `extra`): the base install serves the monitor, the router and the secure tool only (README, "Install")."""
    require_extra(prog, extra, module, "torch")


def require_extra(prog: str, extra: str, *modules: str) -> None:
    """Exit 2 in one line naming the extra to install when any of `modules` is not installed
    (checked without importing them)."""
    import importlib.util

    missing = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken install is as good as none
            found = False
        if not found:
            missing.append(module)
    if missing:
        fail(prog, f"this install lacks {' and '.join(missing)}: {prog} needs the [{extra}] extra "
                   f"(pip install '.[{extra}]' in the lerobot-zenoh checkout, or 'lerobot_zenoh-*.whl[{extra}]')")


# -- LeRobot async-inference flags: answered with what does the same here ------------------------

#: LeRobot's `lerobot.async_inference.robot_client` flags that mean something else here, each
#: answered with the equivalent (value -> the one line printed).
LEROBOT_CLIENT_FLAGS: Mapping[str, object] = {
    "--pretrained_name_or_path": lambda v: (
        f"the model is chosen on the server: lerobot-policy-server --policy.path={v or 'X'}"),
    "--policy_type": lambda v: (
        "the server reads the policy type from the checkpoint (lerobot-policy-server --policy.path=...); "
        "the robot client needs none"),
    "--policy_device": lambda v: (
        f"the device is chosen on the server: lerobot-policy-server --policy.device={v or 'cuda'}"),
    "--chunk_size_threshold": lambda v: (
        "the next observation is sent when the buffered actions last less than the measured round trip (automatic); "
        "to set it: --send.buffer_time_s=SECONDS (LeRobot's threshold x --actions_per_chunk / --fps)"),
    "--aggregate_fn_name": lambda v: f"blending overlapping chunks is --aggregate.type={v or 'weighted_average'} here",
}

#: LeRobot's `lerobot.async_inference.policy_server` flags, answered the same way.
LEROBOT_SERVER_FLAGS: Mapping[str, object] = {
    "--host": lambda v: (f"the server listens on a Zenoh endpoint: --endpoint=tcp/{v or '0.0.0.0'}:7447 "
                         "(--host and --port together are --endpoint=tcp/HOST:PORT)"),
    "--port": lambda v: (f"the server listens on a Zenoh endpoint: --endpoint=tcp/0.0.0.0:{v or '7447'} "
                         "(--host and --port together are --endpoint=tcp/HOST:PORT)"),
}


def answer_foreign_flags(prog: str, argv: list[str], answers: Mapping[str, object]) -> None:
    """Exit 2 with one line answering the first flag of `answers` found in `argv` (`--flag=value` or
    `--flag value`): a LeRobot async-inference user's flag, said in this tool's terms."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in answers:
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
            host_port = _host_port(argv) if name in ("--host", "--port") else None
            message = answers[name](value)  # type: ignore[operator]
            if host_port is not None:
                message = f"the server listens on a Zenoh endpoint: --endpoint=tcp/{host_port[0]}:{host_port[1]}"
            fail(prog, f"{name}: {message}")


def _host_port(argv: list[str]) -> tuple[str, str] | None:
    """(host, port) when both --host and --port are given."""
    found: dict[str, str] = {}
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in ("--host", "--port"):
            found[name] = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    return (found["--host"], found["--port"]) if len(found) == 2 else None


def warn_old_spellings(prog: str, argv: list[str], renamed: Mapping[str, str]) -> None:
    """One line on stderr for each older spelling in `argv` that still works (`renamed`: old flag ->
    the flag that replaces it; the script's Spellings still accept it)."""
    given = {a.split("=", 1)[0] for a in argv}
    for old, new in renamed.items():
        if old in given:
            print(f"{prog}: {old} is deprecated: write {new} (docs/client.md, \"Command lines\")", file=sys.stderr,
                  flush=True)


def serve_until_stopped(prog: str, service, ready: Callable[[object], str]) -> int:
    """A front door's life under a console script: `service.start()`; a configuration that does not
    fit is one line naming the field (exit 2), no server one line (exit 3), after `service.close()`;
    then `ready(service)` is printed and it serves until SIGINT or SIGTERM, and is closed (exit 0)."""
    import signal
    import threading

    from lerobot_zenoh.errors import CompatibilityError, ConfigError

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        service.start()
    except ConfigError as exc:
        service.close()
        fail(prog, explain(exc), EXIT_CONFIG)
    except CompatibilityError as exc:
        service.close()
        fail(prog, str(exc), EXIT_NO_SERVER)
    print(f"{prog}: {ready(service)}", flush=True)
    stop.wait()
    service.close()
    return 0
