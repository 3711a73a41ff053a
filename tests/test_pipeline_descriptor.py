"""Task and factory descriptors: the example validates; each kind of bad input is refused in one line
naming the task, the component and the field (docs/pipelines.md)."""

import copy
from pathlib import Path

import pytest
import yaml

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.pipelines.descriptor import load_factory, parse_factory, parse_task
from lerobot_zenoh.pipelines.profiles import check_against_profiles, load_profiles, rosa_profiles

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "factories" / "mix2.yaml"


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def refused(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_factory(data)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_example_factory_validates_against_the_example_profiles():
    factory = load_factory(EXAMPLE)
    assert set(factory.tasks) == {"pick_and_place_simple", "assemble_kit"}
    kit = factory.tasks["assemble_kit"]
    assert kit.system2_horizon == 10
    assert kit.components["safety"].on_danger.action == "safe_pose"
    assert kit.components["act"].inputs == ["plan"]
    assert factory.tasks["pick_and_place_simple"].system2_horizon is None
    check_against_profiles(factory, load_profiles(ROOT / "factories" / "rosa_profiles.yaml"))


def test_a_task_file_can_be_referenced_by_path(tmp_path):
    data = example()
    (tmp_path / "p2.yaml").write_text(yaml.safe_dump(data["tasks"]["pick_and_place_simple"]))
    data["tasks"]["pick_and_place_simple"] = "p2.yaml"
    (tmp_path / "f.yaml").write_text(yaml.safe_dump(data))
    factory = load_factory(tmp_path / "f.yaml")
    assert factory.tasks["pick_and_place_simple"].components["act"].slo.deadline_ms == 200


def test_a_cycle_is_refused_naming_it():
    data = example()
    data["tasks"]["assemble_kit"]["components"]["plan"]["inputs"] = ["act"]
    text = refused(data)
    assert "tasks.assemble_kit" in text and "cycle" in text and "act -> plan -> act" in text


def test_an_unknown_model_is_refused_naming_task_and_component():
    data = example()
    data["tasks"]["assemble_kit"]["components"]["safety"]["model"] = "llama-guard"
    text = refused(data)
    assert "'assemble_kit'" in text and "'safety'" in text and "unknown model 'llama-guard'" in text


def test_a_model_without_a_profile_is_refused():
    factory = load_factory(EXAMPLE)
    profiles = rosa_profiles()
    profiles = profiles.model_copy(update={"models": {k: v for k, v in profiles.models.items() if k != "qwen2.5-vl-3b"}})
    with pytest.raises(ConfigError, match=r"tasks\.assemble_kit\.components\.safety\.model: .*no serving profile"):
        check_against_profiles(factory, profiles)


def test_an_slo_below_the_measured_minimum_latency_is_refused():
    data = example()
    data["tasks"]["assemble_kit"]["components"]["plan"]["slo"]["deadline_ms"] = 300
    factory = parse_factory(data)
    with pytest.raises(ConfigError) as info:
        check_against_profiles(factory, rosa_profiles())
    text = str(info.value)
    assert "tasks.assemble_kit.components.plan.slo.deadline_ms" in text
    assert "impossible SLO" in text and "'qwen2.5-vl-7b'" in text and "minimum p99" in text


@pytest.mark.parametrize("edit, field, words", [
    (lambda c: c["plan"].update(invocation={"rate_hz": 1}), "components.plan", "not at rate_hz"),
    (lambda c: c["safety"].update(invocation="per_chunk"), "components.safety", "runs at a rate"),
    (lambda c: c["safety"].pop("on_danger"), "components.safety", "needs on_danger"),
    (lambda c: c["safety"].update(on_danger={"action": "safe_pose"}), "on_danger", "needs pose"),
    (lambda c: c["act"].update(on_slo_miss={"action": "retry"}), "on_slo_miss", "needs max_retries"),
    (lambda c: c["act"].update(on_slo_miss="use_last"), "components.act", "system2 only"),
    (lambda c: c["act"].update(on_slo_miss="fly_away"), "on_slo_miss.action", "Input should be"),
    (lambda c: c["act"]["slo"].update(percentile=98), "slo.percentile", "not a profiled percentile"),
    (lambda c: c["act"].update(inputs=["ghost"]), "tasks.assemble_kit", "'ghost'"),
    (lambda c: c.pop("act"), "tasks.assemble_kit", "exactly one system1"),
    (lambda c: c["act"].update(colour="red"), "components.act.colour", "Extra inputs"),
])
def test_bad_components_are_refused_naming_the_field(edit, field, words):
    data = example()
    edit(data["tasks"]["assemble_kit"]["components"])
    text = refused(data)
    assert field in text and words in text


def test_factory_level_mistakes_are_refused():
    data = example()
    data["fleet"][0]["task"] = "paint"
    assert "fleet.0.task" in refused(copy.deepcopy(data))
    data = example()
    data["fleet"][0]["client_args"] = ["robot.port=/dev/ttyACM0"]
    assert "fleet.0.client_args" in refused(data) and "not a --flag=value" in refused(data)
    data = example()
    data["servers"]["count"] = 0
    assert "servers.count" in refused(data)
    data = example()
    data["models"]["gr00t-n1.6-3b"] = {"model_id": "gr00t"}
    assert "models.gr00t-n1.6-3b" in refused(data) and "exactly one of pretrained_path or synthetic" in refused(data)


def test_a_standalone_task_descriptor_parses():
    task = parse_task({**example()["tasks"]["pick_and_place_simple"], "name": "p2"})
    assert task.component("monitor")[0] == "progress"
    with pytest.raises(ConfigError, match="name"):
        parse_task({**example()["tasks"]["pick_and_place_simple"], "name": "a/b"})
