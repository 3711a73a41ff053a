"""benchmarks/harness/: the simulated robot follows the client's own rule, the docs-block writer, the
process stopper and the core benchmarks' shared command-line shape. No transport: chunks are made here."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.harness.docs_blocks import write_docs_block
from benchmarks.harness.processes import stop_processes
from benchmarks.harness.results import CoreBenchmark
from benchmarks.harness.robot import SimulatedRobot
from lerobot_zenoh.protocol.messages import ActionChunk
from lerobot_zenoh.scheduling.send_trigger import SendTriggerConfig

DT = 1 / 30


def chunk(seq: int, rows: int = 50, dim: int = 2, **kw) -> ActionChunk:
    actions = np.arange(rows * dim, dtype=np.float32).reshape(rows, dim)
    return ActionChunk(seq, 1.0, actions, **kw)


def test_the_robot_sends_by_the_clients_rule_one_in_flight():
    robot = SimulatedRobot("r1", dt_s=DT)
    first = robot.capture(0.0)
    assert first is not None and (first.seq, first.step, first.depth) == (1, 0, 0)
    assert robot.capture(0.01) is None  # one in flight (the client's max_in_flight)
    result = robot.take(chunk(1), 0.1)
    assert result.accepted and result.rtt_s == pytest.approx(0.1)
    # The client's threshold: p90 of the RTTs + margin_steps control periods.
    assert robot.buffer_time_s() == pytest.approx(0.1 + SendTriggerConfig().margin_steps * DT)
    popped = robot.act()
    assert popped is not None and robot.moving


def test_a_change_to_the_clients_rule_reaches_the_robot(monkeypatch):
    from lerobot_zenoh.scheduling import send_trigger

    monkeypatch.setattr(send_trigger.SendTrigger, "buffer_time_s", lambda self: 123.0)
    assert SimulatedRobot("r1", dt_s=DT).buffer_time_s() == 123.0


def test_observation_carries_the_capture_and_the_session():
    robot = SimulatedRobot("r1", dt_s=DT)
    capture = robot.capture(0.0)
    obs = robot.observation(capture, np.zeros(2, np.float32), task="t", task_elapsed_s=0.5)
    assert (obs.seq_id, obs.client_uuid, obs.task, obs.session_nonce) == (1, "r1", "t", robot.session_nonce)
    assert obs.execution.actions_buffered == 0 and obs.execution.task_elapsed_s == 0.5


def test_refetch_refreshes_the_waiting_request():
    robot = SimulatedRobot("r1", dt_s=DT, send_rule=SendTriggerConfig(refetch_after_s=0.1))
    assert robot.capture(0.0).refreshes is None
    assert robot.capture(0.05) is None
    refresh = robot.capture(0.11)
    assert refresh is not None and refresh.refreshes == 1 and refresh.seq == 2
    result = robot.take(chunk(2), 0.2)
    assert result.accepted and result.request_seq == 1


def test_rtc_capture_carries_the_leftover_and_no_trim_keeps_every_row():
    robot = SimulatedRobot("r1", dt_s=DT, merge="rtc", action_dim=2, rtc_rows=10)
    capture = robot.capture(0.0)
    assert capture.rtc is not None and capture.rtc.prefix.shape == (0, 2)
    plain = SimulatedRobot("r2", dt_s=DT, merge="no_trim", send_rule=SendTriggerConfig(buffer_time_s=10.0))
    plain.capture(0.0)
    plain.take(chunk(1), 0.5)
    for _ in range(5):
        plain.act()
    plain.capture(0.6)
    result = plain.take(chunk(2), 1.0)  # 0.4 s late: blend would trim 12 rows; no_trim keeps all 50
    assert result.accepted and plain.buffer.depth == 50


def test_a_new_task_keeps_the_rtt_and_drops_answers_of_the_last():
    robot = SimulatedRobot("r1", dt_s=DT)
    robot.capture(0.0)
    robot.take(chunk(1), 0.2)
    robot.capture(0.3)
    robot.new_task()
    assert robot.buffer.depth == 0 and robot.episode == 1 and robot.rtt.p90_s == pytest.approx(0.2)
    assert not robot.take(chunk(2), 0.4).accepted
    with pytest.raises(ValueError):
        SimulatedRobot("r1", dt_s=DT, merge="bogus")


def test_docs_block_replaces_between_markers_appends_under_a_heading_or_refuses(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- x:begin -->\nold\n<!-- x:end -->\noutro\n")
    write_docs_block(page, "<!-- x:begin -->", "<!-- x:end -->", "new")
    assert page.read_text() == "intro\n<!-- x:begin -->\nnew\n<!-- x:end -->\noutro\n"
    write_docs_block(page, "<!-- y:begin -->", "<!-- y:end -->", "more", heading="Y")
    assert page.read_text().endswith("## Y\n\n<!-- y:begin -->\nmore\n<!-- y:end -->\n")
    with pytest.raises(SystemExit):
        write_docs_block(page, "<!-- z:begin -->", "<!-- z:end -->", "none")


def test_stop_processes_stops_a_frozen_one_and_kills_a_deaf_one():
    deaf = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                             "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert deaf.stdout.readline() == b"up\n"
    frozen.send_signal(signal.SIGSTOP)
    stop_processes([deaf, frozen], timeout_s=1.0, sig=signal.SIGTERM)
    assert deaf.returncode == -signal.SIGKILL and frozen.returncode == -signal.SIGTERM
    deaf.stdout.close()


def test_core_benchmark_takes_sizes_from_full_and_keeps_what_is_given():
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--seconds", type=float, default=None)

    bench = CoreBenchmark("x", "doc", add_args, run=None, plot=None, table=None, sizes={"seconds": (5.0, 15.0)})
    assert bench.parse([]).seconds == 5.0
    assert bench.parse(["--full"]).seconds == 15.0
    assert bench.parse(["--full", "--seconds", "2"]).seconds == 2.0
