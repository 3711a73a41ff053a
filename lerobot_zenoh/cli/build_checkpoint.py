"""`lerobot-zenoh-build-checkpoint`: write a randomly initialized ACT/Diffusion checkpoint, or a tiny
SmolVLA/pi0/pi0.5 with its local tokenizer (and VLM config), or (`--policy_type=smolvlm`) a tiny
SmolVLM for the VLM task components (System 2 text, safety / monitor verdicts), offline.

    lerobot-zenoh-build-checkpoint --policy_type=act --output=checkpoints/demo_act \\
        --state_dim=6 --cameras=front:96x128,wrist:96x128 --chunk_size=50 --fps=30 \\
        [--overrides='{dim_model: 256}']

Logs a line per step (about 10 s for ACT on a 2-core CPU), then prints the checkpoint path.
A configuration mistake exits with status 2 and one line naming the flag.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any


from lerobot_zenoh.errors import ConfigError

PROG = "lerobot-zenoh-build-checkpoint"

# ConfigError.field of build_checkpoint -> the flag a user typed.
# What the builder builds (checkpoint_builder.build.DEMO_OVERRIDES; kept here so --help needs no torch).
POLICY_TYPES = ("act", "diffusion", "smolvla", "pi0", "pi05", "pi0_fast", "smolvlm")
#: The types built with transformers (a VLM inside, or the VLM itself): the [vla] extra.
VLA_TYPES = ("smolvla", "pi0", "pi05", "pi0_fast", "smolvlm")
#: Not a LeRobot policy: a transformers VLM folder for `vlm:` manifest entries (checkpoint_builder.build.build_tiny_vlm).
VLM_TYPE = "smolvlm"

_OPTION_OF_FIELD = {
    "policy_type": "--policy_type",
    "output_dir": "--output",
    "state_names": "--state_names/--state_dim",
    "action_names": "--action_names/--action_dim",
    "cameras": "--cameras",
    "chunk_size": "--chunk_size",
    "fps": "--fps",
    "overrides": "--overrides",
    "seed": "--seed",
    "architecture": "--architecture",
}


@dataclass
class BuildCheckpointConfig:
    # Checkpoint folder to create (it must not exist, unless --force=true).
    output: str
    # Policy family: act, diffusion, smolvla, pi0 or pi05 (the VLAs tiny, with a local tokenizer), or
    # smolvlm: a tiny VLM for task components (the state, camera, chunk and override flags do not apply).
    policy_type: str = "act"
    # Comma-separated joint names, in the order of the robot's state vector (e.g. shoulder_pan.pos,...).
    state_names: str | None = None
    # Number of state values, named state_0, state_1, ... (instead of --state_names).
    state_dim: int | None = None
    # Comma-separated action names. Unset: the state names.
    action_names: str | None = None
    # Number of action values, named action_0, ... (instead of --action_names).
    action_dim: int | None = None
    # Comma-separated NAME:HxW RGB cameras; empty for none.
    cameras: str = "front:96x128,wrist:96x128"
    # Actions per chunk the policy predicts.
    chunk_size: int = 50
    # Control rate recorded in the checkpoint (a client must run at it).
    fps: int = 30
    # Policy config fields to change, as a YAML map, e.g. '{dim_model: 256, down_dims: [32, 64]}'.
    overrides: dict[str, Any] = field(default_factory=dict)
    # Seed of the random weights.
    seed: int = 0
    # Replace an existing checkpoint folder.
    force: bool = False
    # pi0/pi05/pi0_fast size preset: tiny (tests, tens of ms per chunk) or small (VLM 256 wide x 6
    # layers, 224 px images: for measurements); pi0/pi05 also full (LeRobot's own gemma_2b + gemma_300m
    # expert + SigLIP so400m, 4 B parameters: ~16 GB written, as much memory to build).
    architecture: str = "tiny"

    def __post_init__(self) -> None:
        if self.policy_type not in POLICY_TYPES:
            raise ConfigError("policy_type", f"{self.policy_type!r} is not one of {', '.join(POLICY_TYPES)}")
        if self.policy_type == VLM_TYPE:
            return
        if self.state_names is None and self.state_dim is None:
            raise ConfigError("state_names", "give --state_names=a,b,... or --state_dim=N")
        if self.state_names is not None and self.state_dim is not None:
            raise ConfigError("state_names", "give --state_names or --state_dim, not both")
        if self.action_names is not None and self.action_dim is not None:
            raise ConfigError("action_names", "give --action_names or --action_dim, not both")


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


def main(argv: list[str] | None = None) -> int:
    from lerobot_zenoh.command_line import EXIT_CONFIG, fail, parse, require_extra

    args = parse(BuildCheckpointConfig, argv, PROG)
    if args.policy_type in VLA_TYPES:  # transformers (and LeRobot's VLA code), from the [vla] extra
        require_extra(PROG, "vla", "lerobot", "torch", "transformers")
    else:
        require_extra(PROG, "server", "lerobot", "torch", *(("diffusers",) if args.policy_type == "diffusion" else ()))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the hub; avoid its long timeouts
    logging.basicConfig(level=logging.INFO, format=f"{PROG}: %(message)s", stream=sys.stderr)
    try:
        if args.policy_type == VLM_TYPE:
            from lerobot_zenoh.checkpoint_builder.build import build_tiny_vlm

            print(build_tiny_vlm(args.output, seed=args.seed, force=args.force))
            return 0
        if args.state_names is not None:
            state_names = _names("--state_names", args.state_names)
        else:
            if args.state_dim < 1:
                raise ConfigError("--state_dim", f"must be >= 1, got {args.state_dim}")
            state_names = [f"state_{i}" for i in range(args.state_dim)]
        if args.action_names is not None:
            action_names = _names("--action_names", args.action_names)
        elif args.action_dim is not None:
            if args.action_dim < 1:
                raise ConfigError("--action_dim", f"must be >= 1, got {args.action_dim}")
            action_names = [f"action_{i}" for i in range(args.action_dim)]
        else:
            action_names = list(state_names)
        cameras = _cameras(args.cameras)

        from lerobot_zenoh.checkpoint_builder.build import build_checkpoint

        path = build_checkpoint(
            args.output,
            policy_type=args.policy_type,
            state_names=state_names,
            action_names=action_names,
            cameras=cameras,
            chunk_size=args.chunk_size,
            fps=args.fps,
            overrides=dict(args.overrides),
            seed=args.seed,
            force=args.force,
            architecture=args.architecture,
        )
    except ConfigError as exc:
        head = exc.field.split(".")[0]
        option = exc.field if exc.field.startswith("--") else _OPTION_OF_FIELD.get(head, exc.field)
        message = str(exc).removeprefix(f"{exc.field}: ")
        detail = f" ({exc.field})" if option != exc.field and "." in exc.field else ""
        fail(PROG, f"{option}{detail}: {message}", EXIT_CONFIG)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
