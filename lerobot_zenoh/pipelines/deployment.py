"""A plan as files that start it: one server manifest per server, one client command per robot.

    <output>/plan.json            rates, placement, batching, routing (every component) and the summary
    <output>/manifests/srvN.yaml  `lerobot-policy-server --manifest=...` for server N
    <output>/servers.sh           the deployment's Zenoh router, then one line per server (each writes its
                                  id to run/srvN.pid once serving)
    <output>/clients.sh           one `lerobot-robot-client --pipeline.plan=plan.json` line per robot
    <output>/factory.yaml, profiles.yaml, plan_state.json
                                  what was planned from, and the exact plan: what lerobot-zenoh-admit
                                  reads to admit a robot into the running fleet (`apply_admission`)

Links: one Zenoh router (`lerobot-zenoh-router`) listens at `tcp/<servers.host>:<servers.port_base>`;
every server connects to it in client mode and listens nowhere, and every robot connects to it in
client mode (every route of plan.json names the router's endpoint). A robot's observation crosses
its own link once, and the router forwards it once over the link of each server that subscribes to
it: Zenoh routes by interest, and a robot peered with every server (the former layout) sent every
observation over every server link, whichever components it asked (docs/pipelines.md, "Links").

Routing is enforced by the manifests: each server lists exactly the robots routed to it (no unknown
clients) under an application tag of its own (`<kind>-srvN`). Every server entry also has a `pipeline`
block naming, for each task it serves a component of, the task, the component, its bit in an
observation's `component_mask` (its position in the task descriptor) and what the descriptor asks of
it (prompt; labels for safety and monitor): the server then takes the task's robots' observations from
the task's observation stream (docs/pipelines.md). A model serving a task's System 1 and System 2
from one stream (a pi0.5 with a `language` block) gets System 2 as the item's `text` (its bit and
prompt) and the factory's `language` block, under `system1+system2-srvN`. A synthetic or VLM model that does not say its
`output` answers what its component kind needs (system1: actions, system2: text, safety and monitor:
verdict). plan.json also carries what a robot's pipeline client needs (`pipelines/robot_plan.py` reads
it): the key prefix, every task descriptor, and per robot its control rate, chunk length and one route
per component (endpoint, app key, kind, planned request rate).
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import asdict
from pathlib import Path

import yaml

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.pipelines.descriptor import Factory, FleetClass, load_factory
from lerobot_zenoh.pipelines.planner import Plan, ServerPlan, Share, Stream, resolved_factory
from lerobot_zenoh.pipelines.profiles import Profiles, dump_profiles, load_profiles
from lerobot_zenoh.protocol.messages import MONITOR_LABELS, SAFETY_LABELS
from lerobot_zenoh.protocol.reasons import OutputKind

#: What a component of each kind answers (`RunnerCapabilities.output`, `Status.output`).
KIND_OUTPUT = {"system1": OutputKind.ACTIONS, "system2": OutputKind.TEXT, "safety": OutputKind.VERDICT,
               "monitor": OutputKind.VERDICT}
#: The labels a verdict component of each kind may answer.
KIND_LABELS = {"safety": list(SAFETY_LABELS), "monitor": list(MONITOR_LABELS)}


def router_endpoint(factory: Factory) -> str:
    """Where the deployment's router listens: every server and robot connects there."""
    return f"tcp/{factory.servers.host}:{factory.servers.port_base}"


def server_endpoint(factory: Factory, index: int) -> str:
    """Where server `index` is reached: through the router (servers listen nowhere)."""
    return router_endpoint(factory)


def router_command(factory: Factory) -> list[str]:
    """The deployment's router (servers.sh's first line)."""
    return ["lerobot-zenoh-router", f"--zenoh.listen={router_endpoint(factory)}", "--zenoh.multicast_scouting=false"]


def application_tag(server: ServerPlan) -> str:
    kinds = sorted({sh.stream.kind for sh in server.shares}
                   | {"system2" for sh in server.shares if sh.stream.text_component})
    return f"{'+'.join(kinds)}-srv{server.index}"


