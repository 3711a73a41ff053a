"""The fault kit's Zenoh half: floods of a key, and hostile replies to queries, beside an honest robot.

In plain mode any peer can put anything on any key and answer any query. Every Zenoh-facing
subscriber that takes input from other processes gets the same faults from here:

- payload makers (`PAYLOADS`, each `maker(i) -> bytes` for the i-th put): random bytes, truncated
  MessagePack of a real message, deeply nested MessagePack, a huge message (just over a limit), and
  valid-looking messages of the surface's own type naming ids nobody asked for (`forged(kind, key)`);
- `Flood`: puts on one key from a Zenoh session of its own, as fast as it can (line rate) or at a
  set rate, for a number of seconds, on a thread; with `block=True` (congestion control BLOCK on a
  loopback link) every put reaches the subscriber, so a test can check that every one was counted.
  `FloodProcess` (`python -m testbed.fault_kit.zenoh --port P --key K --payload KIND --seconds S`) runs one
  in a process of its own (measured runs: the flooder must not share a Python lock with what it floods);
- `HostileReplies`: a queryable answering every query on a key with a maker's payloads (the
  status queries a robot's server watch sends);
- `HonestRobot`: the reference `RobotClient` on the simulated robot, and `Service`, what it got in a
  window: control ticks, empty ticks (nothing to execute: the fail-safe action), chunks, round
  trip p99. A measured run sets an attacked robot beside a control one (`Service.beside`).

Tests import it as `testbed.fault_kit.zenoh`. The TCP half (sockets) is `testbed.fault_kit.tcp`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import numpy as np
import zenoh

from lerobot_zenoh.protocol import codec, dispatch
from lerobot_zenoh.protocol.messages import Observation, Telemetry

Maker = Callable[[int], bytes]

#: Puts between two checks of the stop event and the rate (a flood's loop stays tight).
BURST = 64


# ----------------------------------------------------------------------------- payload makers


def random_bytes(size: int = 256, seed: int = 0) -> Maker:
    rng = random.Random(seed)
    return lambda i: rng.randbytes(rng.randint(1, size))


def truncated(template: bytes) -> Maker:
    """A real message cut at every length in turn (never whole)."""
    return lambda i: template[: i % max(len(template), 1)]


def nested(depth: int = 100_000) -> Maker:
    """MessagePack arrays (and maps, every other put) nested `depth` deep: a few bytes per level."""
    arrays = b"\x91" * depth + b"\xc0"
    maps = b"\x81\xa1k" * depth + b"\xc0"
    return lambda i: arrays if i % 2 == 0 else maps


def huge(size: int) -> Maker:
    """A MessagePack map whose one binary value makes it `size` bytes: above the surface's limit."""
    body = msgpack.packb({"protocol_version": [1, 0], "type": "x", "blob": b"\0" * size}, use_bin_type=True)
    return lambda i: body


def forged(kind: str, key: str, *, edge_incarnation: str = "forged-edge") -> Maker:
    """Valid-looking messages of the type `key` carries, naming ids nobody asked for (the i-th put
    names request, client, seq ... i): `answer` (an engine answer of the engine the key names, to a
    request this scheduler never sent, of scheduler process `edge_incarnation`: a peer that reads
    the engine's dispatch key learns the real one), `observation` (from an invented client), `beat`
    (a heartbeat of an invented server), `telemetry` (of an invented member)."""
    if kind == "answer":
        engine_id = key.rstrip("/").split("/")[-2]
        actions = np.zeros((20, 6), np.float32)
        return lambda i: dispatch.encode(dispatch.EngineAnswer(
            10**12 + i, engine_id, "forged", "m", "v1", edge_incarnation, f"robot{i}", i, actions=actions,
            inference_ms=1.0))
    if kind == "observation":
        jpeg = codec.encode_jpeg(np.zeros((48, 64, 3), np.uint8), 80)
        state = np.zeros(6, np.float32)
        return lambda i: codec.encode(Observation(i + 1, f"intruder{i % 100_000}", state, {"front": jpeg}, "pick"))
    if kind in ("beat", "telemetry"):
        return lambda i: codec.encode(Telemetry("server", f"intruder{i % 1000}", i, 1.0, 0.1,
                                                {"serving": 1, "served": i, "waiting": 0, "slowest_turn_s": 0.01},
                                                labels={"incarnation": f"x{i}"}))
    raise ValueError(f"no forged {kind!r}")


