"""Benchmark processes: one object (a server or a client of one system) per process, driven over a pipe.

The driver starts ``python -m benchmarks.harness.worker`` (inside a network namespace where asked), then
sends one JSON line per request and reads one JSON line back:

    {"create": "OursServer", "name": "main", "kwargs": {...}}  -> {"ok": true, "result": <start()'s result>}
    {"call": "round_trips", "target": "main", "kwargs": {"n": 50}} -> {"ok": true, "result": ...}
    {"close": "main"}                                            -> closes that object
    {"cpu": true}                                                -> {"ok": true, "result": <process CPU s>}
    {"exit": true}

The worker's own stdout is moved to stderr at start (LeRobot's loggers print to stdout), so the pipe
carries nothing but replies. Each process is its own: its CPU time is the CPU time of one side of one
system, and a server can be killed to see what its clients do.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
import traceback

from benchmarks.harness.processes import ROOT as CHECKOUT

ROOT = str(CHECKOUT)  # the checkout these processes run, as a path string (cwd, PYTHONPATH)


class WorkerError(RuntimeError):
    pass


class Worker:
    """Driver-side handle of one worker process."""

    def __init__(self, name: str, prefix: list[str], log_dir: str, work_dir: str, root: str = ROOT):
        """`root`: the checkout whose code the process runs (another one: a side-by-side comparison)."""
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        env = dict(os.environ, LZB_WORK_DIR=work_dir, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        if root != ROOT:
            env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self._log = open(self.log_path, "a")
        # A checkout from before the harness package had its worker at benchmarks/worker.py (same pipe protocol).
        module = "benchmarks.harness.worker" if os.path.exists(os.path.join(root, "benchmarks", "harness", "worker.py")) \
            else "benchmarks.worker"
        self.proc = subprocess.Popen(prefix + [sys.executable, "-m", module], cwd=root, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1)
        self.pid = self._recv(120.0)["pid"]  # `ip netns exec` execs, but ask rather than assume

    def create(self, kind: str, name: str = "main", timeout_s: float = 180.0, **kwargs):
        return self._request({"create": kind, "name": name, "kwargs": kwargs}, timeout_s)

    def call(self, method: str, target: str = "main", timeout_s: float = 600.0, **kwargs):
        return self._request({"call": method, "target": target, "kwargs": kwargs}, timeout_s)

    def close_target(self, name: str = "main", timeout_s: float = 60.0) -> None:
        self._request({"close": name}, timeout_s)

    def send(self, method: str, target: str = "main", **kwargs) -> None:
        """Start a call without waiting for it (`result()` reads the reply)."""
        self._write({"call": method, "target": target, "kwargs": kwargs})

    def result(self, timeout_s: float = 600.0):
        return self._unwrap(self._recv(timeout_s))

    def cpu_s(self) -> float:
        return self._request({"cpu": True}, 30.0)

    def _request(self, req: dict, timeout_s: float):
        self._write(req)
        return self._unwrap(self._recv(timeout_s))

    def _write(self, req: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerError(f"{self.name} is gone ({exc}); see {self.log_path}") from exc

    def _recv(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"{self.name}: no reply within {timeout_s:.0f} s; see {self.log_path}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    raise WorkerError(f"{self.name} exited (rc={self.proc.poll()}); see {self.log_path}")
                return json.loads(line)

    def _unwrap(self, reply: dict):
        if not reply.get("ok"):
            raise WorkerError(f"{self.name}: {reply.get('error')}")
        return reply.get("result")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def close(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            try:
                self._write({"exit": True})
                self.proc.wait(timeout=timeout_s)
            except (WorkerError, subprocess.TimeoutExpired):
                self.kill()
        self._log.close()


def _serve() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed goes to the log, never into the reply pipe
    work_dir = os.environ.get("LZB_WORK_DIR", os.path.join(ROOT, "outputs", "bench", "work"))
    os.makedirs(work_dir, exist_ok=True)
    os.chdir(work_dir)  # LeRobot's loggers create logs/ in the working directory
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from benchmarks import systems

    def reply(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")

    reply({"ok": True, "pid": os.getpid()})
    targets: dict = {}
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("exit"):
            break
        try:
            if "create" in req:
                obj = getattr(systems, req["create"])(**req.get("kwargs", {}))
                targets[req.get("name", "main")] = obj
                result = obj.start()
            elif "cpu" in req:
                result = time.process_time()
            elif "close" in req:
                result = None
                obj = targets.pop(req["close"], None)
                if obj is not None and hasattr(obj, "close"):
                    obj.close()
            else:
                result = getattr(targets[req.get("target", "main")], req["call"])(**req.get("kwargs", {}))
            reply({"ok": True, "result": result})
        except Exception:
            reply({"ok": False, "error": traceback.format_exc()})
    for obj in targets.values():
        try:
            obj.close()
        except Exception:
            traceback.print_exc()
    proto.close()
    os._exit(0)  # do not wait on foreign non-daemon threads (gRPC, Zenoh) at interpreter exit


if __name__ == "__main__":
    _serve()
