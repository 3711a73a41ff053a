"""`max_batch_size: auto`: the saturation rule (pure), the start-up profile, and the server using it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lerobot_zenoh.errors import ConfigError, PolicyError
from lerobot_zenoh.scheduling.batch_profile import profile_batch_sizes, saturation_batch_size
from lerobot_zenoh.server.model.batch_profiling import measure_batch_profile
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.runners import InferenceResult, RunnerCapabilities
from lerobot_zenoh.server.runners.synthetic import SyntheticPolicy, SyntheticPolicyConfig
from lerobot_zenoh.server.shell.policy_server import PolicyServer, ServedModel
from lerobot_zenoh.transport.session import ZenohSession
from lerobot_zenoh.transport.settings import loopback_settings
from lz_testing import wait_for

pytestmark = pytest.mark.core  # the pure serving core: make test-core

# -- the rule -----------------------------------------------------------------------------------


def ms(profile):
    return {b: t / 1000 for b, t in profile.items()}


@pytest.mark.parametrize(("profile_ms", "expected"), [
    ({1: 60, 2: 66, 4: 80, 8: 120, 16: 200}, 16),   # the fleet benchmark's GPU-like profile: still rising
    ({1: 60, 2: 64, 4: 72, 8: 100, 16: 200}, 8),    # peak at 8, 16 no better
    ({1: 10, 2: 20, 4: 40, 8: 80}, 1),              # batching buys nothing: the smallest wins
    ({1: 10, 2: 11, 4: 20, 8: 40}, 2),              # flat from 2 on
    ({1: 10, 2: 10, 4: 10.5, 8: 19}, 4),            # 8 is 10.5 % better than 4: 4 is within 10 %
    ({1: 10, 2: 10, 4: 11, 8: 19}, 8),              # 8 is 15.8 % better than 4: 8
    ({1: 5.0}, 1),
    ({4: 12, 1: 10, 2: 11}, 4),                     # order of the mapping does not matter
])
def test_saturation_is_the_smallest_batch_within_10_percent_of_the_best_throughput(profile_ms, expected):
    assert saturation_batch_size(ms(profile_ms)) == expected


def test_saturation_tolerance_and_edge_cases():
    profile = ms({1: 10, 2: 11, 4: 20, 8: 38})  # throughput 100, 182, 200, 211 req/s
    assert saturation_batch_size(profile, tolerance=0.0) == 8
    assert saturation_batch_size(profile, tolerance=0.1) == 4
    assert saturation_batch_size(profile, tolerance=0.5) == 2
    assert saturation_batch_size({1: 0.0, 2: 0.0}) == 1  # too fast to measure: no reason to batch
    with pytest.raises(ValueError, match="empty"):
        saturation_batch_size({})
    with pytest.raises(ValueError):
        saturation_batch_size({0: 0.01})
    with pytest.raises(ValueError):
        saturation_batch_size(profile, tolerance=1.0)


def test_profiled_sizes_are_powers_of_two_up_to_the_bound():
    assert profile_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert profile_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert profile_batch_sizes(1) == [1]
    with pytest.raises(ValueError):
        profile_batch_sizes(0)


# -- measuring ----------------------------------------------------------------------------------


def synthetic_config(**kw):
    return SyntheticPolicyConfig(state_dim=3, cameras={"front": (8, 8)}, action_dim=2, chunk_size=5, **kw)


class FakeClockRunner(SyntheticPolicy):
    """Each `run` advances a fake clock by the profile's latency; may fail above a size."""

    def __init__(self, config, fail_above: int | None = None):
        super().__init__(config)
        self.now_s = 0.0
        self.calls: list[int] = []
        self.forgotten: set[str] = set()
        self.fail_above = fail_above

    def clock(self):
        return self.now_s

    def run(self, requests, *, capture_updates=False):
        self.calls.append(len(requests))
        assert len({r.session_id for r in requests}) == len(requests)  # distinct sessions, as the server does
        if self.fail_above is not None and len(requests) > self.fail_above:
            raise PolicyError("out of memory")
        self.now_s += self.latency_s(len(requests))
        return [InferenceResult(np.zeros((5, 2), np.float32)) for _ in requests]

    def forget(self, client_id):
        self.forgotten.add(client_id)


def test_profile_times_each_size_after_one_untimed_call():
    runner = FakeClockRunner(synthetic_config(batch_latency_ms={1: 10, 16: 40}))
    profile = measure_batch_profile(runner, 16, repetitions=2, budget_s=10, clock=runner.clock)
    assert list(profile) == [1, 2, 4, 8, 16]
    assert profile == {b: pytest.approx(runner.latency_s(b)) for b in profile}
    assert runner.calls == [1] * 3 + [2] * 3 + [4] * 3 + [8] * 3 + [16] * 3
    assert runner.forgotten == {f"profile-{i}" for i in range(16)}


