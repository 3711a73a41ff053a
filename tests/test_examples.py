"""The examples a user copies from keep working."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("script, args, expect", [
    ("fleet_on_one_server.py", ["--robots", "2", "--seconds", "2"], '"client_uuid": "robot_2"'),
    ("custom_aggregation.py", ["--seconds", "2"], '"blended_steps"'),
    ("record_and_open_dataset.py", ["--seconds", "2", "--root", "{tmp}/ds"], "1 episode(s)"),
])
def test_example_runs(script, args, expect, tmp_path):
    args = [a.format(tmp=tmp_path) for a in args]
    r = subprocess.run([sys.executable, script, *args], cwd=ROOT / "examples", capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert expect in r.stdout


def test_cli_imports_a_custom_aggregation_plugin(monkeypatch):
    from lerobot_zenoh.cli.client import parse_config

    monkeypatch.chdir(ROOT)
    cfg = parse_config(["--robot.type=zenoh_sim", "--plugins=examples.custom_aggregation",
                        "--aggregate.type=ema", "--aggregate.new_weight_first=0.8"])
    assert cfg.aggregate.type == "ema" and cfg.aggregate.new_weight_first == 0.8


def test_cli_knows_lerobot_robots_and_third_party_plugins():
    from lerobot_zenoh.cli.client import parse_config

    cfg = parse_config(["--robot.type=so101_follower", "--robot.port=/dev/null"])
    assert cfg.robot.type.startswith("so10") and cfg.robot.port == "/dev/null"  # so100 and so101 share a class
