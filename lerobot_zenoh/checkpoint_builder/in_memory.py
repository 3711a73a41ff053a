"""Random-weight models built straight on their device and served by the server's own runner.

A real-size pi0.5 is 4.1 B parameters: writing it as a checkpoint and reading it back costs 16 GB of
disk (float32) and minutes, for weights that are random anyway. A benchmark instead writes the
checkpoint folder without its weights (`build.build_checkpoint(..., weights=False)`: config,
processors, tokenizer, features sidecar; a few hundred KB) and loads it here:

    load_in_memory(folder, options, seed=0)   the runner that serves `folder`'s policy type
                                              (`runners.RUNNERS`), loaded by its own `from_checkpoint`
                                              with `options` (device, dtype, RTC, compile,
                                              images_on_device) except that the weights are drawn at
                                              random on the device instead of read from a file
    parameter_counts(policy_type,             the parameters of an architecture, built on the ``meta``
        architecture)                         device (shapes only: no memory, no time)

Everything but the weights is the server's path: LeRobot's class (or the test architecture the
sidecar declares), the config the runner prepares (bf16 as LeRobot mixes it), the saved processors,
the runner's compile settings, warm-up and `run`. A server never loads a checkpoint this way: its
loader (`load_runner`, server/config/runner_loading.py) insists on ``model.safetensors`` and checks
every tensor of it.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from lerobot_zenoh.errors import PolicyError

log = logging.getLogger(__name__)

#: The parts of a pi0/pi0.5 `parameter_counts` reports, as attribute paths from the policy.
_PI_PARTS = {
    "vision_tower": "model.paligemma_with_expert.paligemma.model.vision_tower",
    "language_model": "model.paligemma_with_expert.paligemma.model.language_model",
    "lm_head": "model.paligemma_with_expert.paligemma.lm_head",
    "action_expert": "model.paligemma_with_expert.gemma_expert",
}


def load_in_memory(folder: str | Path, options: Any, *, seed: int = 0) -> Any:
    """The runner for checkpoint `folder` (written with or without weights) loaded with `options`
    (`runners.LoadOptions`), its weights random (seeded with `seed`) and made on ``options.device``.
    Raises what the runner's own loader raises (`PolicyError` naming the field or the path)."""
    from lerobot_zenoh.server.runners import RUNNERS, read_config

    path = Path(folder)
    config = read_config(path)
    runner_cls = RUNNERS.get(config.type)
    if runner_cls is None:
        raise PolicyError(f"{path}: no runner serves policy type {config.type!r}")
    random_cls = type(f"RandomWeights{runner_cls.__name__}", (_RandomWeights, runner_cls), {"seed": seed})
    return random_cls.from_checkpoint(path, config, options)


class _RandomWeights:
    """Mixed in before a runner class: `load_policy` draws the weights instead of reading them."""

    seed = 0
    weights_name = None

    @classmethod
    def load_policy(cls, path: Path, config: Any, options: Any) -> Any:
        import time

        from lerobot_zenoh.checkpoint_builder.build import random_policy

        t0 = time.perf_counter()
        policy = random_policy(cls.policy_class(path, config), config, seed=cls.seed, device=options.device)
        log.info("%s: %.2f B random parameters built on %s in %.1f s", path.name,
                 sum(p.numel() for p in policy.parameters()) / 1e9, options.device, time.perf_counter() - t0)
        return policy


def parameter_counts(policy_type: str, architecture: str, *, cameras: int = 1) -> dict[str, int]:
    """``{"total": ..., <part>: ...}``: the parameters of `policy_type` (pi0 or pi05) at `architecture`
    (`tiny_pi.ARCHITECTURES`) with `cameras` cameras, counted on a model built on the ``meta``
    device: no weights are made, so even ``full`` takes a second. Parts: vision_tower,
    language_model, lm_head, action_expert."""
    import torch

    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint, random_policy
    from lerobot_zenoh.server.runners import read_config
    from lerobot_zenoh.server.runners.flow_matching import declared_policy_class

    names = [f"joint_{i}" for i in range(6)]
    with tempfile.TemporaryDirectory(prefix="lz-count-") as tmp:
        folder = build_checkpoint(Path(tmp) / policy_type, policy_type=policy_type, state_names=names,
                                  action_names=names, cameras={f"cam{i}": (224, 224) for i in range(cameras)},
                                  chunk_size=50, fps=30, architecture=architecture, weights=False)
        config = read_config(folder)
        config.device = "meta"
        policy = random_policy(declared_policy_class(folder, config), config, seed=0, device="meta")
    counts = {"total": sum(p.numel() for p in policy.parameters())}
    for part, where in _PI_PARTS.items():
        module: Any = policy
        for attr in where.split("."):
            module = getattr(module, attr)
        counts[part] = sum(p.numel() for p in module.parameters()) if isinstance(module, torch.nn.Module) else 0
    return counts