def test_profile_stops_within_its_time_budget_and_at_the_first_failing_size():
    runner = FakeClockRunner(synthetic_config(batch_latency_ms={1: 100, 16: 400}))
    # sizes 1 and 2 cost 3 x (100 + 120) ms = 0.66 s; size 4 is estimated at 2 x 120 x 3 ms = 0.72 s
    profile = measure_batch_profile(runner, 16, budget_s=1.0, clock=runner.clock)
    assert list(profile) == [1, 2]
    runner = FakeClockRunner(synthetic_config(batch_latency_ms={1: 10, 16: 40}), fail_above=4)
    assert list(measure_batch_profile(runner, 16, clock=runner.clock)) == [1, 2, 4]
    runner = FakeClockRunner(synthetic_config(latency_ms=10), fail_above=0)
    assert measure_batch_profile(runner, 16, clock=runner.clock) == {}


def test_profile_keeps_to_the_runners_max_batch():
    runner = FakeClockRunner(synthetic_config(batch_latency_ms={1: 10, 16: 40}))
    runner.spec = dataclasses.replace(runner.spec, capabilities=RunnerCapabilities(max_batch=4))
    assert list(measure_batch_profile(runner, 16, clock=runner.clock)) == [1, 2, 4]
    assert set(runner.calls) == {1, 2, 4}


# -- the server ---------------------------------------------------------------------------------

# Throughput 500, 909, 1333, 800, 800 req/s: the saturation point is 4, with a wide margin either side
# so that sleep jitter on a loaded machine cannot move it.
FAST_PROFILE_MS = {1: 2, 2: 2.2, 4: 3, 8: 10, 16: 20}


def manifest(port, app_key, **entry):
    base = {
        "model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
        "synthetic": {"state_dim": 3, "action_dim": 2, "chunk_size": 5, "cameras": {"front": (8, 8)},
                      "latency_ms": 2, "batch_latency_ms": FAST_PROFILE_MS},
        "fps": 30, "max_batch_size": "auto", "accept_unknown_clients": True,
    }
    base.update(entry)
    return parse_manifest({
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "telemetry_period_s": 0, "server": [base],
    })


def test_auto_picks_the_saturation_point_of_the_profile_measured_at_start_up(port, app_key):
    with PolicyServer(manifest(port, app_key)) as server:
        model = server.models[0]
        assert list(model.batch_profile_s) == [1, 2, 4, 8, 16]
        assert model.max_batch_size == 4
        metrics, _ = server.telemetry_figures(model)
        assert metrics["max_batch_size"] == 4
        for b, expected_ms in FAST_PROFILE_MS.items():  # measured: the policy's sleep at least (a busy host adds)
            assert metrics[f"batch_profile.{b}_ms"] >= expected_ms
        # announced only after profiling: the status answers at once
        with ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as s:
            assert wait_for(lambda: s.query(app_key.status, 0.3))


def test_auto_is_bounded_by_profile_max_batch(port, app_key):
    with PolicyServer(manifest(port, app_key, profile_max_batch=2)) as server:
        assert list(server.models[0].batch_profile_s) == [1, 2]
        assert server.models[0].max_batch_size == 2


class LoopOnlyPolicy(SyntheticPolicy):
    """A runner that takes one request per call (`capabilities.max_batch` 1), as third-party runners may."""

    def __init__(self, config):
        super().__init__(config)
        self.spec = dataclasses.replace(self.spec, capabilities=RunnerCapabilities(max_batch=1))

    def run(self, requests, *, capture_updates=False):
        assert len(requests) == 1, len(requests)  # the server keeps to the declared max_batch
        return super().run(requests, capture_updates=capture_updates)


def test_auto_gives_one_to_a_runner_that_cannot_batch(port, app_key):
    runner = LoopOnlyPolicy(synthetic_config(latency_ms=2))
    with PolicyServer(manifest(port, app_key), runners={app_key.model: runner}) as server:
        model = server.models[0]
        assert model.max_batch_size == 1 and model.batch_profile_s == {}
        metrics, _ = server.telemetry_figures(model)
        assert metrics["max_batch_size"] == 1
        assert not any(k.startswith("batch_profile.") for k in metrics)


def test_max_batch_size_is_capped_by_the_runners_max_batch(port, app_key):
    m = manifest(port, app_key, max_batch_size=8)
    runner = SyntheticPolicy(synthetic_config(latency_ms=2))
    runner.spec = dataclasses.replace(runner.spec, capabilities=RunnerCapabilities(max_batch=3))
    assert ServedModel(m, m.server[0], runner, "gpu0").max_batch_size == 3


def test_a_fixed_max_batch_size_is_not_profiled(port, app_key):
    with PolicyServer(manifest(port, app_key, max_batch_size=3)) as server:
        assert server.models[0].max_batch_size == 3 and server.models[0].batch_profile_s == {}


@pytest.mark.parametrize("value", ["fast", 0, 257])
def test_max_batch_size_is_auto_or_a_bounded_int(port, app_key, value):
    with pytest.raises(ConfigError, match="max_batch_size"):
        manifest(port, app_key, max_batch_size=value)
    with pytest.raises(ConfigError, match="profile_max_batch"):
        manifest(port, app_key, profile_max_batch=0)
