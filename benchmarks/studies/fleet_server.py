"""`lerobot-policy-server` with the fleet benchmarks' own scheduler registered: what
`benchmarks/studies/fleet_zenoh.py` starts as its server process.

"FIFO, running tasks before new ones" (`benchmarks.studies.fleet.FifoRunningFirst`) is a rung of the fleet
studies, not a scheduler the package offers; it plugs into the server through the scheduler registry
(`register_scheduler`, the way a plugin would), so the real server runs the very object the model runs.

    python -m benchmarks.studies.fleet_server --manifest manifest.yaml
"""

from __future__ import annotations

import sys



def register() -> None:
    """Add the benchmarks' schedulers to the server's registry (idempotent)."""
    from benchmarks.studies.fleet import FifoRunningFirst
    from lerobot_zenoh.scheduling.request_schedulers import SCHEDULERS, register_scheduler

    if FifoRunningFirst.name not in SCHEDULERS:  # it has no settings: the base config class
        register_scheduler(FifoRunningFirst.name, lambda config: FifoRunningFirst())


if __name__ == "__main__":
    register()
    from lerobot_zenoh.cli.server import main

    sys.exit(main())
