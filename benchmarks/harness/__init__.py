"""The benchmarks' harness: what every benchmark and study stands on, each concern written once.

    workloads.py    the cameras and sizes measured, synthetic frames that compress like a camera's,
                    a LeRobot robot that replays them
    robot.py        the simulated robot: the reference client's own send trigger, chunk intake and
                    action buffer in one class, stepped by a driver (every benchmark that simulates
                    a robot builds it from here, so a change to the client's rule changes them all)
    driver.py       a virtual fleet's driver: its tick, the chunks and telemetry that reach it
    processes.py    policy servers started from a manifest, waited for, and the one way processes
                    are stopped
    worker.py       the core benchmarks' processes (one system's server or client each), over a pipe
    results.py      run folders, the machine measured on, statistics and number formats, and the one
                    shape of the core benchmarks' command lines (`CoreBenchmark`)
    docs_blocks.py  the writer of a docs page's generated block

Network namespaces and free ports are in `testbed/` (netns.py, ports.py), shared with the tests.

May import: `lerobot_zenoh` (the client's parts, the protocol, the transport) and `testbed`; never a
benchmark or a study, and never `lerobot_zenoh.server` (a study that needs a server starts its process).
Imported by: `benchmarks/` and `benchmarks/studies/`; never by `tests/`.
"""
