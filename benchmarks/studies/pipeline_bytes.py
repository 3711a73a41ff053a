"""Bytes a robot sends per control decision for a multi-model task: published once vs once per component.

    PYTHONPATH=. python -m benchmarks.studies.pipeline_bytes [--seconds 8] [--cameras 96x128]

Side by side in one run, for each task below: the real `PipelineClient` (the sim robot, 2 cameras,
30 Hz) connected in Zenoh client mode to a Zenoh router on loopback, its component servers (stand-ins
in this process: they answer status with the right `output`, System 1 with a chunk, System 2 with a
text, safety and monitor with `safe` / `ongoing`, at once) connected to the same router on a second
port, so that the robot's port carries only the robot's traffic.

- **pipeline**: each observation is published once on the task's stream, on the key naming the components it
  asks (`.../obs/c0/c2`, `ClientKey.obs_for`);
- **naive**: the same client and decisions, but each observation is put once per component it asks,
  on that component's own key (`<app>/<robot>/obs`), as a deployment without the shared stream would.

With `--links`, the layouts of a generated deployment instead, bytes counted on **every link** by
a byte-counting TCP relay in front of each listener (no root needed): *peer*, the layout the planner
used to write (the robot a Zenoh peer with one link to each component's server, each server
listening on its own port), and *router*, the layout it writes now (`pipelines/deployment.py`: one
Zenoh router; the robot and every server connect to it in client mode). Each component's stand-in
server is its own Zenoh session, so that each has a link of its own. Gossip scouting is off in
every session so that no link bypasses a relay.

Measured: the robot's bytes on the link, from iptables byte counters on the router's robot port
(`-o lo --dport`, IP and TCP headers included; root needed, else skipped), and the observation bytes
handed to Zenoh (payload + header attachment). A *decision* is one capture that asks at least one
component (one put with the pipeline). Tasks: `assemble_kit` (Rosa's P4 as in factories/mix2.yaml:
System 1 per 200 ms chunk, System 2 every 10 chunks, safety 2 Hz, monitor 0.5 Hz) and `dense` (the
same four components, safety and monitor at 5 Hz, i.e. at System 1's rate).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np


from testbed.ports import free_port  # noqa: E402
from lerobot_zenoh.protocol import codec  # noqa: E402
from lerobot_zenoh.protocol.keys import AppKey, pipeline_app  # noqa: E402
from lerobot_zenoh.protocol.messages import ActionChunk, Status, TextResult, Verdict  # noqa: E402
from lerobot_zenoh.transport.session import ACTION_QOS, OBSERVATION_QOS, ZenohSession  # noqa: E402
from lerobot_zenoh.transport.settings import ZenohSettings  # noqa: E402

FACTORY = Path(__file__).resolve().parents[2] / "factories" / "mix2.yaml"
OUTPUT = {"system1": "actions", "system2": "text", "safety": "verdict", "monitor": "verdict"}
TOPIC = {"system1": "action", "system2": "text", "safety": "verdict", "monitor": "verdict"}


def tasks():
    import yaml

    from lerobot_zenoh.pipelines.descriptor import parse_task

    kit = yaml.safe_load(FACTORY.read_text())["tasks"]["assemble_kit"]
    dense = {**kit, "components": {k: dict(v) for k, v in kit["components"].items()}}
    for name in ("safety", "progress"):
        dense["components"][name]["invocation"] = {"rate_hz": 5}
    return {"assemble_kit": parse_task({**kit, "name": "assemble_kit"}),
            "dense": parse_task({**dense, "name": "dense"})}


class StandInServers:
    """Every component's server of one task in one Zenoh session (client of the router): status on its
    app key, answers on its topic; reads the shared stream as the servers do (each component the
    observations whose key names it, and those on the plain key whose header asks it) and every
    per-component key."""

    def __init__(self, task, cluster, experiment, router_port, cameras):
        self.task, self.cameras = task, cameras
        self.apps = {name: AppKey(cluster, experiment, f"m-{name}", "v1", f"{c.kind}-srv{i}")
                     for i, (name, c) in enumerate(task.components.items())}
        self.bits = {name: i for i, name in enumerate(task.components)}
        self.stream = pipeline_app(cluster, experiment, task.name)
        self.settings = ZenohSettings(mode="client", connect=[f"tcp/127.0.0.1:{router_port}"], multicast_scouting=False)
        self._inbox: queue.Queue = queue.Queue()

    def __enter__(self):
        self.session = ZenohSession(self.settings).open()
        for name, app in self.apps.items():
            kind = self.task.components[name].kind
            status = Status(model_id=app.model, model_version=app.version, expected_cameras=dict(self.cameras),
                            action_dim=6, max_actions_per_chunk=50, observation_features={}, server_id=name,
                            state_dim=6, fps=30, accepts_unknown_clients=True, client_admitted=True,
                            output=OUTPUT[kind])
            self.session.serve(app.status, lambda params, s=status: codec.encode(s), with_parameters=True)
            self.session.subscribe(app.all_observations, lambda k, b, a, n=name: self._inbox.put((n, b)),
                                   with_attachment=True)
        self.session.subscribe(self.stream.all_observations, self._on_stream, with_attachment=True)
        for name, bit in self.bits.items():
            self.session.subscribe(self.stream.component_observations(bit),
                                   lambda k, b, a, n=name: self._inbox.put((n, b)), with_attachment=True)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _on_stream(self, key, payload, attachment):
        header = codec.decode_observation_header(attachment)
        for name, bit in self.bits.items():
            if header is None or header.component_mask is None or header.component_mask >> bit & 1:
                self._inbox.put((name, payload))

    def _run(self):
        pubs = {}
        while (item := self._inbox.get()) is not None:
            name, payload = item
            obs = codec.decode_observation(payload)
            kind = self.task.components[name].kind
            msg = (ActionChunk(obs.seq_id, 1.0, np.zeros((50, 6), np.float32)) if kind == "system1" else
                   TextResult(obs.seq_id, "next subtask", 1.0) if kind == "system2" else
                   Verdict(obs.seq_id, "safe" if kind == "safety" else "ongoing", 1.0))
            key = f"{self.apps[name].prefix}/{obs.client_uuid}/{TOPIC[kind]}"
            if key not in pubs:
                pubs[key] = self.session.publisher(key, ACTION_QOS)
            pubs[key].put(codec.encode(msg))

    def __exit__(self, *exc):
        self._inbox.put(None)
        self._thread.join(2)
        self.session.close()


class Tally:
    """Observations the client put (decisions), the puts they became and their bytes, in all."""

    def __init__(self):
        self.decisions = self.puts = self.bytes = 0


class CountingPublisher:
    """What the client's publisher thread puts, counted in `tally` (observation payload + header
    attachment); in `naive` mode each put becomes one put per asked component on that component's own
    key."""

    def __init__(self, session, stream_pub, component_keys: list[str] | None, tally: Tally):
        self.stream_pub = stream_pub
        self.fanout = None if component_keys is None else [session.publisher(k, OBSERVATION_QOS) for k in component_keys]
        self.tally = tally

    def put(self, payload: bytes, attachment: bytes | None = None) -> None:
        self.tally.decisions += 1
        size = len(payload) + len(attachment or b"")
        if self.fanout is None:
            targets = [self.stream_pub]
        else:
            mask = codec.decode_observation_header(attachment).component_mask
            targets = [p for i, p in enumerate(self.fanout) if mask >> i & 1]
        for pub in targets:
            pub.put(payload, attachment)
            self.tally.puts += 1
            self.tally.bytes += size


class CountingSession:
    """The client's session, its observation publishers (on `obs_key`, and the keys naming components
    under it) replaced by CountingPublishers, all counted in `counting`."""

    def __init__(self, session, obs_key: str, component_keys: list[str] | None):
        self._session, self._obs_key, self._keys = session, obs_key, component_keys
        self.counting = Tally()

    def publisher(self, key: str, qos):
        publisher = self._session.publisher(key, qos)
        if key != self._obs_key and not key.startswith(f"{self._obs_key}/"):
            return publisher
        return CountingPublisher(self._session, publisher, self._keys, self.counting)

    def __getattr__(self, name):
        return getattr(self._session, name)


class IptablesCounter:
    """Bytes sent to one loopback TCP port (the router's robot port), from an iptables OUTPUT rule."""

    def __init__(self, port: int):
        self.rule = ["OUTPUT", "-o", "lo", "-p", "tcp", "--dport", str(port), "-m", "comment", "--comment",
                     f"lz-pipeline-bytes-{os.getpid()}-{port}", "-j", "ACCEPT"]

    @staticmethod
    def available() -> bool:
        return os.geteuid() == 0 and shutil.which("iptables") is not None

    def __enter__(self):
        subprocess.run(["iptables", "-I", *self.rule], check=True)
        return self

    def bytes(self) -> int:
        out = subprocess.run(["iptables", "-L", "OUTPUT", "-v", "-x", "-n"], check=True, capture_output=True,
                             text=True).stdout
        comment = self.rule[self.rule.index("--comment") + 1]
        line = next(ln for ln in out.splitlines() if comment in ln)
        return int(line.split()[1])

    def __exit__(self, *exc):
        subprocess.run(["iptables", "-D", *self.rule], check=False)


def run_once(task, mode: str, seconds: float, cameras: dict, use_iptables: bool) -> dict:
    from lerobot.robots import make_robot_from_config

    from lerobot_zenoh.client.config import RobotClientConfig
    from lerobot_zenoh.client.config_sim_robot import SimRobotConfig
    from lerobot_zenoh.client.link import open_session
    from lerobot_zenoh.client.pipeline import PipelineClient
    from lerobot_zenoh.pipelines.robot_plan import RobotPlan, Route

    robot_port, server_port = free_port(), free_port()
    router = ZenohSession(ZenohSettings(mode="router", listen=[f"tcp/127.0.0.1:{robot_port}",
                                                                f"tcp/127.0.0.1:{server_port}"],
                                        multicast_scouting=False)).open()
    cluster, experiment = "bench", f"bytes{os.getpid()}{robot_port}"
    try:
        with StandInServers(task, cluster, experiment, server_port, cameras) as servers:
            endpoint = f"tcp/127.0.0.1:{robot_port}"
            routes = {n: Route(n, c.kind, servers.apps[n], endpoint, None) for n, c in task.components.items()}
            plan = RobotPlan("r1", task, cluster, experiment, routes, fps=30, actions_per_chunk=6)
            s1 = plan.system1.app
            config = RobotClientConfig(robot=SimRobotConfig(cameras=dict(cameras), fps=30), client_uuid="r1",
                                       cluster_uuid=cluster, experiment_tag=experiment, model_id=s1.model,
                                       model_version=s1.version, application_tag=s1.app, endpoint=endpoint,
                                       zenoh=ZenohSettings(multicast_scouting=False), fps=30, actions_per_chunk=6,
                                       telemetry_period_s=0, log_level="WARNING")
            keys = None if mode == "pipeline" else [servers.apps[n].client("r1").obs for n in task.components]
            sessions: list[CountingSession] = []

            def open_counted(settings):  # the client's own session, its observation publisher counted
                sessions.append(CountingSession(open_session(settings, config.discovery_timeout_s),
                                                plan.stream.client("r1").obs, keys))
                return sessions[-1]

            client = PipelineClient(config, make_robot_from_config(config.robot), plan, session_factory=open_counted)
            client.start()
            counter = IptablesCounter(robot_port) if use_iptables else None
            try:
                counting = sessions[-1].counting
                if counter is not None:
                    counter.__enter__()
                client.run(duration_s=seconds)
                link = counter.bytes() if counter is not None else None
            finally:
                if counter is not None:
                    counter.__exit__()
                client.close()
            figures = client.pipeline_figures()
    finally:
        router.close()
    d = max(counting.decisions, 1)
    return {"task": task.name, "mode": mode, "seconds": seconds, "decisions": counting.decisions,
            "puts": counting.puts, "observation_bytes": counting.bytes,
            "observation_bytes_per_decision": round(counting.bytes / d),
            "link_bytes": link, "link_bytes_per_decision": None if link is None else round(link / d),
            "link_bytes_per_s": None if link is None else round(link / seconds),
            "requests": {n: figures[f"slo.{n}.requests"] for n in task.components},
            "missed": {n: figures[f"slo.{n}.missed"] for n in task.components}}


# -- --links: bytes on every link of a deployment's layout --------------------------------------------


class ByteRelay:
    """A TCP relay from a port of its own to `target_port` on loopback, counting the bytes it carries
    each way (`up`: towards the target). One relay per link measured."""

    def __init__(self, target_port: int):
        import socket

        self.target_port = target_port
        self.up = self.down = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        import socket

        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            target = socket.create_connection(("127.0.0.1", self.target_port))
            self._sockets += [conn, target]
            threading.Thread(target=self._pump, args=(conn, target, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(target, conn, "down"), daemon=True).start()

    def _pump(self, src, dst, way: str):
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
            except OSError:
                break
            with self._lock:
                setattr(self, way, getattr(self, way) + len(data))
        for sock in (src, dst):
            try:
                sock.close()
            except OSError:
                pass

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self.up, self.down

    def close(self):
        for sock in self._sockets:
            try:
                sock.close()
            except OSError:
                pass


NO_GOSSIP = {"scouting/gossip/enabled": "false"}


def run_links(task, layout: str, seconds: float, cameras: dict) -> dict:
    """One run of `layout` ("peer" or "router"): bytes on the robot's link(s) and on each server's."""
    from lerobot.robots import make_robot_from_config

    from lerobot_zenoh.client.config import RobotClientConfig
    from lerobot_zenoh.client.config_sim_robot import SimRobotConfig
    from lerobot_zenoh.client.link import open_session
    from lerobot_zenoh.client.pipeline import PipelineClient
    from lerobot_zenoh.pipelines.robot_plan import RobotPlan, Route

    cluster, experiment = "bench", f"links{os.getpid()}{free_port()}"
    names = list(task.components)
    relays: dict[str, ByteRelay] = {}  # link name -> its relay
    sessions: list[ZenohSession] = []
    router = None
    try:
        stand_ins = {n: StandInServers(task, cluster, experiment, 0, cameras) for n in names}
        if layout == "router":
            router_port = free_port()
            router = ZenohSession(ZenohSettings(mode="router", listen=[f"tcp/127.0.0.1:{router_port}"],
                                                multicast_scouting=False, json5_overrides=NO_GOSSIP)).open()
            relays["robot"] = ByteRelay(router_port)
            for n in names:
                relays[n] = ByteRelay(router_port)
                stand_ins[n].settings = ZenohSettings(mode="client", connect=[f"tcp/127.0.0.1:{relays[n].port}"],
                                                      multicast_scouting=False, json5_overrides=NO_GOSSIP)
            endpoints = {n: f"tcp/127.0.0.1:{relays['robot'].port}" for n in names}
        else:
            endpoints = {}
            for n in names:
                port = free_port()
                stand_ins[n].settings = ZenohSettings(mode="peer", listen=[f"tcp/127.0.0.1:{port}"],
                                                      multicast_scouting=False, json5_overrides=NO_GOSSIP)
                relays[n] = ByteRelay(port)
                endpoints[n] = f"tcp/127.0.0.1:{relays[n].port}"
        for n in names:
            stand_ins[n].apps = {n: AppKey(cluster, experiment, f"m-{n}", "v1", f"{task.components[n].kind}-srv")}
            stand_ins[n].bits = {n: names.index(n)}
            stand_ins[n].__enter__()
            sessions.append(stand_ins[n])
        routes = {n: Route(n, c.kind, stand_ins[n].apps[n], endpoints[n], None) for n, c in task.components.items()}
        plan = RobotPlan("r1", task, cluster, experiment, routes, fps=30, actions_per_chunk=6)
        s1 = plan.system1.app
        config = RobotClientConfig(robot=SimRobotConfig(cameras=dict(cameras), fps=30), client_uuid="r1",
                                   cluster_uuid=cluster, experiment_tag=experiment, model_id=s1.model,
                                   model_version=s1.version, application_tag=s1.app, endpoint=endpoints[names[0]],
                                   zenoh=ZenohSettings(multicast_scouting=False, json5_overrides=NO_GOSSIP), fps=30,
                                   actions_per_chunk=6, telemetry_period_s=0, log_level="WARNING")
        counted: list[CountingSession] = []

        def open_counted(settings):  # the client's own session, its observation publisher counted
            counted.append(CountingSession(open_session(settings, config.discovery_timeout_s),
                                           plan.stream.client("r1").obs, None))
            return counted[-1]

        client = PipelineClient(config, make_robot_from_config(config.robot), plan, session_factory=open_counted)
        client.start()
        try:
            counting = counted[-1].counting
            before = {k: r.counts() for k, r in relays.items()}
            client.run(duration_s=seconds)
            after = {k: r.counts() for k, r in relays.items()}
        finally:
            client.close()
        figures = client.pipeline_figures()
    finally:
        for stand_in in sessions:
            stand_in.__exit__(None, None, None)
        if router is not None:
            router.close()
        for relay in relays.values():
            relay.close()
    # Observation bytes travel robot -> server: "up" on a robot link, "down" on a router-to-server one.
    links = {}
    for k in relays:
        up, down = (a - b for a, b in zip(after[k], before[k], strict=True))
        links[k] = {"to_server": down if (layout == "router" and k != "robot") else up,
                    "from_server": up if (layout == "router" and k != "robot") else down}
    return {"task": task.name, "layout": layout, "seconds": seconds, "decisions": counting.decisions,
            "observation_bytes": counting.bytes, "links": links,
            "requests": {n: figures[f"slo.{n}.requests"] for n in names}}


def print_links(rows: list[dict]) -> None:
    for r in rows:
        obs = r["observation_bytes"]
        robot_links = ["robot"] if r["layout"] == "router" else list(r["requests"])
        uplink = sum(r["links"][k]["to_server"] for k in robot_links)
        print(f"{r['task']:<14}{r['layout']:<8} observations handed to Zenoh {obs / 1000:,.0f} kB "
              f"({r['decisions']} decisions); requests {r['requests']}")
        for k, v in r["links"].items():
            side = "robot -> router" if k == "robot" else (f"router -> {k}" if r["layout"] == "router"
                                                            else f"robot -> {k}")
            print(f"    {side:<22}{v['to_server'] / 1000:>10,.0f} kB  ({v['to_server'] / max(obs, 1):.2f}x the "
                  f"observations)")
        print(f"    robot's own link(s) in all: {uplink / 1000:,.0f} kB ({uplink / max(obs, 1):.2f}x)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--cameras", default="96x128", help="HxW of each of the two cameras")
    parser.add_argument("--no-iptables", action="store_true", help="count Zenoh-level bytes only")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--links", action="store_true",
                        help="bytes on every link of the peer and router layouts of a generated deployment")
    args = parser.parse_args(argv)
    h, w = (int(x) for x in args.cameras.split("x"))
    cameras = {"front": (h, w), "wrist": (h, w)}
    if args.links:
        rows = [run_links(task, layout, args.seconds, cameras) for task in tasks().values()
                for layout in ("peer", "router")]
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            print(f"cameras 2 x {h}x{w}, {args.seconds:g} s per run, 30 Hz control; bytes on each link "
                  "(TCP payload, Zenoh framing included)")
            print_links(rows)
        return 0
    use_iptables = not args.no_iptables and IptablesCounter.available()
    if not use_iptables:
        print("iptables byte counters unavailable (needs root and iptables): Zenoh-level bytes only", file=sys.stderr)
    rows = []
    for task in tasks().values():
        for mode in ("pipeline", "naive"):
            rows.append(run_once(task, mode, args.seconds, cameras, use_iptables))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"cameras 2 x {h}x{w}, {args.seconds:g} s per run, 30 Hz control")
    print(f"{'task':<14}{'mode':<10}{'decisions':>10}{'puts':>7}{'obs B/decision':>16}{'link B/decision':>17}"
          f"{'link kB/s':>11}  requests (missed)")
    for r in rows:
        reqs = " ".join(f"{n}:{r['requests'][n]}({r['missed'][n]})" for n in r["requests"])
        link = "-" if r["link_bytes"] is None else f"{r['link_bytes_per_decision']:,}"
        rate = "-" if r["link_bytes"] is None else f"{r['link_bytes_per_s'] / 1000:,.1f}"
        print(f"{r['task']:<14}{r['mode']:<10}{r['decisions']:>10}{r['puts']:>7}"
              f"{r['observation_bytes_per_decision']:>16,}{link:>17}{rate:>11}  {reqs}")
    for name in tasks():
        p, n = (next(r for r in rows if r["task"] == name and r["mode"] == m) for m in ("pipeline", "naive"))
        key = "link_bytes_per_decision" if p["link_bytes"] is not None else "observation_bytes_per_decision"
        print(f"{name}: naive / pipeline bytes per decision = {n[key] / max(p[key], 1):.2f} ({key})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
