"""Fixtures shared by the whole suite: free loopback ports, unique key prefixes, Zenoh sessions.

Every test that uses Zenoh listens on its own free port on 127.0.0.1 with multicast scouting
off, so tests never see each other (or anything else on the network).
"""

from __future__ import annotations

import os

# Before anything imports huggingface_hub (lz_testing imports LeRobot, which does): it reads the
# variable once, at import. Set whatever the caller's environment says: the hub is never reached
# from the tests, and a test must not pass or fail with the caller's setting.
os.environ["HF_HUB_OFFLINE"] = "1"

import uuid  # noqa: E402

import pytest  # noqa: E402
from lz_testing import free_port  # noqa: E402


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def app_key():
    from lerobot_zenoh.protocol.keys import AppKey

    return AppKey("test", uuid.uuid4().hex[:8], "m", "v1", "app")


@pytest.fixture
def zenoh_pair(port):
    """(listener, connector): two real Zenoh sessions joined over TCP on loopback."""
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import loopback_settings

    a = ZenohSession(loopback_settings(port)).open()
    b = ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()
    yield a, b
    b.close()
    a.close()
