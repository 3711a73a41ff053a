"""The same-host path (protocol 1.2): raw frames through a sealed, pre-mapped memfd ring, chosen by a probe.

The ring and the reader alone; then over real Zenoh on loopback: the path is chosen, frames
arrive bit-exact, a vanished ring is a counted rejection, a client whose shared memory fails falls
back to JPEG with one warning, and many short sessions leave no file and no memory behind.
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import pytest
from lerobot.robots import make_robot_from_config

from lerobot_zenoh.client.client import RobotClient
from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import Observation, SameHostAdvert, SharedFrames
from lerobot_zenoh.server.model.runner_adapter import RunnerAdapter
from lerobot_zenoh.telemetry.publisher import process_memory
from lerobot_zenoh.transport import same_host
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import loopback_settings
from lz_testing import CAMS, make_config, make_server, wait_for

pytestmark = pytest.mark.skipif(not os.access(same_host.SHM_DIR, os.W_OK), reason="no writable /dev/shm")


def frames(rng, cams=CAMS):
    return {n: rng.integers(0, 256, (*hw, 3), dtype=np.uint8) for n, hw in cams.items()}


def our_files(ring):
    return [n for n in ring.names() if os.path.exists(os.path.join(same_host.SHM_DIR, n))]


# -- the ring and the reader --------------------------------------------------------------------


def test_frames_round_trip_bit_exact_and_the_ring_removes_its_files():
    rng = np.random.default_rng(0)
    ring = same_host.FrameRing(slots=3)
    names = []
    try:
        for _ in range(7):  # more writes than slots: the ring wraps
            sent = frames(rng)
            ref = ring.write(sent)
            got = same_host.read_frames(ref, CAMS)
            assert set(got) == set(sent) and all(np.array_equal(got[n], sent[n]) for n in sent)
        names = ring.names()
        assert len(our_files(ring)) == 1  # bounded: one ring of 3 slots, reused
        one = sum(h * w * 3 for h, w in CAMS.values()) + same_host.HEADER.size
        assert ring.ring_bytes == 3 * (-(-one // same_host.SLOT_ALIGN) * same_host.SLOT_ALIGN)
    finally:
        ring.close()
    assert our_files(ring) == [] and not any(os.path.exists(os.path.join(same_host.SHM_DIR, n)) for n in names)


def test_the_server_reads_views_of_the_ring_mapped_once():
    rng = np.random.default_rng(5)
    ring, reader = same_host.FrameRing(slots=2), same_host.FrameReader()
    try:
        for _ in range(5):
            sent = frames(rng)
            ref = ring.write(sent)
            views = reader.read(ref, CAMS)
            assert all(not v.flags.writeable and np.array_equal(v, sent[n]) for n, v in views.items())
            assert reader.current(ref)
        assert reader.mapped_total == 1 and len(reader) == 1  # one mapping, reused for every frame
        ring.write(frames(rng))
        ring.write(frames(rng))  # the slot of `ref` again
        assert not reader.current(ref)  # the executor's check after the model read the views
    finally:
        ring.close()
        reader.close()


def test_the_ring_cannot_shrink_under_a_reader():
    """Sealed before anyone maps it: a truncate fails, so a mapping can never SIGBUS."""
    ring = same_host.FrameRing(slots=2)
    try:
        ref = ring.write(frames(np.random.default_rng(6)))
        pid = ref.segment.split("-")[1]
        fd = os.open(f"/proc/{pid}/fd/{ring._fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 100)
        finally:
            os.close(fd)
        assert np.array_equal(same_host.read_frames(ref, CAMS)["front"], same_host.read_frames(ref, CAMS)["front"])
    finally:
        ring.close()


def test_an_overwritten_truncated_or_vanished_file_is_a_rejection_not_a_crash():
    rng = np.random.default_rng(1)
    ring = same_host.FrameRing(slots=2)
    try:
        old = ring.write(frames(rng))
        ring.write(frames(rng))
        ring.write(frames(rng))  # slot 0 again: `old` was overwritten
        with pytest.raises(ProtocolError) as e:
            same_host.read_frames(old, CAMS)
        assert e.value.reason == "shm_stale"

        # The ring itself cannot shrink (sealed, test above); its pointer file can.
        ref = ring.write(frames(rng))
        os.truncate(os.path.join(same_host.SHM_DIR, ref.segment), 10)
        with pytest.raises(ProtocolError) as e:
            same_host.read_frames(ref, CAMS)
        assert e.value.reason == "shm_truncated"
        ring.close()  # a new ring for the cases below

        # Frames said to lie beyond the ring's end.
        ref = ring.write(frames(rng))
        far = SharedFrames(ref.segment, ref.generation, {n: (o + 2**30, h, w) for n, (o, h, w) in ref.frames.items()})
        with pytest.raises(ProtocolError) as e:
            same_host.read_frames(far, CAMS)
        assert e.value.reason == "shm_truncated"

        ref = ring.write(frames(rng))
        os.unlink(os.path.join(same_host.SHM_DIR, ref.segment))
        with pytest.raises(ProtocolError) as e:
            same_host.read_frames(ref, CAMS)
        assert e.value.reason == "shm_gone"

        ref = ring.write(frames(rng))
        with pytest.raises(ProtocolError) as e:
            same_host.read_frames(ref, {"front": (48, 64), "wrist": (24, 32)})
        assert e.value.reason == "wrong_image_shape"
        with pytest.raises(ProtocolError) as e:
            same_host.read_frames(SharedFrames("../etc/passwd", 1, {"front": (16, 48, 64)}), {"front": (48, 64)})
        assert e.value.reason == "bad_shared_frames"
    finally:
        ring.close()


def test_the_probe_proves_one_host_and_user():
    probe = same_host.Probe()
    assert not same_host.probe_ok(probe.advert)  # not written yet
    assert probe.create()
    try:
        assert same_host.probe_ok(probe.advert)
        assert not same_host.probe_ok(SameHostAdvert(probe.advert.probe, "0" * 32))  # another token
        assert not same_host.probe_ok(SameHostAdvert("../../etc/hostname", probe.advert.token))
        assert not same_host.probe_ok(None)
    finally:
        probe.close()
    assert not os.path.exists(probe.path)


# -- over real Zenoh --------------------------------------------------------------------------


class Recorded:
    """What the client wrote (by generation) and what the server's executor got (by generation)."""

    def __init__(self, monkeypatch):
        self.written: dict[int, dict] = {}
        self.served: dict[int, dict] = {}
        self.lock = threading.Lock()
        write, prepare_batch = same_host.FrameRing.write, RunnerAdapter.prepare_batch

        def recording_write(ring, fr):
            ref = write(ring, fr)
            with self.lock:
                self.written[ref.generation] = {n: np.array(a) for n, a in fr.items()}
            return ref

        def recording_prepare(executor, items):
            requests = prepare_batch(executor, items)
            for (_, obs, _), request in zip(items, requests, strict=True):
                if obs.shared_frames is not None and not isinstance(request, Exception):
                    with self.lock:
                        self.served[obs.shared_frames.generation] = {n: np.array(a) for n, a in request.images.items()}
            return requests

        monkeypatch.setattr(same_host.FrameRing, "write", recording_write)
        monkeypatch.setattr(RunnerAdapter, "prepare_batch", recording_prepare)


