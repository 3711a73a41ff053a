"""A stop that always ends: what the long-running console scripts do once SIGINT/SIGTERM asked them to stop.

A server, router or monitor closes what it opened when asked to stop. Each step is bounded, but
the last ones (closing the Zenoh session, the interpreter joining what is left at exit) are not
ours, and a process that does not exit after a stop signal holds its port and hangs whoever
stops it (a terminal, `make demo`, systemd). So once the stop begins:

- a second SIGINT or SIGTERM ends the process at once (the signal's default action: no Python
  code has to run, so it works even while the main thread waits inside Zenoh);
- after :data:`STOP_GRACE_S` the stacks of every thread are printed on stderr (what was stuck)
  and the process exits with 1. faulthandler's own watchdog thread does
  this, so it fires even while the interpreter is finalizing.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys

#: Seconds a stop may take before the stacks are printed and the process exits anyway. The
#: server's own steps are bounded by 5 s each (inference thread, each dispatcher).
STOP_GRACE_S = 20.0


def begin_stop(log: logging.Logger | None, grace_s: float = STOP_GRACE_S) -> None:
    """Call in the main thread once a stop signal arrived, before closing anything; `log` says so."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    faulthandler.dump_traceback_later(grace_s, exit=True, file=sys.stderr)
    if log is not None:
        log.info("stopping (a second Ctrl-C ends the process at once)")