def payload(name: str, key: str, *, template: bytes | None = None, limit_bytes: int = 16 << 20,
            forged_kind: str = "answer") -> Maker:
    """The maker named `name` (`PAYLOADS`) for floods of `key`."""
    if name == "random":
        return random_bytes()
    if name == "truncated":
        return truncated(template if template is not None else forged(forged_kind, key)(0))
    if name == "nested":
        return nested()
    if name == "huge":
        return huge(limit_bytes + 1)
    if name == "wrong_ids":
        return forged(forged_kind, key)
    raise ValueError(f"unknown payload {name!r}; one of {', '.join(PAYLOADS)}")


PAYLOADS = ("random", "truncated", "nested", "huge", "wrong_ids")


# ----------------------------------------------------------------------------- floods


def open_session(port: int) -> zenoh.Session:
    """A peer session on loopback that connects to `port` (scouting off)."""
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import loopback_settings

    return ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()


class Flood:
    """Puts `maker(i)` on `key` (or on `key_of(i)`) from its own session connected to `port`, as
    fast as it can or at `rate_hz`, for `seconds` or until `stop()`; `sent` counts the puts.
    `block`: congestion control BLOCK (every put reaches a subscriber on a loopback link; the
    flooder slows down to what the subscriber takes); otherwise DROP (line rate: Zenoh drops what
    the link cannot carry). A context manager: started on entry, stopped and closed on exit."""

    def __init__(self, port: int, key: str, maker: Maker, *, seconds: float | None = None, rate_hz: float | None = None,
                 block: bool = False, key_of: Callable[[int], str] | None = None, attachment: Maker | None = None):
        self.port, self.key, self.maker, self.seconds, self.rate_hz = port, key, maker, seconds, rate_hz
        self.block, self.key_of, self.attachment = block, key_of, attachment
        self.sent = 0
        self.elapsed_s = 0.0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._session = None
        self._thread = threading.Thread(target=self._run, name="fault-kit-flood", daemon=True)

    def __enter__(self) -> Flood:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> Flood:
        self._session = open_session(self.port)
        self._thread.start()
        return self

    def wait(self, timeout_s: float | None = None) -> Flood:
        self._thread.join(timeout_s)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(30)
        if self._session is not None:
            self._session.close()
            self._session = None

    def _run(self) -> None:
        put = self._session.raw.put
        cc = zenoh.CongestionControl.BLOCK if self.block else zenoh.CongestionControl.DROP
        t0 = time.monotonic()
        end = math.inf if self.seconds is None else t0 + self.seconds
        i = 0
        try:
            while not self._stop.is_set():
                for _ in range(BURST):
                    key = self.key if self.key_of is None else self.key_of(i)
                    attachment = None if self.attachment is None else self.attachment(i)
                    put(key, self.maker(i), congestion_control=cc, attachment=attachment)
                    i += 1
                self.sent = i
                now = time.monotonic()
                if now >= end:
                    break
                if self.rate_hz is not None and (ahead := t0 + i / self.rate_hz - now) > 0:
                    self._stop.wait(ahead)
        except BaseException as exc:  # a closed session at stop, or a bug: kept for the caller
            if not self._stop.is_set():
                self.error = exc
        self.sent = i
        self.elapsed_s = time.monotonic() - t0