def test_a_client_on_the_same_host_sends_raw_frames_that_arrive_bit_exact(port, app_key, monkeypatch):
    rec = Recorded(monkeypatch)
    with make_server(port, app_key, latency_ms=5) as server:
        assert server.models[0].status.same_host is not None
        cfg = make_config(port, app_key)
        client = RobotClient(cfg, make_robot_from_config(cfg.robot)).start()
        try:
            assert client.same_host_active
            client.run(duration_s=1.5)
        finally:
            client.close()
    assert client.counters.observations_same_host == client.counters.observations_published > 0
    assert client.counters.chunks_received > 0
    assert rec.served, "the server served no same-host observation"
    for generation, images in rec.served.items():
        sent = rec.written[generation]
        assert set(images) == set(sent)
        for n in sent:
            assert images[n].dtype == np.uint8 and np.array_equal(images[n], sent[n]), n  # no JPEG loss


def test_no_same_host_offer_or_opt_out_means_jpeg(port, app_key):
    with make_server(port, app_key, latency_ms=5):
        cfg = make_config(port, app_key, same_host=False)
        client = RobotClient(cfg, make_robot_from_config(cfg.robot)).start()
        try:
            assert not client.same_host_active
            client.run(duration_s=0.5)
        finally:
            client.close()
    assert client.counters.observations_published > 0 and client.counters.observations_same_host == 0


