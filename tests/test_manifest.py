"""The manifest holds the runners' and schedulers' own config classes: one declaration, one validation,
and a mistake is one line naming the field (docs/server.md, "Manifest reference")."""

from pathlib import Path

import pytest
from pydantic import Field

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.scheduling.request_schedulers import SCHEDULERS, register_scheduler
from lerobot_zenoh.scheduling.scheduler_interface import SchedulerConfig
from lerobot_zenoh.scheduling.wait_ratio import WaitRatioConfig, WaitRatioScheduler
from lerobot_zenoh.server.config.manifest import load_manifest, parse_manifest
from lerobot_zenoh.server.config.runner_loading import load_runner
from lerobot_zenoh.server.runners.lerobot import RtcSettings
from lerobot_zenoh.server.runners.pi05_language import LanguageSettings
from lerobot_zenoh.server.runners.synthetic import CircleMotion, SyntheticPolicy, SyntheticPolicyConfig
from lerobot_zenoh.server.runners.vlm import VlmSettings

ROOT = Path(__file__).resolve().parents[1]


def manifest(**entry):
    model = {"model_id": "m", "model_version": "v", "application_tag": "a", "accept_unknown_clients": True,
             "synthetic": {"state_dim": 2, "action_dim": 2, "chunk_size": 4, "cameras": {}}, **entry}
    return {"cluster_uuid": "c", "experiment_tag": "e", "server": [{k: v for k, v in model.items() if v is not None}]}


def test_the_blocks_are_the_runners_and_schedulers_own_config_classes():
    entry = parse_manifest(manifest(scheduler={"type": "wait_ratio", "buckets": 4})).server[0]
    assert type(entry.synthetic) is SyntheticPolicyConfig
    assert type(entry.rtc) is RtcSettings and entry.rtc == RtcSettings()
    assert type(entry.scheduler.settings) is WaitRatioConfig and entry.scheduler.settings == WaitRatioConfig(buckets=4)
    vlm = parse_manifest(manifest(synthetic=None, pretrained_path="x", vlm={"output": "text"})).server[0].vlm
    assert type(vlm) is VlmSettings and vlm == VlmSettings(output="text")
    lang = parse_manifest(manifest(synthetic=None, pretrained_path="x", language={"max_new_tokens": 8})).server[0]
    assert type(lang.language) is LanguageSettings and lang.language == LanguageSettings(max_new_tokens=8)


def test_the_runner_is_built_from_the_block_as_is():
    m = parse_manifest(manifest(fps=20, synthetic={"state_dim": 3, "action_dim": 2, "chunk_size": 5, "cameras": {},
                                                    "latency_ms": 7, "circle": {"period_s": 2}}))
    runner = load_runner(m, m.server[0])
    assert isinstance(runner, SyntheticPolicy) and runner.config is m.server[0].synthetic
    assert runner.config.circle == CircleMotion(period_s=2)
    assert (runner.spec.fps, runner.spec.action_dim, runner.latency_s()) == (20, 2, pytest.approx(0.007))


@pytest.mark.parametrize("entry, field", [
    ({"synthetic": {"latency_ms": -1}}, "server.0.synthetic.latency_ms"),
    ({"synthetic": {"batch_latency_ms": {0: 10.0}}}, "server.0.synthetic.batch_latency_ms.0"),
    ({"synthetic": {"batch_latency_ms": {}}}, "server.0.synthetic.batch_latency_ms"),
    ({"synthetic": {"circle": {"period_s": 0}}}, "server.0.synthetic.circle.period_s"),
    ({"synthetic": {"state_dim": 1, "circle": {}}}, "server.0.synthetic.circle"),
    ({"synthetic": {"confidence_from_state": 6}}, "server.0.synthetic.confidence_from_state"),
    ({"synthetic": {"output": "text", "echo_task": True}}, "server.0.synthetic.echo_task"),
    ({"synthetic": {"output": "verdict", "verdicts": ["maybe"]}}, "server.0.synthetic.verdicts"),
    ({"synthetic": {"output": "verdict", "verdict_at": {0: "safe"}}}, "server.0.synthetic.verdict_at"),
    ({"synthetic": {"colour": "red"}}, "server.0.synthetic.colour"),
    ({"rtc": {"execution_horizon": 0}}, "server.0.rtc.execution_horizon"),
    ({"synthetic": None, "pretrained_path": "x", "vlm": {"output": "text", "max_new_tokens": 0}},
     "server.0.vlm.max_new_tokens"),
    ({"synthetic": None, "pretrained_path": "x", "vlm": {"output": "verdict", "labels": ["safe", "safe"]}},
     "server.0.vlm.labels"),
    ({"synthetic": None, "pretrained_path": "x", "language": {"tokens_per_frame": 0}},
     "server.0.language.tokens_per_frame"),
    ({"synthetic": None, "pretrained_path": "x", "language": {"prompt": ""}}, "server.0.language.prompt"),
    ({"scheduler": {"type": "wait_ratio", "aging": 0}}, "server.0.scheduler.aging"),
])
def test_a_bad_value_fails_in_one_line_naming_the_field(entry, field):
    with pytest.raises(ConfigError) as info:
        parse_manifest(manifest(**entry), source="m.yaml")
    assert info.value.field == field
    text = str(info.value)
    assert text.startswith(f"m.yaml: {field}: ") and "\n" not in text


