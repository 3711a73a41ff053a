"""Installed size of each extra of lerobot-zenoh (README, "Install"), measured two ways.

    python -m benchmarks.studies.install_sizes closure            # from this environment's installed files
    python -m benchmarks.studies.install_sizes venv core planner  # a throwaway venv per extra (pip reaches PyPI)

`closure`: the dependency closure of each extra as pyproject.toml declares it (markers evaluated here),
resolved through the metadata of the distributions installed in this environment, summing the files each one's RECORD lists; what this environment's wheels
(torch included, CPU or CUDA as installed here) take on disk. `venv`: `pip install` of the wheel built from
this checkout (`pip wheel . --no-deps`) into a fresh venv per extra, then `du` of the venv (pip included).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = {"core": [], "planner": ["planner"], "robot": ["robot"], "hardware": ["hardware"], "server": ["server"],
          "server+vla": ["server", "vla"]}


def closure(extras: list[str]) -> dict[str, int]:
    """Installed bytes per distribution needed by lerobot-zenoh[extras]."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    seen: dict[str, int] = {}
    todo = [(r, set()) for r in project["dependencies"]]
    todo += [(r, set()) for e in extras for r in project["optional-dependencies"][e]]
    while todo:
        req_text, with_extras = todo.pop()
        req = Requirement(req_text)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (with_extras or {""})):
            continue
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        key = f"{name}[{','.join(sorted(req.extras))}]"
        if key in seen or name == "lerobot-zenoh" and not req.extras:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue
        seen[key] = 0
        if name not in {k.split("[")[0] for k, v in seen.items() if v}:
            seen[key] = sum((f.size or 0) for f in dist.files or [])
        todo += [(r, set(req.extras)) for r in dist.requires or []]
    return seen


def venv_size(extra: str, wheel: Path) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "venv", tmp], check=True)
        spec = str(wheel) if extra == "core" else f"lerobot-zenoh[{','.join(EXTRAS[extra])}] @ file://{wheel}"
        subprocess.run([f"{tmp}/bin/pip", "install", "-q", spec], check=True)
        return int(subprocess.run(["du", "-sb", tmp], capture_output=True, text=True, check=True).stdout.split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("how", choices=("closure", "venv"))
    ap.add_argument("extras", nargs="*", default=list(EXTRAS))
    args = ap.parse_args()
    if args.how == "venv":
        out = Path(tempfile.mkdtemp())
        subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(out)], check=True)
        wheel = next(out.glob("*.whl"))
    for extra in args.extras:
        if args.how == "closure":
            sizes = closure(EXTRAS[extra])
            torch = sum(v for k, v in sizes.items() if k.startswith(("torch", "nvidia", "triton")))
            print(f"{extra:12s} {sum(sizes.values()) / 1e6:8.0f} MB  ({len(sizes)} distributions; torch, CUDA "
                  f"and triton {torch / 1e6:.0f} MB)")
        else:
            print(f"{extra:12s} {venv_size(extra, wheel) / 1e6:8.0f} MB  (fresh venv, pip included)")


if __name__ == "__main__":
    main()