def test_a_client_whose_shared_memory_fails_falls_back_to_jpeg_with_one_warning(port, app_key, monkeypatch, caplog):
    write = same_host.FrameRing.write
    calls = []

    def failing_write(ring, fr):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return write(ring, fr)

    monkeypatch.setattr(same_host.FrameRing, "write", failing_write)
    with make_server(port, app_key, latency_ms=5):
        cfg = make_config(port, app_key)
        client = RobotClient(cfg, make_robot_from_config(cfg.robot)).start()
        try:
            assert client.same_host_active
            with caplog.at_level(logging.WARNING, logger="lerobot_zenoh.client.client"):
                client.run(duration_s=3.0)
                received_after = client.counters.chunks_received
        finally:
            client.close()
    c = client.counters
    assert c.observations_same_host == 1 and not client.same_host_active
    assert c.observations_published >= 3 and c.publish_errors == 0  # JPEG from then on, nothing lost
    assert received_after >= 3
    assert len([r for r in caplog.records if "shared memory failed" in r.getMessage()]) == 1


def test_a_vanished_shared_frame_is_a_counted_rejection_and_the_server_goes_on(port, app_key):
    rng = np.random.default_rng(3)
    with make_server(port, app_key, latency_ms=5) as server, \
            ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
        key = app_key.client("r9")
        chunks = []
        session.subscribe(key.action, lambda k, b: chunks.append(codec.decode_action_chunk(b)))
        pub = session.publisher(key.obs, OBSERVATION_QOS)
        ring = same_host.FrameRing()
        try:
            ref = ring.write(frames(rng))
            os.unlink(os.path.join(same_host.SHM_DIR, ref.segment))
            state = np.zeros(6, np.float32)
            engine = server.models[0].session_table

            def rejected():
                s = engine.sessions.get("r9")
                return s is not None and s.stats.rejected["shm_gone"] >= 1

            assert wait_for(lambda: (pub.put(codec.encode(Observation(1, "r9", state, {}, shared_frames=ref)))
                                     or rejected()), 10)
            # The same client, a good frame next: served.
            assert wait_for(lambda: (pub.put(codec.encode(Observation(2, "r9", state, {},
                                                                      shared_frames=ring.write(frames(rng)))))
                                     or any(c.response_to_seq_id == 2 for c in chunks)), 10)
        finally:
            ring.close()


def test_many_short_same_host_sessions_leave_no_file_and_no_memory(port, app_key):
    """100 clients come and go, each sending raw frames: no frame file is left and RSS stays flat."""
    def lz_files():  # this process's (the rings' names carry the pid: other jobs on the host may make theirs)
        return {n for n in os.listdir(same_host.SHM_DIR) if n.startswith(f"lz-{os.getpid()}-")}

    before_files = lz_files()
    rss = []
    with make_server(port, app_key, latency_ms=1) as server, \
            ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
        rng = np.random.default_rng(4)
        state = np.zeros(6, np.float32)
        for i in range(100):
            key = app_key.client(f"short{i}")
            got = threading.Event()
            sub = session.subscribe(key.action, lambda k, b, e=got: e.set())
            pub = session.publisher(key.obs, OBSERVATION_QOS)
            token = session.declare_token(key.metrics)  # its session closes when the token goes
            ring = same_host.FrameRing()
            try:
                seq = 0
                while not got.is_set() and seq < 200:
                    seq += 1
                    pub.put(codec.encode(Observation(seq, f"short{i}", state, {}, shared_frames=ring.write(frames(rng)))))
                    got.wait(0.05)
                assert got.is_set(), f"session {i} never served"
            finally:
                ring.close()
                token.undeclare()
                pub.close()
                sub.close()
            if i in (19, 99):
                rss.append(process_memory()["cpu_rss_mb"])
        assert sum(m.session_table.snapshot().sessions_opened for m in server.models) == 100
    assert lz_files() == before_files
    assert rss[1] - rss[0] < 32, f"RSS grew {rss[1] - rss[0]:.1f} MiB over 80 sessions"