class FloodProcess:
    """`Flood` in a process of its own (`python -m testbed.fault_kit.zenoh`), so the flooder's Python work
    never shares a lock with what it floods: the same interface (`wait`, `stop`, `sent`,
    `elapsed_s`, `error`; a context manager). `key_template`: a key per put, `{i}` replaced by its
    number (fresh client ids); `forged_kind`: the message type of `wrong_ids` and `truncated`;
    `payload_file`: put that file's bytes every time instead of `kind`'s (a surface's own lies, made
    by its test)."""

    def __init__(self, port: int, key: str, kind: str, *, seconds: float, forged_kind: str = "answer",
                 key_template: str | None = None, limit_bytes: int = 16 << 20, block: bool = False,
                 payload_file: str | None = None):
        self.sent, self.elapsed_s, self.error = 0, 0.0, None
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
        command = [sys.executable, "-m", "testbed.fault_kit.zenoh", "--port", str(port), "--key", key,
                   "--payload", kind, "--forged", forged_kind, "--seconds", str(seconds),
                   "--limit_bytes", str(limit_bytes)]
        command += ["--key_template", key_template] if key_template else []
        command += ["--block"] if block else []
        command += ["--payload_file", payload_file] if payload_file else []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
        self._proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env, cwd=here)

    def __enter__(self) -> FloodProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait(self, timeout_s: float | None = None) -> FloodProcess:
        try:
            out, _ = self._proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return self
        report = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"error": "no report"}
        self.sent, self.elapsed_s, self.error = report.get("sent", 0), report.get("seconds", 0.0), report.get("error")
        return self

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


class HostileReplies:
    """A queryable on `key` (its own session connected to `port`) answering every query with
    `count` payloads of `maker`, from a thread of its own (no Zenoh call inside a Zenoh callback):
    what a robot's status query meets from a hostile peer."""

    def __init__(self, port: int, key: str, maker: Maker, count: int = 1):
        self.port, self.key, self.maker, self.count = port, key, maker, count
        self.queries = 0
        self._session = None
        self._queryable = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="fault-kit-replies", daemon=True)

    def __enter__(self) -> HostileReplies:
        self._session = open_session(self.port)
        self._queryable = self._session.raw.declare_queryable(self.key, self._queue.put)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._queryable.undeclare()
        self._queue.put(None)
        self._thread.join(10)
        self._session.close()

    def _run(self) -> None:
        while (query := self._queue.get()) is not None:
            n = self.queries
            self.queries += 1
            try:
                for j in range(self.count):
                    query.reply(self.key, self.maker(n * self.count + j))
            except zenoh.ZError:  # the query ended meanwhile
                pass
            finally:
                query.drop()


# ----------------------------------------------------------------------------- the honest robot


@dataclass(frozen=True)
class Service:
    """What an honest robot got in a window."""

    ticks: int
    empty: int  # control ticks with nothing to execute
    chunks: int
    rtt_p99_ms: float | None

    def beside(self, control: Service) -> str:
        """One line: this (attacked) robot against its control."""
        def p99(s: Service) -> str:
            return "-" if s.rtt_p99_ms is None else f"{s.rtt_p99_ms:.0f} ms"
        return (f"empty ticks {self.empty}/{self.ticks} (control {control.empty}/{control.ticks}), chunks {self.chunks} "
                f"(control {control.chunks}), round trip p99 {p99(self)} (control {p99(control)})")


