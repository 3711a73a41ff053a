"""Where a benchmark run puts things, the command-line flags every benchmark shares, and the
generated blocks that benchmarks write into docs/benchmarks.md."""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import subprocess
import time
from pathlib import Path

from benchmarks.worker import ROOT


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench"),
                        help="results folder (JSON, PNG, logs); default outputs/bench")
    parser.add_argument("--full", action="store_true",
                        help="the full-length runs (60 s control loops, more round trips, every workload on every link)")
    parser.add_argument("--no-netns", action="store_true", help="host loopback only, even as root")


def wait_until(due: float) -> float:
    """A simulated robot driver's tick: sleep until `due` (``time.perf_counter`` seconds) if it is
    ahead; the time then."""
    now = time.perf_counter()
    if due > now:
        time.sleep(due - now)
        now = time.perf_counter()
    return now


def driver_ticks(t0: float, period: float, w0: float, w1: float, lateness: list[float], stop=None):
    """A virtual fleet's driver clock: yields ``(i, now, counting)`` for tick i, due at ``t0 + i *
    period`` (``wait_until``), `counting` while ``w0 <= now < w1``, and appends how late each counted
    tick woke to `lateness`. Ends before the first tick at which ``stop(now)`` holds (default: the
    window's end, ``now >= w1``)."""
    stop = stop or (lambda now: now >= w1)
    i = 0
    while True:
        due = t0 + i * period
        now = wait_until(due)
        if stop(now):
            return
        counting = w0 <= now < w1
        if counting:
            lateness.append(now - due)
        yield i, now, counting
        i += 1


def telemetry_metrics(telemetry) -> list[tuple[float, dict]]:
    """``(arrival, metrics)`` of every readable telemetry message of ``(arrival, payload)`` pairs (an
    unreadable one is skipped)."""
    from lerobot_zenoh.errors import ProtocolError
    from lerobot_zenoh.protocol import codec

    out = []
    for t, payload in telemetry:
        try:
            out.append((t, dict(codec.decode_telemetry(payload).metrics)))
        except ProtocolError:
            pass
    return out


def deliver_chunks(inbox: queue.SimpleQueue, robots: dict, counters) -> None:
    """Hand every chunk queued since the last tick (``(key, payload, arrival)`` from a Zenoh callback)
    to its robot's ``on_chunk(payload, arrival, counters)``, on the driver's thread; a chunk for a
    client the driver does not know is dropped."""
    deliver(inbox, robots, lambda robot, payload, arrived: robot.on_chunk(payload, arrived, counters))


def deliver(inbox: queue.SimpleQueue, robots: dict, handle) -> None:
    """Hand every message queued since the last tick (``(key, payload, arrival)`` on a client's key)
    to ``handle(robot, payload, arrival)`` for its robot; one for a client not in `robots` is dropped."""
    while True:
        try:
            key, payload, arrived = inbox.get_nowait()
        except queue.Empty:
            return
        robot = robots.get(key.rsplit("/", 2)[-2])
        if robot is not None:
            handle(robot, payload, arrived)


class Run:
    """Output folders of one run: `out/` for results, `out/logs/` for worker logs, `out/work/` as cwd."""

    def __init__(self, out: str):
        self.out = Path(out)
        self.logs = self.out / "logs"
        self.work = self.out / "work"
        for p in (self.out, self.logs, self.work):
            p.mkdir(parents=True, exist_ok=True)

    def write_json(self, name: str, data: dict) -> Path:
        path = self.out / f"{name}.json"
        path.write_text(json.dumps(data, indent=2, default=float))
        return path

    def write_plot(self, name: str, plot, result: dict) -> Path | None:
        """`plot(result, path)` into `out/<name>.png`; without matplotlib (the `bench` extra) one line
        says so and the run still ends well: its numbers are in the JSON and the table."""
        path = self.out / f"{name}.png"
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"(no {path.name}: matplotlib is not installed; pip install '.[bench]' or make bench draws it)")
            return None
        plot(result, path)
        return path


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    versions = {}
    for dist in ("eclipse-zenoh", "lerobot", "grpcio", "opencv-python-headless", "numpy", "msgpack"):
        try:
            from importlib.metadata import version

            versions[dist] = version(dist)
        except Exception:
            versions[dist] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
            "load_avg_at_start": load, "versions": versions, "git_commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def write_docs_block(path: Path, begin: str, end: str, heading: str, content: str) -> None:
    """Replace what lies between the `begin` and `end` markers of a markdown file with `content`
    (the prose around them is the author's); when the markers are missing, append them under `heading`."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{begin}\n\n{content}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + f"\n\n## {heading}\n\n" + block + "\n"
    path.write_text(text)
