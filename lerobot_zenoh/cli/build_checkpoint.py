"""`lerobot-zenoh-build-checkpoint`: write a randomly initialized ACT/Diffusion checkpoint offline.

    lerobot-zenoh-build-checkpoint --policy-type act --output checkpoints/demo_act \\
        --state-dim 6 --cameras front:96x128,wrist:96x128 --chunk-size 50 --fps 30 [--set dim_model=256]

Prints the checkpoint path. Bad arguments exit with status 2 and a message naming the option.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import yaml

from lerobot_zenoh.errors import ConfigError

# ConfigError.field of build_checkpoint -> the option a user typed.
_OPTION_OF_FIELD = {
    "policy_type": "--policy-type",
    "output_dir": "--output",
    "state_names": "--state-names/--state-dim",
    "action_names": "--action-names/--action-dim",
    "cameras": "--cameras",
    "chunk_size": "--chunk-size",
    "fps": "--fps",
    "overrides": "--set",
    "seed": "--seed",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lerobot-zenoh-build-checkpoint",
        description="Build a LeRobot checkpoint with random weights (no hub access needed).",
    )
    p.add_argument("--policy-type", default="act", choices=("act", "diffusion", "smolvla", "pi0", "pi05"))
    p.add_argument("--output", required=True, help="checkpoint folder to create")
    state = p.add_mutually_exclusive_group(required=True)
    state.add_argument("--state-names", help="comma-separated joint names, in state-vector order")
    state.add_argument("--state-dim", type=int, help="number of state values (named state_0..)")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--action-names", help="comma-separated action names (default: the state names)")
    action.add_argument("--action-dim", type=int, help="number of action values (named action_0..)")
    p.add_argument(
        "--cameras",
        default="front:96x128,wrist:96x128",
        help="comma-separated NAME:HxW RGB cameras (default: %(default)s)",
    )
    p.add_argument("--chunk-size", type=int, default=50, help="actions per chunk (default: %(default)s)")
    p.add_argument(
        "--fps", type=int, default=30, help="control rate recorded in the checkpoint (default: %(default)s)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a policy config field, value in YAML syntax (e.g. dim_model=256, down_dims=[32,64])",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="replace an existing checkpoint folder")
    return p


def _names(option: str, text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    if not names or any(not n for n in names):
        raise ConfigError(option, f"expected comma-separated non-empty names, got {text!r}")
    return names


def _cameras(text: str) -> dict[str, tuple[int, int]]:
    cameras: dict[str, tuple[int, int]] = {}
    if not text.strip():
        return cameras
    for item in text.split(","):
        name, sep, size = item.strip().partition(":")
        h, x, w = size.lower().partition("x")
        if not sep or not x or not name or not h.isdigit() or not w.isdigit():
            raise ConfigError("--cameras", f"expected NAME:HxW (e.g. front:96x128), got {item.strip()!r}")
        if name in cameras:
            raise ConfigError("--cameras", f"camera {name!r} given twice")
        cameras[name] = (int(h), int(w))
    return cameras


def _overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError("--set", f"expected KEY=VALUE, got {item!r}")
        try:
            out[key] = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError as exc:
            raise ConfigError("--set", f"{key}: cannot parse value {raw!r}: {exc}") from exc
    return out


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the hub; avoid its long timeouts
    try:
        if args.state_names is not None:
            state_names = _names("--state-names", args.state_names)
        else:
            if args.state_dim is None or args.state_dim < 1:
                raise ConfigError("--state-dim", f"must be >= 1, got {args.state_dim}")
            state_names = [f"state_{i}" for i in range(args.state_dim)]
        if args.action_names is not None:
            action_names = _names("--action-names", args.action_names)
        elif args.action_dim is not None:
            if args.action_dim < 1:
                raise ConfigError("--action-dim", f"must be >= 1, got {args.action_dim}")
            action_names = [f"action_{i}" for i in range(args.action_dim)]
        else:
            action_names = list(state_names)
        cameras = _cameras(args.cameras)
        overrides = _overrides(args.set)

        from lerobot_zenoh.server.checkpoint import build_checkpoint

        path = build_checkpoint(
            args.output,
            policy_type=args.policy_type,
            state_names=state_names,
            action_names=action_names,
            cameras=cameras,
            chunk_size=args.chunk_size,
            fps=args.fps,
            overrides=overrides,
            seed=args.seed,
            force=args.force,
        )
    except ConfigError as exc:
        head = exc.field.split(".")[0]
        option = exc.field if exc.field.startswith("--") else _OPTION_OF_FIELD.get(head, exc.field)
        message = str(exc).removeprefix(f"{exc.field}: ")
        detail = f" ({exc.field})" if option != exc.field and "." in exc.field else ""
        parser.exit(2, f"{parser.prog}: error: {option}{detail}: {message}\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
