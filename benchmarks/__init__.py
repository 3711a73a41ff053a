"""Benchmarks of lerobot_zenoh against LeRobot's gRPC async inference and the physical floor.

Not part of the installed package: run them with ``make bench`` or ``python -m benchmarks.run_all``
from the repository root (docs/benchmarks.md).
"""
