"""Runners are registered like schedulers and declare what they can do; none is probed by class."""

from __future__ import annotations

import pytest

from lerobot_zenoh.server import runners
from lerobot_zenoh.server.runners import REFUSED, RUNNERS, register_runner
from lerobot_zenoh.server.runners.base import RunnerCapabilities
from lerobot_zenoh.server.runners.lerobot import LeRobotRunner
from lerobot_zenoh.server.runners.synthetic import SyntheticPolicy, SyntheticPolicyConfig
from lerobot_zenoh.server.model.text_stream import writes_text


class PluginRunner(LeRobotRunner):
    @classmethod
    def capabilities_for(cls, config):
        return RunnerCapabilities(max_batch=None, streams_text=True)


def test_a_plugin_family_is_registered_and_a_served_type_is_not_taken_by_accident(monkeypatch):
    monkeypatch.setattr(runners, "RUNNERS", dict(RUNNERS))
    monkeypatch.setattr(runners, "REFUSED", dict(REFUSED))
    register_runner("vqbet", PluginRunner)  # refused until a runner serves it
    assert runners.RUNNERS["vqbet"] is PluginRunner and "vqbet" not in runners.REFUSED
    with pytest.raises(ValueError, match="served by ActRunner already"):
        register_runner("act", PluginRunner)
    register_runner("act", PluginRunner, replace=True)
    with pytest.raises(TypeError, match="not a LeRobotRunner subclass"):
        register_runner("x", object)


def test_what_a_runner_does_is_read_from_its_declared_capabilities():
    plain = SyntheticPolicy(SyntheticPolicyConfig(state_dim=2, action_dim=2, chunk_size=4, cameras={}))
    assert not writes_text(plain)
    assert PluginRunner.capabilities_for(None).streams_text
    assert RunnerCapabilities().settings_blocks == ()