def server_manifest(factory: Factory, plan: Plan, server: ServerPlan) -> dict:
    served = factory.models[server.model]
    entry: dict = {"model_id": served.model_id, "model_version": served.model_version,
                   "application_tag": application_tag(server), "device": factory.servers.device,
                   "fps": served.fps, "max_batch_size": server.batch_size,
                   "accept_unknown_clients": False,
                   "clients": [{"client_uuid": rid} for sh in server.shares for rid in sh.robot_ids]}
    pipeline = pipeline_block(factory, server)
    outputs = {KIND_OUTPUT[factory.tasks[p["task"]].components[p["component"]].kind] for p in pipeline}
    if len(outputs) > 1:
        raise ConfigError(f"server {server.index} ({server.model})",
                          f"serves components that answer different things ({', '.join(sorted(outputs))}); "
                          "a server answers one kind: give each its own model entry in the factory")
    if served.pretrained_path is not None:
        entry["pretrained_path"] = served.pretrained_path
        if served.tokenizer_path is not None:
            entry["tokenizer_path"] = served.tokenizer_path
        if served.language is not None:
            entry["language"] = dict(served.language)
        elif any("text" in p for p in pipeline):
            raise ConfigError(f"models.{server.model}.language",
                              f"server {server.index} serves system1 and system2 of a task from one stream, but "
                              f"{server.model!r} has no language block (a pi05 checkpoint answering text)")
        if served.vlm is not None:
            entry["vlm"] = {"output": outputs.pop().value, **served.vlm} if outputs else dict(served.vlm)
    else:
        entry["synthetic"] = {"output": outputs.pop().value, **served.synthetic} if outputs else dict(served.synthetic)
    entry["pipeline"] = pipeline
    if served.actions_per_chunk is not None:
        entry["actions_per_chunk"] = served.actions_per_chunk
    return {"cluster_uuid": factory.cluster_uuid, "experiment_tag": factory.experiment_tag,
            "server_id": f"srv{server.index}",
            "zenoh": {"mode": "client", "connect": [router_endpoint(factory)], "multicast_scouting": False},
            "server": [entry]}


def pipeline_block(factory: Factory, server: ServerPlan) -> list[dict]:
    """The manifest's `pipeline` items of one server: one per task it serves a component of, with the
    component's bit (its position in the task descriptor), prompt and (safety, monitor) labels."""
    items: dict[str, dict] = {}
    for sh in server.shares:
        task = factory.tasks[sh.stream.task]
        comp = task.components[sh.stream.component]
        item = {"task": task.name, "component": sh.stream.component,
                "bit": list(task.components).index(sh.stream.component)}
        if comp.prompt:
            item["prompt"] = comp.prompt
        if comp.kind in KIND_LABELS:
            item["labels"] = KIND_LABELS[comp.kind]
        if sh.stream.text_component:  # System 2 from the same prefill (a pi0.5 `language` entry)
            s2 = task.components[sh.stream.text_component]
            item["text"] = {"component": sh.stream.text_component,
                            "bit": list(task.components).index(sh.stream.text_component)}
            if s2.prompt:
                item["text"]["prompt"] = s2.prompt
        known = items.setdefault(task.name, item)
        if known["component"] != item["component"]:
            raise ConfigError(f"server {server.index} ({server.model})",
                              f"serves two components of task {task.name!r} ({known['component']}, "
                              f"{item['component']}); a server serves one component per task")
    return list(items.values())


def client_args(factory: Factory, plan: Plan, robot: str) -> list[str]:
    """The System 1 client of one robot: its server, app key, control rate, chunk length, and the
    robot flags of its fleet class (the defaults for a task admitted without one)."""
    task = factory.tasks[plan.robot_task[robot]]
    fleet_class = _fleet_class(factory, task.name)
    s1_name, s1 = task.component("system1")
    server = plan.servers[plan.routing[robot][s1_name]]
    served = factory.models[s1.model]
    actions = max(1, round(task.action_period_ms * served.fps / 1000.0))
    args = [f"--robot.type={fleet_class.robot_type}", f"--client_uuid={robot}", f"--cluster_uuid={factory.cluster_uuid}",
            f"--experiment_tag={factory.experiment_tag}", f"--model_id={served.model_id}",
            f"--model_version={served.model_version}", f"--application_tag={application_tag(server)}",
            f"--endpoint={server_endpoint(factory, server.index)}", f"--fps={served.fps}",
            f"--actions_per_chunk={actions}", "--send.max_in_flight=1"]
    if s1.prompt:
        args.append(f"--task={s1.prompt}")
    return args + list(fleet_class.client_args)


