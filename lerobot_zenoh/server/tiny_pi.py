"""Tiny pi0 / pi0.5 architectures for offline tests and demos: a scoped construction-time shrink.

LeRobot 0.6.1 builds pi0/pi05 from two fixed Gemma variants (``paligemma_variant``,
``action_expert_variant``: ``gemma_300m`` or ``gemma_2b``, 4 B parameters together) and a SigLIP
vision tower taken from transformers' PaliGemma defaults (1152 wide, 27 layers); no config field makes
them smaller. ``from_pretrained`` builds the architecture from the config *first* and then copies the
saved tensors in, so a checkpoint built small can only be loaded back by building the same small
architecture: the shrink is needed at construction, in the builder and when loading.

`shrunk_pi_architecture` does exactly that, for the duration of a ``with`` block only: it replaces
two names of ``lerobot.policies.<pi0|pi05>.modeling_<..>`` (``get_gemma_config``, the Gemma sizes of
a variant name, and ``PaliGemmaForConditionalGenerationWithPiGemma``, wrapped to size the vision tower
and its projector) and puts the originals back on exit, under a lock. Nothing else of LeRobot is
touched, and outside the block LeRobot is as shipped.

Where it is used:
- `lerobot_zenoh.server.checkpoint.build_checkpoint` (``--policy-type pi0|pi05``) builds inside it and
  records the sizes in the checkpoint's ``lerobot_zenoh_features.json`` under ``test_architecture``;
- the flow-matching runner loads a checkpoint inside it **only** when that sidecar key is present
  (logging that a test architecture is being built). A user's pi0/pi05 checkpoint has no such key and
  loads with nothing replaced; a test checks that the two names are LeRobot's own again afterwards.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from lerobot_zenoh.errors import PolicyError

#: The sizes the builder uses: Gemma widths with 8 query heads (pi0's shared attention between the
#: VLM and the action expert needs equal head counts and head dims), 2 layers each, a 1-layer SigLIP
#: on 56x56 images (16 patches). ~17 M parameters, nearly all in the two 257,152-entry vocabulary
#: tables LeRobot fixes.
TINY_PI_ARCHITECTURE: dict[str, Any] = {
    "gemma": {
        "gemma_2b": {"width": 32, "depth": 2, "mlp_dim": 64, "num_heads": 8, "num_kv_heads": 1, "head_dim": 8},
        "gemma_300m": {"width": 32, "depth": 2, "mlp_dim": 64, "num_heads": 8, "num_kv_heads": 1, "head_dim": 8},
    },
    "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
               "patch_size": 14},
    "image_resolution": [56, 56],
}

#: A larger test preset for measurements (`lerobot-zenoh-build-checkpoint --architecture=small`): the
#: VLM 256 wide x 6 layers (8 heads of 32, one KV head), the action expert half as wide with the same
#: depth and heads (pi0.5's 2B / 300M ratio), a 2-layer SigLIP 128 wide on 224x224 images in 14x14
#: patches (256 image tokens per camera, as a real pi0.5). ~80 M parameters, most of them still the
#: vocabulary tables; large enough that a prefill costs what it costs relative to a decode step.
SMALL_PI_ARCHITECTURE: dict[str, Any] = {
    "gemma": {
        "gemma_2b": {"width": 256, "depth": 6, "mlp_dim": 1024, "num_heads": 8, "num_kv_heads": 1, "head_dim": 32},
        "gemma_300m": {"width": 128, "depth": 6, "mlp_dim": 512, "num_heads": 8, "num_kv_heads": 1, "head_dim": 32},
    },
    "vision": {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
               "patch_size": 14},
    "image_resolution": [224, 224],
}

#: The builder's presets by name (`build_checkpoint(..., architecture=...)`).
PI_ARCHITECTURES: dict[str, dict[str, Any]] = {"tiny": TINY_PI_ARCHITECTURE, "small": SMALL_PI_ARCHITECTURE}

_MODULES = {"pi0": "lerobot.policies.pi0.modeling_pi0", "pi05": "lerobot.policies.pi05.modeling_pi05"}
_GEMMA_FIELDS = ("width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim")
_VISION_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "patch_size")
_lock = threading.Lock()


def validate_architecture(policy_type: str, arch: Any, where: str) -> dict[str, Any]:
    """`arch` as `shrunk_pi_architecture` takes it, or `PolicyError` naming `where`."""
    if policy_type not in _MODULES:
        raise PolicyError(f"{where}: test_architecture applies to pi0/pi05 only, not {policy_type!r}")
    try:
        gemma = {v: {f: int(arch["gemma"][v][f]) for f in _GEMMA_FIELDS} for v in ("gemma_2b", "gemma_300m")}
        vision = {f: int(arch["vision"][f]) for f in _VISION_FIELDS}
    except (KeyError, TypeError, ValueError) as exc:
        raise PolicyError(f"{where}: malformed test_architecture ({type(exc).__name__}: {exc})") from exc
    return {"gemma": gemma, "vision": vision}


@contextlib.contextmanager
def shrunk_pi_architecture(policy_type: str, arch: Mapping[str, Any]) -> Iterator[None]:
    """Within the block, pi0/pi05 models are built with the Gemma and SigLIP sizes of `arch`."""
    arch = validate_architecture(policy_type, arch, "shrunk_pi_architecture")
    module = importlib.import_module(_MODULES[policy_type])
    with _lock:
        original_get = module.get_gemma_config
        original_cls = module.PaliGemmaForConditionalGenerationWithPiGemma

        def get_gemma_config(variant: str):
            if variant not in arch["gemma"]:
                return original_get(variant)  # raises LeRobot's own error
            return module.GemmaConfig(**arch["gemma"][variant])

        def paligemma(config):
            vision = config.vision_config
            for name, value in arch["vision"].items():
                setattr(vision, name, value)
            # The projector maps vision features to the language model's width (2048 for gemma_2b,
            # hard-coded by LeRobot).
            vision.projection_dim = config.text_config.hidden_size
            return original_cls(config=config)

        module.get_gemma_config = get_gemma_config
        module.PaliGemmaForConditionalGenerationWithPiGemma = paligemma
        try:
            yield
        finally:
            module.get_gemma_config = original_get
            module.PaliGemmaForConditionalGenerationWithPiGemma = original_cls
