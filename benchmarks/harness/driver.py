"""A virtual fleet's driver: its clock, and the chunks and telemetry that reach it.

One thread drives every simulated robot of a run (``benchmarks/harness/robot.py``) on a shared tick;
the Zenoh callbacks only queue ``(key, payload, arrival)`` for it (no work inside a callback).
"""

from __future__ import annotations

import queue
import time


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
