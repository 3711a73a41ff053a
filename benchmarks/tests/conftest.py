"""Fixtures of the benchmarks' own tests (benchmarks/tests/: the benchmarks' code, tested where it lives;
tests/ holds the product's tests and imports nothing from benchmarks/)."""

from __future__ import annotations

import os

# Before anything imports huggingface_hub: it reads the variable once, at import (tests/conftest.py, the same).
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402

from testbed.ports import free_port  # noqa: E402


@pytest.fixture
def port() -> int:
    return free_port()