class HonestRobot:
    """The reference `RobotClient` on the simulated robot, serving on `port`'s app `app_key` at
    `fps`; `window()` marks its counters, `service()` says what it got since the mark. `run_s`:
    how long its control loop runs (on a thread of its own) after `start()`; `also_connect`: more
    loopback ports its session connects to (a standby's); `options`: more `RobotClientConfig` fields."""

    def __init__(self, port: int, app_key, *, client_uuid: str = "honest", fps: int = 15, run_s: float = 60.0,
                 cameras: dict | None = None, also_connect: tuple[int, ...] = (), **options):
        from lerobot.robots import make_robot_from_config

        from lerobot_zenoh.client.client import RobotClient
        from lerobot_zenoh.client.config import RobotClientConfig
        from lerobot_zenoh.client.config_sim_robot import SimRobotConfig
        from lerobot_zenoh.transport.settings import ZenohSettings

        cams = dict(cameras or {"front": (48, 64)})
        cfg = RobotClientConfig(robot=SimRobotConfig(cameras=cams, fps=fps), client_uuid=client_uuid,
                                cluster_uuid=app_key.cluster, experiment_tag=app_key.experiment, model_id=app_key.model,
                                model_version=app_key.version, application_tag=app_key.app, task="pick up the red cube",
                                endpoint=f"tcp/127.0.0.1:{port}", fps=fps, zenoh=ZenohSettings(
                                    multicast_scouting=False, connect=[f"tcp/127.0.0.1:{p}" for p in also_connect]),
                                **options)
        self.client = RobotClient(cfg, make_robot_from_config(cfg.robot))
        self.run_s = run_s
        self._thread = threading.Thread(target=lambda: self.client.run(self.run_s), name="honest-robot", daemon=True)
        self._mark = (0, 0, 0, 0)

    def start(self) -> HonestRobot:
        self.client.start()
        self._thread.start()
        return self

    def __enter__(self) -> HonestRobot:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.client.stop()
        self._thread.join(10)
        self.client.close()

    def window(self) -> None:
        c = self.client.counters
        self._mark = (c.steps, c.empty_cycles, c.chunks_received, len(c.rtt_ms))

    def service(self) -> Service:
        c = self.client.counters
        steps, empty, chunks, _ = self._mark
        new_rtts = c.chunks_received - chunks
        rtts = list(c.rtt_ms)[-new_rtts:] if new_rtts > 0 else []
        return Service(c.steps - steps, c.empty_cycles - empty, new_rtts, _p99(rtts))


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))])


# ----------------------------------------------------------------------------- a flood process


def main(argv: list[str] | None = None) -> int:
    """A flood in a process of its own: waits for a line on stdin when `--wait_go`, floods, prints
    {"sent": n, "seconds": s} as one JSON line."""
    ap = argparse.ArgumentParser(description="flood one Zenoh key (the fault kit)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--payload", choices=PAYLOADS, default="wrong_ids")
    ap.add_argument("--forged", default="answer", help="the message type of wrong_ids and truncated")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rate_hz", type=float, default=None, help="default: line rate")
    ap.add_argument("--count", type=int, default=None, help="stop after this many puts")
    ap.add_argument("--wait_go", action="store_true")
    ap.add_argument("--key_template", default=None, help="a key per put, {i} replaced by its number")
    ap.add_argument("--limit_bytes", type=int, default=16 << 20, help="huge: one byte over this")
    ap.add_argument("--block", action="store_true", help="congestion control BLOCK (default DROP: line rate)")
    ap.add_argument("--payload_file", default=None, help="put this file's bytes every time (instead of --payload)")
    args = ap.parse_args(argv)
    maker = payload(args.payload, args.key, forged_kind=args.forged, limit_bytes=args.limit_bytes)
    if args.payload_file:
        with open(args.payload_file, "rb") as f:
            data = f.read()
        maker = lambda i: data  # noqa: E731
    key_of = (lambda i: args.key_template.format(i=i)) if args.key_template else None
    flood = Flood(args.port, args.key, maker, seconds=args.seconds, rate_hz=args.rate_hz, key_of=key_of,
                  block=args.block)
    if args.wait_go:
        sys.stdin.readline()
    flood.start()
    while flood._thread.is_alive():
        flood.wait(0.05)
        if args.count is not None and flood.sent >= args.count:
            break
    flood.stop()
    print(json.dumps({"sent": flood.sent, "seconds": round(flood.elapsed_s, 3),
                      "error": None if flood.error is None else repr(flood.error)}), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
