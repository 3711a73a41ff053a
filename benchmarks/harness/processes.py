"""The processes a benchmark starts and stops: policy servers from a manifest, and the one way they are stopped.

Robots and routers a study starts as plain `subprocess.Popen` are stopped with :func:`stop_processes`
too; the core benchmarks' processes (one system's server or client, driven over a pipe) are
`benchmarks.harness.worker.Worker`s.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

#: The checkout the benchmarks run from (the processes they start run its code, unless told another).
ROOT = Path(__file__).resolve().parents[2]


def stop_processes(procs, timeout_s: float = 10.0, sig: int = signal.SIGINT) -> None:
    """Ask every process still running to stop (`sig`, all at once, the last started first), then wait
    for each up to `timeout_s` and kill what is left. A frozen process (SIGSTOP) is woken first, or
    it could not act on `sig`."""
    procs = list(procs)
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(sig)
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_answering(ask: Callable[[], object], proc: subprocess.Popen, log_path: Path | str, timeout_s: float) -> None:
    """Until `ask()` is truthy (e.g. the server's status query has a reply: it answers once its models
    are warm), polled every 0.3 s; a `RuntimeError` naming `log_path` when `proc` ends first or
    `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while not ask():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not come up; see {log_path}")
        time.sleep(0.3)


class ServerProcess:
    """A policy server on `manifest` (a dict written to a temporary YAML file), in its own process
    running this checkout's code (or that of `source`, another checkout: a before/after pair);
    `ready()`, when given, is polled until true (at most `ready_timeout_s`) before the block starts.
    `env`: variables added to its environment (e.g. ``OMP_NUM_THREADS``, its torch thread count).
    Stopped with SIGTERM at exit (killed after `stop_timeout_s`)."""

    def __init__(self, manifest: dict, log_path: Path, *, launcher: Sequence[str] = ("-m", "lerobot_zenoh.cli.server"),
                 ready: Callable[[], bool] | None = None, ready_timeout_s: float = 180.0, stop_timeout_s: float = 10.0,
                 source: Path = ROOT, env: Mapping[str, str] | None = None):
        self.manifest, self.log_path, self.launcher, self.source = manifest, Path(log_path), tuple(launcher), Path(source)
        self.env = dict(env or {})
        self.ready, self.ready_timeout_s, self.stop_timeout_s = ready, ready_timeout_s, stop_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        import yaml

        self._folder = Path(tempfile.mkdtemp(prefix="lz-bench-"))
        path = self._folder / "manifest.yaml"
        path.write_text(yaml.safe_dump(self.manifest))
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in __exit__
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **self.env, "PYTHONPATH": str(self.source)}
        self.proc = subprocess.Popen([sys.executable, *self.launcher, "--manifest", str(path)], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, cwd=self.source)  # (-m reads cwd first)
        if self.ready is not None:
            try:
                wait_answering(self.ready, self.proc, self.log_path, self.ready_timeout_s)
            except RuntimeError:
                self.__exit__(None, None, None)
                raise
        return self

    def wait_answering(self, ask: Callable[[], object], timeout_s: float = 60.0) -> None:
        """Until `ask()` is truthy (:func:`wait_answering`), e.g. ``lambda: session.query(app.status, 0.5)``."""
        wait_answering(ask, self.proc, self.log_path, timeout_s)

    def __exit__(self, *exc_info) -> None:
        if self.proc is not None:
            stop_processes([self.proc], self.stop_timeout_s, signal.SIGTERM)
        self._log.close()
        shutil.rmtree(self._folder, ignore_errors=True)