def _fleet_class(factory: Factory, task: str) -> FleetClass:
    """The task's fleet class; the defaults for a task admitted into the fleet without one."""
    return next((c for c in factory.fleet if c.task == task), None) or FleetClass(task=task, robots=1)


def client_command(factory: Factory, plan: Plan, robot: str, plan_path: str | Path) -> str:
    """One robot's line of clients.sh (and of admitted.sh): `lerobot-robot-client` and its
    `pipeline_client_args`, reading the deployment's plan.json at `plan_path`."""
    return shlex.join(["lerobot-robot-client", *pipeline_client_args(factory, plan, robot, plan_path)])


def plan_document(factory: Factory, plan: Plan) -> dict:
    doc = plan.summary()
    doc["cluster_uuid"], doc["experiment_tag"] = factory.cluster_uuid, factory.experiment_tag
    doc["tasks"] = {name: factory.tasks[name].model_dump(mode="json", exclude_none=True, exclude={"name"})
                    for name in sorted(set(plan.robot_task.values()))}
    doc["robots"] = {rid: {"task": plan.robot_task[rid], **_robot_timing(factory, plan, rid), "routes": {
        comp: {"server": idx, "endpoint": server_endpoint(factory, idx),
               "kind": factory.tasks[plan.robot_task[rid]].components[comp].kind,
               "model_id": factory.models[plan.servers[idx].model].model_id,
               "model_version": factory.models[plan.servers[idx].model].model_version,
               "application_tag": application_tag(plan.servers[idx]),
               "rate_hz": round(_rate(factory, plan, rid, comp), 6)} for comp, idx in routes.items()}}
        for rid, routes in plan.routing.items()}
    return doc


def _robot_timing(factory: Factory, plan: Plan, robot: str) -> dict:
    """The robot's control rate (its System 1 model's fps) and chunk length (t_act x fps)."""
    task = factory.tasks[plan.robot_task[robot]]
    served = factory.models[task.component("system1")[1].model]
    return {"fps": served.fps, "actions_per_chunk": max(1, round(task.action_period_ms * served.fps / 1000.0))}


def pipeline_client_args(factory: Factory, plan: Plan, robot: str, plan_path: str | Path) -> list[str]:
    """The pipeline client of one robot: the plan gives its task, routes, rates, fps and chunk length;
    the command adds the robot flags of its fleet class."""
    fleet_class = _fleet_class(factory, plan.robot_task[robot])
    return [f"--pipeline.plan={plan_path}", f"--client_uuid={robot}", f"--robot.type={fleet_class.robot_type}",
            "--send.max_in_flight=1", *fleet_class.client_args]


def _rate(factory: Factory, plan: Plan, robot: str, component: str) -> float:
    task = factory.tasks[plan.robot_task[robot]]
    comp = task.components[component]
    f = plan.rates_hz[task.name]
    if comp.kind == "system1":
        return f
    if comp.kind == "system2":
        return f / comp.invocation.every_n_chunks
    return comp.invocation.rate_hz


def manifest_path(output: str | Path, index: int) -> Path:
    return Path(output) / "manifests" / f"srv{index}.yaml"


def pid_path(output: str | Path, index: int) -> Path:
    """Where server `index` started by servers.sh writes its process id (`--pid_file`)."""
    return Path(output) / "run" / f"srv{index}.pid"


