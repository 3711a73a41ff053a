"""A plan as files that start it: one server manifest per server, one client command per robot.

    <output>/plan.json            rates, placement, batching, routing (every component) and the summary
    <output>/manifests/srvN.yaml  `lerobot-policy-server --manifest=...` for server N
    <output>/servers.sh           one line per server
    <output>/clients.sh           one `lerobot-robot-client --pipeline.plan=plan.json` line per robot

Routing is enforced by the manifests: each server lists exactly the robots routed to it (no unknown
clients) under an application tag of its own (`<kind>-srvN`). Every server entry also has a `pipeline`
block naming, for each task it serves a component of, the task, the component, its bit in an
observation's `component_mask` (its position in the task descriptor) and what the descriptor asks of
it (prompt; labels for safety and monitor): the server then takes the task's robots' observations from
the task's observation stream (docs/pipelines.md). A synthetic or VLM model that does not say its
`output` answers what its component kind needs (system1: actions, system2: text, safety and monitor:
verdict). plan.json also carries what a robot's pipeline client needs (`pipelines/robot_plan.py` reads
it): the key prefix, every task descriptor, and per robot its control rate, chunk length and one route
per component (endpoint, app key, kind, planned request rate).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.pipelines.descriptor import Factory
from lerobot_zenoh.pipelines.planner import Plan, ServerPlan
from lerobot_zenoh.protocol.messages import MONITOR_LABELS, SAFETY_LABELS

#: What a component of each kind answers (`RunnerCapabilities.output`, `Status.output`).
KIND_OUTPUT = {"system1": "actions", "system2": "text", "safety": "verdict", "monitor": "verdict"}
#: The labels a verdict component of each kind may answer.
KIND_LABELS = {"safety": list(SAFETY_LABELS), "monitor": list(MONITOR_LABELS)}


def server_endpoint(factory: Factory, index: int) -> str:
    return f"tcp/{factory.servers.host}:{factory.servers.port_base + index}"


def application_tag(server: ServerPlan) -> str:
    kinds = sorted({sh.stream.kind for sh in server.shares})
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
        if served.vlm is not None:
            entry["vlm"] = {"output": outputs.pop(), **served.vlm} if outputs else dict(served.vlm)
    else:
        entry["synthetic"] = {"output": outputs.pop(), **served.synthetic} if outputs else dict(served.synthetic)
    entry["pipeline"] = pipeline
    if served.actions_per_chunk is not None:
        entry["actions_per_chunk"] = served.actions_per_chunk
    return {"cluster_uuid": factory.cluster_uuid, "experiment_tag": factory.experiment_tag,
            "server_id": f"srv{server.index}",
            "zenoh": {"mode": "peer", "listen": [server_endpoint(factory, server.index)], "multicast_scouting": False},
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
        known = items.setdefault(task.name, item)
        if known["component"] != item["component"]:
            raise ConfigError(f"server {server.index} ({server.model})",
                              f"serves two components of task {task.name!r} ({known['component']}, "
                              f"{item['component']}); a server serves one component per task")
    return list(items.values())


def client_args(factory: Factory, plan: Plan, robot: str) -> list[str]:
    """The System 1 client of one robot: its server, app key, control rate, chunk length, and the
    robot flags of its fleet class."""
    task = factory.tasks[plan.robot_task[robot]]
    fleet_class = factory.fleet_class(task.name)
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
    fleet_class = factory.fleet_class(plan.robot_task[robot])
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


def write_deployment(factory: Factory, plan: Plan, output: str | Path) -> Path:
    out = Path(output)
    (out / "manifests").mkdir(parents=True, exist_ok=True)
    server_lines, client_lines = [], []
    for s in plan.servers:
        path = out / "manifests" / f"srv{s.index}.yaml"
        path.write_text(yaml.safe_dump(server_manifest(factory, plan, s), sort_keys=False))
        server_lines.append(f"lerobot-policy-server --manifest={shlex.quote(str(path))} &")
    for rid in plan.routing:
        client_lines.append(shlex.join(["lerobot-robot-client",
                                        *pipeline_client_args(factory, plan, rid, out / "plan.json")]) + " &")
    head = "#!/bin/sh\n# generated by lerobot-zenoh-plan\n"
    (out / "servers.sh").write_text(head + "\n".join(server_lines) + "\nwait\n")
    (out / "clients.sh").write_text(head + "\n".join(client_lines) + "\nwait\n")
    (out / "plan.json").write_text(json.dumps(plan_document(factory, plan), indent=1) + "\n")
    return out