@pytest.mark.parametrize("build, field", [
    (lambda: SyntheticPolicyConfig(latency_ms=-1), "latency_ms"),
    (lambda: CircleMotion(amplitude=0), "circle.amplitude"),
    (lambda: RtcSettings(execution_horizon=0), "rtc.execution_horizon"),
    (lambda: VlmSettings(output="text", labels=("safe",)), "vlm"),
    (lambda: LanguageSettings(max_requests=0), "language.max_requests"),
    (lambda: WaitRatioConfig(buckets=0), "wait_ratio.buckets"),
])
def test_built_directly_the_same_checks_name_the_field(build, field):
    with pytest.raises(ConfigError) as info:
        build()
    assert info.value.field == field and "\n" not in str(info.value)


# -- a scheduler registered by a plugin ---------------------------------------------------------------


class TicketsConfig(SchedulerConfig):
    tickets: int = Field(3, ge=1, strict=True)


class TicketScheduler:
    """A third party's scheduler: serves the ready clients in name order, `tickets` at most per pick."""

    name = "tickets"
    needs_execution_info = False

    def __init__(self, config: TicketsConfig):
        self.config = config
        self.picks = 0

    def on_arrival(self, client_id, now_s, execution=None):
        pass

    def pick(self, ready, now_s, max_batch=1):
        self.picks += 1
        return sorted(ready)[:min(max_batch, self.config.tickets)]

    def on_served(self, client_ids, now_s, duration_s):
        pass

    def forget(self, client_id):
        pass

    def stats(self):
        return {"picks": self.picks}


@pytest.fixture
def tickets():
    register_scheduler(TicketScheduler.name, TicketScheduler, TicketsConfig)
    try:
        yield
    finally:
        SCHEDULERS.pop(TicketScheduler.name, None)


def test_a_plugin_schedulers_settings_are_validated_through_the_registry(tickets):
    entry = parse_manifest(manifest(scheduler={"type": "tickets", "tickets": 5})).server[0]
    built = entry.scheduler.build()
    assert isinstance(built, TicketScheduler) and built.config == TicketsConfig(tickets=5)
    assert parse_manifest(manifest(scheduler="tickets")).server[0].scheduler.build().config.tickets == 3
    for value, field in [
        ({"type": "tickets", "tickets": 0}, "server.0.scheduler.tickets"),
        ({"type": "tickets", "tickets": "5"}, "server.0.scheduler.tickets"),
        ({"type": "tickets", "seats": 5}, "server.0.scheduler.seats"),
        ({"type": "tickets", "buckets": 5}, "server.0.scheduler"),  # wait_ratio's
        ({"type": "wait_ratio", "tickets": 5}, "server.0.scheduler"),  # the plugin's, on another type
    ]:
        with pytest.raises(ConfigError) as info:
            parse_manifest(manifest(scheduler=value), source="m.yaml")
        assert info.value.field == field, value
    m = parse_manifest(manifest(scheduler={"type": "tickets", "tickets": 2}))
    dumped = m.model_dump(mode="json", exclude_none=True)
    assert dumped["server"][0]["scheduler"] == {"type": "tickets", "tickets": 2}  # flat, as it is written
    assert parse_manifest(dumped).server == m.server


def test_without_the_plugin_its_name_is_unknown():
    with pytest.raises(ConfigError) as info:
        parse_manifest(manifest(scheduler="tickets"))
    assert info.value.field == "server.0.scheduler" and "round_robin" in str(info.value)


def test_wait_ratio_built_from_its_config_or_keywords_alike():
    assert WaitRatioScheduler(WaitRatioConfig(aging=3)).config == WaitRatioScheduler(aging=3).config
    with pytest.raises(TypeError):
        WaitRatioScheduler(WaitRatioConfig(), aging=3)


def test_shipped_manifests_survive_a_dump_and_reload():
    """What lerobot-zenoh-secure does: dump a parsed manifest as data and parse it again."""
    for path in sorted((ROOT / "manifests").glob("*.yaml")):
        m = load_manifest(path)
        again = parse_manifest(m.model_dump(mode="json", exclude_none=True), source=str(path))
        assert again.server == m.server, path
