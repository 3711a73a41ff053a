"""Tiny pi0 / pi0.5 / pi0-FAST architectures for offline tests and demos, built without patching LeRobot.

LeRobot 0.6.1 builds pi0/pi05 from two fixed Gemma variants (``paligemma_variant``,
``action_expert_variant``: ``gemma_300m`` or ``gemma_2b``, 4 B parameters together) and a SigLIP
vision tower taken from transformers' PaliGemma defaults (1152 wide, 27 layers); no config field makes
them smaller. ``from_pretrained`` builds the architecture from the config *first* and then copies the
saved tensors in, so a checkpoint built small can only be loaded back by building the same small
architecture: the sizes are needed at construction, in the builder and when loading.

`tiny_policy_class` returns a subclass of LeRobot's policy class whose constructor runs LeRobot's own
constructor code with two names resolved differently: ``get_gemma_config`` (the Gemma sizes of a
variant name) and ``PaliGemmaForConditionalGenerationWithPiGemma`` (wrapped to size the vision tower
and its projector). The constructors along the way (policy -> model -> PaliGemma with expert) are
re-bound to a private copy of their module's names; LeRobot's modules and classes are never modified,
so a real checkpoint loaded at the same time, in another thread, builds LeRobot's own sizes.

Where it is used:
- `lerobot_zenoh.checkpoint_builder.build.build_checkpoint` (``--policy-type pi0|pi05|pi0_fast``)
  builds with it and records the sizes in the checkpoint's ``lerobot_zenoh_features.json`` under
  ``test_architecture``;
- the flow-matching and pi0-FAST runners load a checkpoint with it **only** when that sidecar key is
  present (logging that a test architecture is being built). A user's checkpoint has no such key and
  is loaded through LeRobot's own class (tests/test_vla.py checks both).
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Mapping
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

#: LeRobot's own sizes (pi0 and pi0.5 only): its default variants as they are, ``gemma_2b`` (2048 wide x
#: 18 layers) with a ``gemma_300m`` action expert (1024 x 18) and SigLIP so400m (1152 x 27 on 224x224
#: images), 4.0 B (pi0) / 4.1 B (pi0.5) parameters. Built by LeRobot's own class: the checkpoint declares
#: no test architecture, so the server loads it as it loads a user's.
FULL_ARCHITECTURE = "full"

#: Every name `build_checkpoint(..., architecture=...)` takes.
ARCHITECTURES = (*PI_ARCHITECTURES, FULL_ARCHITECTURE)

_MODULES = {"pi0": "lerobot.policies.pi0.modeling_pi0", "pi05": "lerobot.policies.pi05.modeling_pi05",
            "pi0_fast": "lerobot.policies.pi0_fast.modeling_pi0_fast"}
_GEMMA_FIELDS = ("width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim")
_VISION_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "patch_size")


def validate_architecture(policy_type: str, arch: Any, where: str) -> dict[str, Any]:
    """`arch` as `tiny_policy_class` takes it, or `PolicyError` naming `where`."""
    if policy_type not in _MODULES:
        raise PolicyError(f"{where}: test_architecture applies to pi0/pi05/pi0_fast only, not {policy_type!r}")
    try:
        gemma = {v: {f: int(arch["gemma"][v][f]) for f in _GEMMA_FIELDS} for v in ("gemma_2b", "gemma_300m")}
        vision = {f: int(arch["vision"][f]) for f in _VISION_FIELDS}
        # pi0-FAST does not pass its image resolution to the vision tower (224 px unless given here).
        if "image_size" in arch["vision"]:
            vision["image_size"] = int(arch["vision"]["image_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PolicyError(f"{where}: malformed test_architecture ({type(exc).__name__}: {exc})") from exc
    return {"gemma": gemma, "vision": vision}


#: The constructors between the policy class and the two names above, per policy type, outermost
#: first: each is re-bound so that the names it constructs resolve to the next re-bound class.
_CONSTRUCTION_CHAIN = {
    "pi0": ("PI0Policy", "PI0Pytorch", "PaliGemmaWithExpertModel"),
    "pi05": ("PI05Policy", "PI05Pytorch", "PaliGemmaWithExpertModel"),
    "pi0_fast": ("PI0FastPolicy", "PI0FastPytorch", "PI0FastPaliGemma"),
}


def _rebound(cls: type, names: Mapping[str, Any]) -> type:
    """A subclass of `cls` whose ``__init__`` is `cls`'s own code reading `names` over its module's."""
    init = cls.__init__
    scope = {**init.__globals__, **names}
    code = types.FunctionType(init.__code__, scope, init.__name__, init.__defaults__, init.__closure__)
    code.__kwdefaults__ = init.__kwdefaults__
    return type(cls.__name__, (cls,), {"__init__": code, "__module__": __name__, "__qualname__": cls.__name__})


def tiny_policy_class(policy_type: str, arch: Mapping[str, Any]) -> type:
    """LeRobot's `policy_type` policy class, subclassed to build the Gemma and SigLIP sizes of `arch`.

    ``tiny_policy_class(...)(config)`` builds a random model; ``.from_pretrained(path, ...)`` loads a
    checkpoint built with the same `arch` (LeRobot's ``from_pretrained`` constructs ``cls(config)``).
    """
    arch = validate_architecture(policy_type, arch, "tiny_policy_class")
    module = importlib.import_module(_MODULES[policy_type])
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

    policy_name, model_name, vlm_name = _CONSTRUCTION_CHAIN[policy_type]
    vlm = _rebound(getattr(module, vlm_name), {"PaliGemmaForConditionalGenerationWithPiGemma": paligemma})
    model = _rebound(getattr(module, model_name), {"get_gemma_config": get_gemma_config, vlm_name: vlm})
    return _rebound(getattr(module, policy_name), {model_name: model})
