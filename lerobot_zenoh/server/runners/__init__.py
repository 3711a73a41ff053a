"""Policy runners: one module per policy family behind one seam (`base.PolicyRunner`).

    base.py        the seam: PolicySpec + RunnerCapabilities, InferenceRequest, InferenceResult,
                   PolicyRunner, BaseRunner (warm-up, `infer` convenience); no torch
    lerobot.py     what every LeRobot family shares: reading a checkpoint, the spec, pre/post-processing
    act.py         ACT (one forward pass per batch)
    diffusion.py   Diffusion (per-session history, seeded noise, denoising updates)
    synthetic.py   a torch-free fake with a set latency (tests, benchmarks)

`RUNNERS` maps LeRobot's policy type (``config.json``'s ``type``) to the runner class serving it. A new
family is one module with a `LeRobotRunner` subclass plus one entry here (docs/policies.md). Importing
this package imports neither torch nor lerobot.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lerobot_zenoh.errors import PolicyError
from lerobot_zenoh.server.runners.act import ActRunner
from lerobot_zenoh.server.runners.base import (
    BaseRunner,
    InferenceRequest,
    InferenceResult,
    PolicyRunner,
    PolicySpec,
    RunnerCapabilities,
)
from lerobot_zenoh.server.runners.diffusion import DiffusionRunner
from lerobot_zenoh.server.runners.lerobot import LeRobotRunner, read_config

if TYPE_CHECKING:
    from lerobot_zenoh.server.manifest import Manifest, ModelEntry

__all__ = [
    "RUNNERS",
    "BaseRunner",
    "InferenceRequest",
    "InferenceResult",
    "PolicyRunner",
    "PolicySpec",
    "RunnerCapabilities",
    "load_policy_runner",
    "load_runner",
]

#: LeRobot policy type -> the runner class that serves its checkpoints.
RUNNERS: dict[str, type[LeRobotRunner]] = {
    "act": ActRunner,
    "diffusion": DiffusionRunner,
}


def load_policy_runner(pretrained_path: str | Path, device: str = "cpu") -> PolicyRunner:
    """Load a local LeRobot checkpoint folder as the runner `RUNNERS` names for its policy type.

    A hub checkpoint must be downloaded first (``hf download REPO --local-dir DIR``). Raises
    `PolicyError` naming the path on any failure, and for a type without a runner, the type and the
    supported ones.
    """
    path = Path(pretrained_path)
    config = read_config(path)
    runner_cls = RUNNERS.get(config.type)
    if runner_cls is None:
        raise PolicyError(
            f"{path}: policy type {config.type!r} is not supported (supported: {', '.join(sorted(RUNNERS))})"
        )
    return runner_cls.from_checkpoint(path, config, device)


def load_runner(manifest: Manifest, entry: ModelEntry) -> PolicyRunner:
    """Build the runner a manifest entry asks for: its `synthetic` policy, or its checkpoint folder.
    Raises `PolicyError` (or `ConfigError` for bad synthetic settings) naming the entry or the path."""
    if entry.synthetic is not None:
        from lerobot_zenoh.server.runners.synthetic import SyntheticPolicy, SyntheticPolicyConfig

        syn = entry.synthetic
        return SyntheticPolicy(SyntheticPolicyConfig(
            state_names=tuple(f"state_{i}" for i in range(syn.state_dim)),
            cameras={k: tuple(v) for k, v in syn.cameras.items()},
            action_names=tuple(f"action_{i}" for i in range(syn.action_dim)),
            chunk_size=syn.chunk_size,
            fps=entry.fps,
            latency_ms=syn.latency_ms,
            batch_latency_ms=syn.batch_latency_ms,
            confidence_from_state=syn.confidence_from_state,
            rtc=syn.rtc,
        ))
    path = manifest.resolve_path(entry)
    if not path.exists():
        raise PolicyError(f"{manifest.source}: server[{entry.model_id}].pretrained_path: {path} does not exist "
                          "(build one offline with lerobot-zenoh-build-checkpoint)")
    return load_policy_runner(path, entry.device)