def test_files_of_dead_processes_are_removed_when_a_server_starts():
    """A killed server's probe and a crashed client's frame files carry their pid: the next server removes them."""
    with open("/proc/sys/kernel/pid_max") as f:
        dead = int(f.read())  # pids are below pid_max: this one never runs
    names = [f"lz-probe-{dead}-{'a' * 32}", f"lz-{dead}-{'b' * 32}-0"]
    mine = f"lz-{os.getpid()}-{'c' * 32}-0"  # a live process's file stays
    for n in [*names, mine]:
        with open(os.path.join(same_host.SHM_DIR, n), "wb") as f:
            f.write(b"x")
    probe = same_host.Probe()
    try:
        assert probe.create()
        assert not any(os.path.exists(os.path.join(same_host.SHM_DIR, n)) for n in names)
        assert os.path.exists(os.path.join(same_host.SHM_DIR, mine))
    finally:
        probe.close()
        os.unlink(os.path.join(same_host.SHM_DIR, mine))


def test_a_slot_rewritten_while_the_model_reads_its_views_is_a_stale_rejection_not_a_result():
    """The executor hands the model views of the client's ring; if the client reuses that slot before
    the model is done (the server a ring's length behind), the result is dropped as `shm_stale`."""
    from lerobot_zenoh.server.runners.synthetic import SyntheticPolicy, SyntheticPolicyConfig

    policy = SyntheticPolicy(SyntheticPolicyConfig(state_dim=6, cameras=dict(CAMS), action_dim=6, chunk_size=8))
    executor = RunnerAdapter("m", policy, actions_per_chunk=8, server_id="gpu0")
    ring = same_host.FrameRing(slots=2)
    rng = np.random.default_rng(7)
    state = np.zeros(6, np.float32)
    try:
        sent = frames(rng)
        request = executor.prepare("r1", Observation(1, "r1", state, {}, shared_frames=ring.write(sent)))
        assert all(np.array_equal(request.images[n], sent[n]) for n in sent)  # views of the ring, not copies
        assert not any(v.flags.owndata or v.flags.writeable for v in request.images.values())
        (result,) = executor.infer([request])
        assert not isinstance(result, Exception)  # nothing rewritten: served

        request = executor.prepare("r1", Observation(2, "r1", state, {}, shared_frames=ring.write(frames(rng))))
        run = policy.run

        def client_overtakes(requests, **kw):  # the client writes two more observations meanwhile
            ring.write(frames(rng))
            ring.write(frames(rng))
            return run(requests, **kw)

        policy.run = client_overtakes
        (result,) = executor.infer([request])
        assert isinstance(result, ProtocolError) and result.reason == "shm_stale"
    finally:
        ring.close()
        executor.close()


def test_a_reading_server_removes_the_files_of_clients_killed_since_it_started(monkeypatch):
    """A SIGKILLed client leaves its pointer file; the server's reader removes such files as it goes
    (every ORPHAN_SWEEP_S), not only at its next start, and keeps the files of live clients."""
    with open("/proc/sys/kernel/pid_max") as f:
        dead = int(f.read())
    orphan = os.path.join(same_host.SHM_DIR, f"lz-{dead}-{'d' * 32}-0")
    rng = np.random.default_rng(3)
    ring = same_host.FrameRing(slots=2)
    reader = same_host.FrameReader()
    try:
        ref = ring.write(frames(rng))
        reader.read(ref, CAMS)  # the first sweep is due at once
        with open(orphan, "wb") as f:
            f.write(b"x")  # a client killed after that
        monkeypatch.setattr(same_host, "ORPHAN_SWEEP_S", 0.0)
        monkeypatch.setattr(reader, "_swept_s", 0.0)  # the next read sweeps
        reader.read(ring.write(frames(rng)), CAMS)
        assert not os.path.exists(orphan) and reader.orphans_removed >= 1
        assert our_files(ring) == ring.names()  # the live client's ring stays
    finally:
        ring.close()
        reader.close()
        if os.path.exists(orphan):
            os.unlink(orphan)