def write_deployment(factory: Factory, plan: Plan, output: str | Path, profiles: Profiles | None = None) -> Path:
    """Write the deployment of `plan` (module docstring). A task's `combined_model` is written as the
    plan decided it (`planner.resolved_factory`), factory.yaml included."""
    factory = resolved_factory(factory, plan)
    out = Path(output)
    (out / "manifests").mkdir(parents=True, exist_ok=True)
    server_lines, client_lines = [shlex.join(router_command(factory)) + " &"], []
    for s in plan.servers:
        path = manifest_path(out, s.index)
        path.write_text(yaml.safe_dump(server_manifest(factory, plan, s), sort_keys=False))
        server_lines.append(shlex.join(["lerobot-policy-server", f"--manifest={path}",
                                        f"--pid_file={pid_path(out, s.index)}"]) + " &")
    for rid in plan.routing:
        client_lines.append(client_command(factory, plan, rid, out / "plan.json") + " &")
    head = "#!/bin/sh\n# generated by lerobot-zenoh-plan\n"
    (out / "servers.sh").write_text(head + "\n".join(server_lines) + "\nwait\n")
    (out / "clients.sh").write_text(head + "\n".join(client_lines) + "\nwait\n")
    (out / "plan.json").write_text(json.dumps(plan_document(factory, plan), indent=1) + "\n")
    # What admission needs later: the inputs as planned (tasks inline) and the plan at full precision.
    (out / "factory.yaml").write_text(yaml.safe_dump(factory.model_dump(mode="json", exclude_none=True),
                                                     sort_keys=False))
    if profiles is not None:
        (out / "profiles.yaml").write_text(dump_profiles(profiles))
    (out / "plan_state.json").write_text(json.dumps(plan_state(plan)) + "\n")
    return out


# -- admission into a running deployment (lerobot-zenoh-admit) ----------------------------------------

def plan_state(plan: Plan) -> dict:
    """The plan as JSON, exactly (floats round-trip): every server's shares with their streams and robots."""
    return asdict(plan)


def plan_from_state(doc: dict) -> Plan:
    servers = [ServerPlan(s["index"], s["model"], s["role"], s["batch_size"],
                          [Share(Stream(**sh["stream"]), sh["robots"], list(sh["robot_ids"])) for sh in s["shares"]],
                          s["mean_ms"], dict(s["slo_ms"])) for s in doc["servers"]]
    return Plan(servers, dict(doc["rates_hz"]), {r: dict(c) for r, c in doc["routing"].items()},
                dict(doc["robot_task"]), doc["objective"], doc["throughput_hz"], doc["solve_s"], doc["search_steps"],
                dict(doc.get("combined", {})), dict(doc.get("choices", {})))


def load_deployment(output: str | Path) -> tuple[Factory, Profiles, Plan]:
    """The factory, profiles and plan a deployment was written from (ConfigError naming a missing file)."""
    out = Path(output)
    for name in ("factory.yaml", "profiles.yaml", "plan_state.json"):
        if not (out / name).is_file():
            raise ConfigError("deployment", f"{out / name} is missing: re-plan with lerobot-zenoh-plan --output={out} "
                                            "(it writes what admission reads)")
    try:
        state = plan_from_state(json.loads((out / "plan_state.json").read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError("deployment", f"{out / 'plan_state.json'} is not a plan: {exc}") from None
    return load_factory(out / "factory.yaml"), load_profiles(out / "profiles.yaml"), state


def apply_admission(factory: Factory, before: Plan, after: Plan, robot: str, output: str | Path) -> list[int]:
    """Write an admitted robot into a deployment: the manifests of the servers that changed (their
    client lists, batch sizes), plan.json, plan_state.json, and the robot's client line appended to
    admitted.sh. Each file is replaced atomically (a server reloading never reads half a manifest).
    Returns the indices of the servers whose manifests changed, for them to be told (SIGHUP)."""
    out = Path(output)
    changed = [s.index for s, t in zip(before.servers, after.servers, strict=True)
               if server_manifest(factory, before, s) != server_manifest(factory, after, t)]
    for index in changed:
        _replace(manifest_path(out, index),
                 yaml.safe_dump(server_manifest(factory, after, after.servers[index]), sort_keys=False))
    _replace(out / "plan.json", json.dumps(plan_document(factory, after), indent=1) + "\n")
    _replace(out / "plan_state.json", json.dumps(plan_state(after)) + "\n")
    script = out / "admitted.sh"
    lines = (script.read_text().splitlines() if script.is_file()
             else ["#!/bin/sh", "# robots admitted by lerobot-zenoh-admit into the running fleet", "wait"])
    if lines and lines[-1] == "wait":
        lines.pop()
    _replace(script, "\n".join([*lines, client_command(factory, after, robot, out / "plan.json") + " &", "wait"])
             + "\n")
    return changed


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
