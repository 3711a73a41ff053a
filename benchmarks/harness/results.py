"""Result tables: where a run puts its figures (JSON, PNG, logs), what it ran on, the statistics and
number formats of every table, and the one shape of the core benchmarks' command lines (:class:`CoreBenchmark`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.harness.processes import ROOT


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench"),
                        help="results folder (JSON, PNG, logs); default outputs/bench")
    parser.add_argument("--full", action="store_true",
                        help="the full-length runs (60 s control loops, more round trips, every workload on every link)")
    parser.add_argument("--no-netns", action="store_true", help="host loopback only, even as root")


class Run:
    """Output folders of one run: `out/` for results, `out/logs/` for worker logs, `out/work/` as cwd."""

    def __init__(self, out: str):
        self.out = Path(out)
        self.logs = self.out / "logs"
        self.work = self.out / "work"
        for p in (self.out, self.logs, self.work):
            p.mkdir(parents=True, exist_ok=True)

    def write_json(self, name: str, data: dict) -> Path:
        path = self.out / f"{name}.json"
        path.write_text(json.dumps(data, indent=2, default=float))
        return path

    def write_plot(self, name: str, plot, result: dict) -> Path | None:
        """`plot(result, path)` into `out/<name>.png`; without matplotlib (the `bench` extra) one line
        says so and the run still ends well: its numbers are in the JSON and the table."""
        path = self.out / f"{name}.png"
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"(no {path.name}: matplotlib is not installed; pip install '.[bench]' or make bench draws it)")
            return None
        plot(result, path)
        return path


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    versions = {}
    for dist in ("eclipse-zenoh", "lerobot", "grpcio", "opencv-python-headless", "numpy", "msgpack"):
        try:
            from importlib.metadata import version

            versions[dist] = version(dist)
        except Exception:
            versions[dist] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
            "load_avg_at_start": load, "versions": versions, "git_commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def summary(values, scale: float = 1.0) -> dict:
    """n, median, p90, p99, max, mean of `values` times `scale` (None-safe for empty lists)."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64) * scale
    if arr.size == 0:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None, "mean": None}
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"n": int(arr.size), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "max": float(arr.max()), "mean": float(arr.mean())}


def fmt(value, digits: int = 2, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return "-"
    return f"{value:.{digits}f}{unit}"


@dataclass(frozen=True)
class CoreBenchmark:
    """One of `make bench`'s core benchmarks (latency, control loop, ingest), in the shape all three
    share: its flags beside the common ones (:func:`add_common_args`), sizes that ``--full`` picks,
    ``run(args, run_dir, net, log) -> result``, then the result's JSON, PNG and table.

    `python -m benchmarks.<name>` is :meth:`main`; `benchmarks/run_all.py` runs each with the
    arguments :meth:`parse` gives for its own flags, so both take the same defaults from one place.
    """

    name: str  # its JSON and PNG file names, and run_all's --only name
    doc: str  # the --help text (the module's docstring)
    add_args: Callable[[argparse.ArgumentParser], None]  # its own flags
    run: Callable[..., dict]  # (args, run_dir: Run, net: testbed.netns.Network, log=print) -> result
    plot: Callable[[dict, Path], None]
    table: Callable[[dict], str]
    #: flag -> (short-run value, --full value), for the flags left unset on the command line
    sizes: Mapping[str, tuple] = field(default_factory=dict)
    with_link: bool = True  # its network needs the shaped link (standalone runs; run_all always has it)

    def parser(self) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(description=self.doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        add_common_args(parser)
        self.add_args(parser)
        return parser

    def parse(self, argv: list[str] | None = None) -> argparse.Namespace:
        """Its arguments from `argv`, with every size left unset taken from :attr:`sizes`."""
        args = self.parser().parse_args(argv)
        for flag, (short, full) in self.sizes.items():
            if getattr(args, flag) is None:
                setattr(args, flag, full if args.full else short)
        return args

    def write(self, run_dir: Run, result: dict) -> None:
        run_dir.write_json(self.name, result)
        run_dir.write_plot(self.name, self.plot, result)

    def main(self, argv: list[str] | None = None) -> int:
        from testbed.netns import Network

        args = self.parse(argv)
        run_dir = Run(args.out)
        with Network(str(run_dir.logs), use_namespaces=not args.no_netns, with_link=self.with_link) as net:
            result = self.run(args, run_dir, net)
        self.write(run_dir, result)
        print(self.table(result))
        return 0
