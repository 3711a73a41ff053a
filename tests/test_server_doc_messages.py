"""docs/server.md shows the one-line start-up errors of a model with engines as a user sees them:
the manifest's own checks are run here and must print exactly what the table says."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.server.config.manifest import parse_manifest

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "server.md").read_text()
BASE = {"cluster_uuid": "jupiter", "experiment_tag": "fabio2", "server_id": "edge0", "server": [{
    "model_id": "pi0", "model_version": "v1", "application_tag": "cookie", "pretrained_path": "checkpoints/pi0",
    "scheduler": "wait_ratio", "clients": [{"client_uuid": "robot_1"}],
    "engines": [{"engine_id": "local", "tier": "edge", "capacity": 4, "local": True, "profile": "measured"},
                {"engine_id": "cloud0", "tier": "cloud", "capacity": 16, "profile": {1: 45, 8: 60, 16: 90}}]}]}

MISTAKES = {
    "a duplicate `engine_id`": lambda e: e["engines"].append(
        {"engine_id": "cloud0", "tier": "cloud", "capacity": 4, "profile": {1: 45}}),
    "a `capacity` of 0": lambda e: e["engines"][1].update(capacity=0),
    "an engine without a `profile`": lambda e: e["engines"][1].pop("profile"),
    "`max_in_flight` on an edge engine": lambda e: e["engines"][0].update(max_in_flight=8),
    "`max_in_flight` below the `capacity`": lambda e: e["engines"][1].update(max_in_flight=8),
    "more than one `local` engine": lambda e: e["engines"].append(
        {"engine_id": "l2", "tier": "edge", "capacity": 4, "local": True, "profile": "measured"}),
}


def documented(mistake: str) -> str:
    row = next(line for line in DOC.splitlines() if line.startswith(f"| {mistake} |"))
    return re.fullmatch(r"`(.+)` \|", row.rsplit(" | ", 1)[1]).group(1)


def test_the_base_manifest_of_the_table_is_valid():
    parse_manifest(copy.deepcopy(BASE), "edge.yaml")


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_documented_start_up_error_is_the_one_the_manifest_check_prints(mistake):
    manifest = copy.deepcopy(BASE)
    MISTAKES[mistake](manifest["server"][0])
    with pytest.raises(ConfigError) as err:
        parse_manifest(manifest, "edge.yaml")
    assert str(err.value) == documented(mistake)


def test_the_errors_found_when_the_engines_answer_are_the_dispatchers_own_words():
    source = "".join((ROOT / "lerobot_zenoh" / "server" / "dispatch" / name).read_text()
                     for name in ("dispatcher.py", "engine_health.py"))  # (start-up, and the status checks)
    for phrase in ("engine unreachable: no answer on", "(start it with role: engine, engine_id: ",
                   "; check endpoint and routers)", "engine loads ", ", this server ", "engine's model has action_dim ",
                   "measured, but this runner could not be profiled; declare {batch size: ms}"):
        assert phrase in source, phrase
    manifest_source = (ROOT / "lerobot_zenoh" / "server" / "config" / "manifest.py").read_text()
    assert "engines: a component of multi-model tasks (pipeline) is served by its own loop only" in manifest_source
    assert documented("`engines` on a component of multi-model tasks").endswith(
        "engines: a component of multi-model tasks (pipeline) is served by its own loop only")
