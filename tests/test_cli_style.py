"""One command-line style for every console script (docs/client.md, "Command lines"): draccus
`--a.b=value` flags, `--help` with a help text and the default of every flag, `--log_level`, the
older spellings still accepted with a one-line hint. In-process: no script is started."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest

from lerobot_zenoh.cli import monitor, openpi, profile, ros2, secure
from lerobot_zenoh.command_line import help_text


def configs():
    """(prog, flags class) of each script checked here (the robot client's and the policy server's
    are checked with their own tests)."""
    return [("lerobot-zenoh-monitor", monitor.MonitorConfig), ("lerobot-zenoh-openpi", openpi.flags_class()),
            ("lerobot-zenoh-secure init", secure.InitConfig), ("lerobot-zenoh-secure acl", secure.AclConfig),
            ("lerobot-zenoh-profile", profile.ProfileConfig), ("lerobot-zenoh-ros2", ros2.flags_class())]


def flag_blocks(text: str) -> dict[str, str]:
    """--flag -> its help block, from draccus' --help (options after the usage lines)."""
    body = text.split("\n\n", 1)[1]
    blocks: dict[str, str] = {}
    current = None
    for line in body.splitlines():
        if m := re.match(r"  (--[a-z_.]+)", line):
            current = m.group(1)
            blocks[current] = line[len(m.group(0)):]
        elif current and line.startswith("   "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


@pytest.mark.parametrize("prog,cls", configs(), ids=[p for p, _ in configs()])
def test_every_flag_has_a_help_text_and_its_default(prog, cls):
    blocks = flag_blocks(help_text(cls, prog))
    assert "--log_level" in blocks, prog
    for flag, block in blocks.items():
        if flag in ("--config_path", "--help") or block.strip().startswith("str") and "Config file for" in block:
            continue
        words = re.sub(r"\(default:.*\)\s*$", "", block.split(None, 1)[1] if " " in block.strip() else "").strip()
        assert "(default:" in block, (prog, flag, block)
        assert len(words) > 8, (prog, flag, block)  # a text, not only the type


def test_the_monitor_takes_json_and_exit_when_unreachable_without_a_value():
    from lerobot_zenoh.command_line import parse

    config = parse(monitor.MonitorConfig, ["--json", "--exit_when_unreachable", "--log-level=DEBUG"],
                   monitor.PROG, monitor.spellings())
    assert config.json is True and config.exit_when_unreachable is True and config.log_level == "DEBUG"


def test_openpi_flags_are_generated_from_the_front_door_config():
    """A field of FrontDoorConfig is a flag, without a second list: every field appears, with the
    class's default; a value reaches the config; a bound of the class is its error."""
    from lerobot_zenoh.errors import ConfigError
    from lerobot_zenoh.openpi.front_door import FrontDoorConfig

    blocks = flag_blocks(help_text(openpi.flags_class(), openpi.PROG))
    for name in FrontDoorConfig.model_fields:
        if name != "mapping":
            assert f"--{name}" in blocks, name
    assert "--mapping.images" in blocks and "(default: 8000)" in blocks["--port"]
    config, level = openpi.parse(["--port=9001", "--max_clients=3", "--image", "observation/image=front",
                                  "--state", "observation/state", "--log-level", "DEBUG"])
    assert (config.port, config.max_clients, level) == (9001, 3, "DEBUG")
    assert dict(config.mapping.images) == {"observation/image": "front"}
    assert config.mapping.state_keys == ("observation/state",)
    with pytest.raises(ConfigError, match="max_clients"):
        openpi.parse(["--max_clients=0"])


def test_a_settings_class_field_added_later_is_a_flag(tmp_path):
    from pydantic import Field

    from lerobot_zenoh.cli.settings_flags import flags_dataclass, settings_values
    from lerobot_zenoh.config import Settings

    class Door(Settings):
        # Most connections at once.
        max_connections: int = Field(4, ge=1)
        idle_timeout_s: float | None = None  # close a connection idle this long

    blocks = flag_blocks(help_text(flags_dataclass(Door), "door"))
    assert "Most connections at once. (≥ 1)" in blocks["--max_connections"]
    assert "close a connection idle this long" in blocks["--idle_timeout_s"]
    assert Door().max_connections == 4
    flags = flags_dataclass(Door)(idle_timeout_s=2.0)
    assert settings_values(flags, Door) == {"idle_timeout_s": 2.0}


def test_old_spellings_say_once_what_to_write(capsys):
    from lerobot_zenoh.command_line import warn_old_spellings

    warn_old_spellings("prog", ["--log-level", "DEBUG", "--x=1"], {"--log-level": "--log_level"})
    assert capsys.readouterr().err.strip().splitlines() == [
        'prog: --log-level is deprecated: write --log_level (docs/client.md, "Command lines")']


def test_secure_keeps_its_space_separated_and_repeated_flags():
    from lerobot_zenoh.command_line import Spellings, parse

    spellings = Spellings(switches={"--force": "--force=true"}, repeatable=secure._REPEATABLE)
    config = parse(secure.InitConfig, ["--manifest", "a.yaml", "--manifest", "b.yaml", "--out", "pki", "--force",
                                       "--valid_days", "30"], "secure", spellings)
    assert (config.manifest, config.out, config.force, config.valid_days) == (["a.yaml", "b.yaml"], "pki", True, 30)


@dataclass
class Inner:
    mode: str = "x"
    enabled: bool | None = None


@dataclass
class Flags:
    compile: str = "default"
    json: bool = False
    inner: Inner = field(default_factory=Inner)


def test_a_word_yaml_1_1_reads_as_a_boolean_stays_a_word_for_a_field_that_is_not_one():
    """`--compile=off` is the word off (as `compile: off` is in a manifest, YAML 1.2); a boolean
    field still reads on/off/yes/no as before; `make demo` passes `--compile=off`."""
    from lerobot_zenoh.command_line import _keep_words, parse
    from lerobot_zenoh.demo import DemoConfig

    got = parse(Flags, ["--compile=off", "--json=on", "--inner.mode=No", "--inner.enabled=yes"], "prog")
    assert (got.compile, got.json, got.inner.mode, got.inner.enabled) == ("off", True, "No", True)
    assert parse(Flags, ["--compile=max-autotune", "--json=false"], "prog").json is False
    assert _keep_words(DemoConfig, ["--compile=off", "--robots=2"]) == ['--compile="off"', "--robots=2"]
