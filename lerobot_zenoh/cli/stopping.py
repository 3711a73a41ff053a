"""A stop that always ends: what the long-running console scripts do once SIGINT/SIGTERM asked them to stop.

A server, router or monitor closes what it opened when asked to stop. Each step is bounded, but
the last ones (closing the Zenoh session, the interpreter joining what is left at exit) are not
ours, and a process that does not exit after a stop signal holds its port and hangs whoever
stops it (a terminal, `make demo`, systemd). So once the stop begins:

- a second SIGINT or SIGTERM ends the process at once, with status 128 + the signal's number.
  One that comes within :data:`REPEAT_WINDOW_S` of the first is the same request delivered twice,
  and is ignored: a terminal's Ctrl-C reaches the whole process group, and a parent such as
  `make demo` may forward it as well. Once the process exits (the interpreter's teardown) they are
  ignored too: the interpreter then puts the signals' default action back, and a repeat would kill
  a process that has already closed everything;
- after :data:`STOP_GRACE_S` the stacks of every thread are printed on stderr (what was stuck)
  and the process exits with 1. faulthandler's own watchdog thread does this, so it fires even
  while the main thread is inside native code (where a second signal's handler cannot run
  until that call returns) or the interpreter is finalizing.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import signal
import sys
import time

#: Seconds a stop may take before the stacks are printed and the process exits anyway. The
#: server's own steps are bounded by 5 s each (inference thread, each dispatcher).
STOP_GRACE_S = 20.0
#: A stop signal this soon after the first is the same one delivered twice, not a second Ctrl-C.
REPEAT_WINDOW_S = 1.0


def begin_stop(log: logging.Logger | None, grace_s: float = STOP_GRACE_S,
               repeat_window_s: float = REPEAT_WINDOW_S) -> None:
    """Call in the main thread once a stop signal arrived, before closing anything; `log` says so."""
    asked_s = time.monotonic()

    def again(signum: int, _frame) -> None:
        if time.monotonic() - asked_s < repeat_window_s:
            return
        sys.stderr.write(f"{signal.Signals(signum).name} again: exiting without finishing the stop\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, again)
    atexit.register(_ignore_stop_signals)  # (atexit runs on the main thread, before the teardown)
    faulthandler.dump_traceback_later(grace_s, exit=True, file=sys.stderr)
    if log is not None:
        log.info("stopping (a second Ctrl-C ends the process at once)")


def _ignore_stop_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
