"""Build a LeRobot checkpoint offline, with random weights, for demos and tests.

The folder it writes is an ordinary LeRobot checkpoint (``config.json``, ``model.safetensors``,
``policy_preprocessor.json``/``policy_postprocessor.json`` + normalizer stats) loaded by the very
``from_pretrained`` path a trained checkpoint goes through, plus our ``lerobot_zenoh_features.json``
sidecar carrying the joint and camera names a LeRobot config does not store. The weights are random:
the actions mean nothing, but shapes, normalization and timing are those of a real model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.server.runners.base import OBS_IMAGES_PREFIX, OBS_STATE_KEY, PolicySpec
from lerobot_zenoh.server.runners.lerobot import ACTION_KEY, FEATURES_SIDECAR_NAME, FEATURES_SIDECAR_VERSION

log = logging.getLogger(__name__)

# Architecture defaults on top of LeRobot's config defaults, chosen so that a 2-core CPU answers a
# chunk for 2 cameras of 96x128 in roughly 50-150 ms (see docs/policies.md for measurements).
DEMO_OVERRIDES: dict[str, dict[str, Any]] = {
    # LeRobot's ACT architecture as is (resnet18, dim_model 512, 4 encoder layers).
    "act": {},
    # LeRobot's default Diffusion U-Net (512, 1024, 2048) at 100 DDPM steps takes ~30 s per chunk on
    # such a CPU; a narrower U-Net and 10 steps keep the structure at interactive speed.
    "diffusion": {"down_dims": (64, 128, 256), "num_inference_steps": 10},
    # The VLAs are built tiny (random weights, a local tokenizer; docs/policies.md "VLAs"): SmolVLA
    # from a tiny local SmolVLM (4 text layers of 64, 2 vision layers of 32, 64x64 images), pi0/pi05
    # with `tiny_pi`'s small architecture (their Gemma sizes are fixed by variant name in LeRobot).
    "smolvla": {"num_vlm_layers": 4, "resize_imgs_with_padding": (64, 64)},
    "pi0": {},
    "pi05": {},
    # pi0-FAST: shrunk like pi0 (its Gemma size is fixed by variant name), with a FAST action tokenizer
    # fitted locally and a PaliGemma-style text tokenizer (docs/policies.md "pi0-FAST").
    "pi0_fast": {"max_decoding_steps": 256, "validate_action_token_prefix": False},
}

#: Policy types built with a local tokenizer (and, for SmolVLA, a local VLM config + processor).
VLA_TYPES = ("smolvla", "pi0", "pi05", "pi0_fast")

# Where the builder puts a VLA's assets inside the checkpoint folder (recorded in the sidecar's
# `assets`, relative to the folder).
TOKENIZER_DIR = "tokenizer"
VLM_DIR = "vlm"
FAST_TOKENIZER_DIR = "fast_tokenizer"  # pi0-FAST's action tokenizer

# pi0/pi05 processors name this tokenizer in code (LeRobot 0.6.1); a real checkpoint's
# policy_preprocessor.json says so too, and the builder writes the same name.
PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"

# The few sentences the tiny byte-level BPE tokenizer is trained on (any text still tokenizes: the
# byte alphabet is always in the vocabulary).
_TOKENIZER_CORPUS = (
    "pick up the red cube and place it in the bowl",
    "open the drawer, then close it",
    "fold the towel on the table",
    "push the green block to the left",
    "Task: stack the cups, State: 12 40 255 0 7 128;\nAction: ",
)
# SmolVLM's special tokens (its modeling code reads their ids from the tokenizer).
_SMOLVLM_SPECIAL = {
    "fake_image_token": "<fake_token_around_image>",
    "global_image_token": "<global-img>",
    "image_token": "<image>",
    "end_of_utterance_token": "<end_of_utterance>",
}

# Set by the builder from its own arguments; overriding them would desynchronize config and sidecar.
_MANAGED_FIELDS = frozenset(
    {"input_features", "output_features", "device", "pretrained_path", "chunk_size", "n_action_steps",
     "vlm_model_name", "text_tokenizer_name", "action_tokenizer_name"}
)

# ImageNet statistics (what LeRobot's ResNet backbones expect), shaped (C, 1, 1) like compute_stats.
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)
_QUANTILE_NAMES = ("q01", "q99", "q10", "q90")
_STAT_NAMES = ("mean", "std", "min", "max", *_QUANTILE_NAMES)


def build_checkpoint(
    output_dir: str | Path,
    *,
    policy_type: str = "act",
    state_names: Sequence[str],
    action_names: Sequence[str],
    cameras: Mapping[str, tuple[int, int]],
    chunk_size: int,
    fps: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    stats: Mapping[str, Mapping[str, Sequence[float]]] | None = None,
    seed: int = 0,
    force: bool = False,
    architecture: str = "tiny",
    weights: bool = True,
) -> Path:
    """Write a randomly initialized `policy_type` checkpoint to `output_dir` and return its path.

    `overrides` set config fields on top of `DEMO_OVERRIDES[policy_type]` (e.g. ``{"dim_model": 256}``).
    `stats` replace the default normalization statistics of ``"observation.state"`` / ``"action"``
    (per-dimension ``mean``/``std``/``min``/``max``; defaults mean 0, std 1, min -1, max 1, so that
    normalization is the identity). Images use ImageNet mean/std. Weights are drawn from a private RNG
    seeded with `seed`. An existing non-empty `output_dir` is refused unless `force`, and even then only
    replaced when it holds a checkpoint (``config.json``). Bad arguments raise `ConfigError` naming
    the argument.

    `architecture` (pi0, pi05 and pi0_fast; LeRobot fixes their sizes by variant name): ``tiny`` (the test
    preset, `tiny_pi.TINY_PI_ARCHITECTURE`) or ``small`` (`tiny_pi.SMALL_PI_ARCHITECTURE`, for
    measurements; pi0_fast: `tiny_pi0_fast.PI0_FAST_SHAPES`), or (pi0 and pi05 only) ``full``: LeRobot's
    own default variants, real size (`tiny_pi.FULL_ARCHITECTURE`; about 16 GB of float32 weights, and as
    much memory and a minute or more of CPU time to build them). `weights=False` writes everything but
    ``model.safetensors`` and builds no model: the folder a benchmark builds its model from on the
    device itself (`checkpoint_builder.in_memory`); a server refuses such a folder. A pi05's PaliGemma ``lm_head`` (which pi0.5 never calls for actions) is made
    usable for greedy text: its rows beyond the bundled tokenizer's vocabulary are zeroed, so that
    the most likely token is one the tokenizer can decode (docs/policies.md, "pi0.5: actions and
    language from one prefill").
    """
    from lerobot_zenoh.checkpoint_builder.tiny_pi import ARCHITECTURES, FULL_ARCHITECTURE, PI_ARCHITECTURES

    if architecture not in ARCHITECTURES:
        raise ConfigError("architecture", f"{architecture!r} is not one of {', '.join(ARCHITECTURES)}")
    if architecture != "tiny" and policy_type not in ("pi0", "pi05", "pi0_fast"):
        raise ConfigError("architecture", f"applies to pi0, pi05 and pi0_fast only, not {policy_type!r}")
    if architecture == FULL_ARCHITECTURE and policy_type not in ("pi0", "pi05"):
        raise ConfigError("architecture", f"{FULL_ARCHITECTURE} applies to pi0 and pi05 only, not {policy_type!r}")
    # None: LeRobot's own sizes, built by LeRobot's own class.
    arch = PI_ARCHITECTURES.get(architecture)
    if policy_type not in DEMO_OVERRIDES:
        choices = ", ".join(DEMO_OVERRIDES)
        raise ConfigError("policy_type", f"{policy_type!r} is not supported (choose from {choices})")
    spec = PolicySpec(
        policy_type=policy_type,
        state_names=tuple(state_names),
        cameras=dict(cameras),
        action_names=tuple(action_names),
        chunk_size=chunk_size,
        fps=fps,
    )
    if not isinstance(seed, int):
        raise ConfigError("seed", f"must be an integer, got {seed!r}")
    output = Path(output_dir)
    _check_output(output, force)

    log.info("importing torch and LeRobot ...")
    import torch

    from lerobot.configs import FeatureType, PolicyFeature
    from lerobot.policies import make_policy_config, make_pre_post_processors

    input_features = {OBS_STATE_KEY: PolicyFeature(type=FeatureType.STATE, shape=(spec.state_dim,))}
    for cam, (h, w) in spec.cameras.items():
        input_features[f"{OBS_IMAGES_PREFIX}{cam}"] = PolicyFeature(type=FeatureType.VISUAL, shape=(3, h, w))
    output_features = {ACTION_KEY: PolicyFeature(type=FeatureType.ACTION, shape=(spec.action_dim,))}

    kwargs = _config_kwargs(policy_type, spec, overrides, arch)
    if policy_type == "pi0_fast":
        from lerobot_zenoh.checkpoint_builder.tiny_pi0_fast import PI0_FAST_SHAPES

        arch, shape_fields = PI0_FAST_SHAPES[architecture]
        kwargs = {**shape_fields, **kwargs}
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    log.info("building a random-weight %s policy (seed %d) ...", policy_type, seed)
    try:
        assets: dict[str, str] = {}
        tokenizer = None
        if policy_type == "pi0_fast":
            tokenizer = _pi0_fast_tokenizers(staging, spec, kwargs, seed)
            assets.update(tokenizer=TOKENIZER_DIR, action_tokenizer=FAST_TOKENIZER_DIR)
        elif policy_type in VLA_TYPES:
            tokenizer = train_tiny_tokenizer(smolvlm=policy_type == "smolvla")
            tokenizer.save_pretrained(staging / TOKENIZER_DIR)
            assets["tokenizer"] = TOKENIZER_DIR
        if policy_type == "smolvla":
            save_tiny_smolvlm(staging / VLM_DIR, tokenizer)
            assets["vlm"] = VLM_DIR
            kwargs["vlm_model_name"] = str(staging / VLM_DIR)  # read while the model is built
        try:
            config = make_policy_config(
                policy_type, input_features=input_features, output_features=output_features, **kwargs
            )
            policy = random_policy(_policy_class(policy_type, arch), config, seed=seed) if weights else None
            if policy is not None and policy_type == "pi05":
                _usable_lm_head(policy, len(tokenizer))
        except Exception as exc:  # building a model from a config is pure: any failure means a bad config
            raise ConfigError("overrides", f"LeRobot rejected the {policy_type} config: {exc}") from exc

        dataset_stats = {
            key: {name: torch.tensor(values) for name, values in per_key.items()}
            for key, per_key in _dataset_stats(spec, stats, quantiles=policy_type in VLA_TYPES).items()
        }
        with _tokenizer_named_anything(tokenizer), _fast_construction(config):
            preprocessor, postprocessor = make_pre_post_processors(config, dataset_stats=dataset_stats)
        if policy_type == "smolvla":
            # The saved config and processor name the VLM folder where it will be once in place, so
            # that LeRobot's own tools load the checkpoint too; the server also finds it through the
            # sidecar's `assets` if the folder is moved.
            config.vlm_model_name = str(output.resolve() / VLM_DIR)
        if policy_type == "pi0_fast":
            from lerobot_zenoh.server.runners.fast_tokens import FastActionTokenizer
            from lerobot_zenoh.checkpoint_builder.tiny_pi0_fast import script_end_of_action

            factor = script_end_of_action(
                policy, preprocessor, spec, end_token=tokenizer.convert_tokens_to_ids("|"),
                fast_tokens=FastActionTokenizer.from_folder(staging / FAST_TOKENIZER_DIR), seed=seed)
            log.info("pi0-FAST: greedy decoding scripted to end after ~36 FAST tokens (end row x %.2f)", factor)
            # The saved config and processor name both tokenizers where they will be once in place.
            config.text_tokenizer_name = str(output.resolve() / TOKENIZER_DIR)
            config.action_tokenizer_name = str(output.resolve() / FAST_TOKENIZER_DIR)
            _rename_fast_tokenizers(preprocessor, config)
        else:
            _rename_tokenizer(preprocessor,
                              config.vlm_model_name if policy_type == "smolvla" else PALIGEMMA_TOKENIZER)

        if policy is not None:
            log.info("saving %.1f M parameters and the processors to %s ...",
                     sum(p.numel() for p in policy.parameters()) / 1e6, output)
            policy.save_pretrained(staging)
        else:  # the config alone, as save_pretrained writes it
            config.save_pretrained(staging)
        preprocessor.save_pretrained(staging)
        postprocessor.save_pretrained(staging)
        sidecar = {
            "version": FEATURES_SIDECAR_VERSION,
            "policy_type": policy_type,
            "state_names": list(spec.state_names),
            "action_names": list(spec.action_names),
            "cameras": {cam: [h, w] for cam, (h, w) in spec.cameras.items()},
            "chunk_size": spec.chunk_size,
            "fps": spec.fps,
        }
        if assets:
            sidecar["assets"] = assets
        if arch is not None and policy_type in ("pi0", "pi05", "pi0_fast"):
            sidecar["test_architecture"] = arch
        (staging / FEATURES_SIDECAR_NAME).write_text(json.dumps(sidecar, indent=2) + "\n")
        _publish(staging, output, force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


def train_tiny_tokenizer(*, smolvlm: bool = False) -> Any:
    """A byte-level BPE tokenizer trained with the `tokenizers` library on a few sentences, wrapped as
    a transformers fast tokenizer (saved with ``save_pretrained``: tokenizer.json +
    tokenizer_config.json). With `smolvlm`, it carries SmolVLM's special image tokens, whose ids
    SmolVLA's model reads from the tokenizer. Any text tokenizes (the byte alphabet is in the vocabulary).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<pad>", *(_SMOLVLM_SPECIAL.values() if smolvlm else ())]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TOKENIZER_CORPUS, trainer)
    extra = {"extra_special_tokens": dict(_SMOLVLM_SPECIAL)} if smolvlm else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<pad>", unk_token="<|endoftext|>", **extra)


def save_tiny_smolvlm(folder: Path, tokenizer: Any) -> None:
    """Write a tiny SmolVLM (config + processor, no weights) to `folder`, as ``save_pretrained`` does.

    SmolVLA reads both with ``AutoConfig``/``AutoProcessor`` on its ``vlm_model_name`` even when it
    does not load VLM weights: a llama text model (4 layers of 64, vocabulary = the tokenizer's) and a
    SmolVLM vision tower (2 layers of 32, 64x64 images, 8x8 patches), pixel shuffle 2.
    """
    from transformers import SmolVLMConfig, SmolVLMProcessor
    from transformers.models.smolvlm import SmolVLMImageProcessor, SmolVLMVideoProcessor

    vocab = len(tokenizer)
    config = SmolVLMConfig(
        text_config={"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": vocab,
                     "max_position_embeddings": 512, "pad_token_id": tokenizer.pad_token_id},
        vision_config={"model_type": "smolvlm_vision", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 64, "patch_size": 8},
        scale_factor=2, image_token_id=tokenizer.image_token_id, vocab_size=vocab,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.save_pretrained(folder)
    size = {"longest_edge": 64}
    SmolVLMProcessor(
        image_processor=SmolVLMImageProcessor(size=size, max_image_size=size, do_image_splitting=False),
        video_processor=SmolVLMVideoProcessor(size=size, max_image_size=size),
        tokenizer=tokenizer, image_seq_len=4,
    ).save_pretrained(folder)


#: `build_tiny_vlm`'s vision tower: 64x64 images in 8x8 patches, pixel shuffle 2 -> 16 tokens per image.
_TINY_VLM_IMAGE = 64
_TINY_VLM_PATCH = 8
_TINY_VLM_SCALE = 2


def build_tiny_vlm(output_dir: str | Path, *, seed: int = 0, force: bool = False) -> Path:
    """Write a tiny SmolVLM (Idefics3 family) with random weights to `output_dir`, as a user's VLM
    checkpoint is laid out (``save_pretrained`` of the model and of its processor: config.json,
    model.safetensors, generation_config.json, processor and tokenizer files), for the VLM runner
    (System 2 text, safety / monitor verdicts; docs/policies.md "VLM components").

    The architecture is `save_tiny_smolvlm`'s (a llama text model of 4 layers of 64, a vision tower of
    2 layers of 32 on 64x64 images, a byte-level BPE tokenizer trained on a few sentences) with a
    processor that expands each ``<image>`` into the 16 tokens the model produces per image. About
    0.23 M parameters; its text is random tokens (the weights are random), its timing and code path
    those of a real SmolVLM. An existing non-empty `output_dir` is refused unless `force` (and then
    only replaced when it holds a config.json)."""
    if not isinstance(seed, int):
        raise ConfigError("seed", f"must be an integer, got {seed!r}")
    output = Path(output_dir)
    _check_output(output, force)
    import torch
    from transformers import AutoModelForImageTextToText, SmolVLMConfig, SmolVLMProcessor
    from transformers.models.smolvlm import SmolVLMImageProcessor, SmolVLMVideoProcessor

    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        tokenizer = train_tiny_tokenizer(smolvlm=True)
        save_tiny_smolvlm(staging, tokenizer)  # the config (the processor is replaced below)
        size = {"longest_edge": _TINY_VLM_IMAGE}
        tokens_per_image = (_TINY_VLM_IMAGE // _TINY_VLM_PATCH) ** 2 // _TINY_VLM_SCALE ** 2
        SmolVLMProcessor(
            image_processor=SmolVLMImageProcessor(size=size, max_image_size=size, do_image_splitting=False),
            video_processor=SmolVLMVideoProcessor(size=size, max_image_size=size),
            tokenizer=tokenizer, image_seq_len=tokens_per_image,
        ).save_pretrained(staging)
        config = SmolVLMConfig.from_pretrained(staging)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForImageTextToText.from_config(config)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(staging)
        _publish(staging, output, force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


def _publish(staging: Path, output: Path, force: bool) -> None:
    """Put the finished `staging` folder at `output`, checked again (it may have appeared while
    building): a reader never sees a half-written checkpoint."""
    _check_output(output, force)
    if output.exists():
        shutil.rmtree(output) if any(output.iterdir()) else output.rmdir()
    os.replace(staging, output)


def _policy_class(policy_type: str, arch: Mapping[str, Any] | None) -> type:
    """LeRobot's class for `policy_type`; pi0/pi05/pi0_fast with a test `arch`: `tiny_pi`'s subclass
    building it (their Gemma sizes are fixed by LeRobot)."""
    from lerobot.policies import get_policy_class

    if policy_type not in ("pi0", "pi05", "pi0_fast") or arch is None:
        return get_policy_class(policy_type)
    from lerobot_zenoh.checkpoint_builder.tiny_pi import tiny_policy_class

    return tiny_policy_class(policy_type, arch)


def random_policy(policy_cls: type, config: Any, *, seed: int, device: str = "cpu") -> Any:
    """``policy_cls(config)`` with random weights drawn from a private RNG seeded with `seed`, its
    tensors made on `device` from the start (``"meta"``: shapes alone, no memory), in eval mode. The
    caller's RNGs are left as they were. `config.device` must name the same device type (LeRobot's
    pi0/pi05 constructors move the model there)."""
    import torch

    where = torch.device(device)
    forked = [where.index or 0] if where.type == "cuda" else []
    with torch.random.fork_rng(devices=forked, device_type="cuda"), where, _fast_construction(config):
        torch.manual_seed(seed)
        policy = policy_cls(config)
    return policy.eval()


def _usable_lm_head(policy: Any, vocab: int) -> None:
    """Zero the rows of pi0.5's PaliGemma ``lm_head`` beyond the tokenizer's `vocab`: with random
    weights their logits are 0 while some decodable row is positive, so greedy decoding emits tokens
    the small bundled tokenizer can turn into text (LeRobot fixes the table at 257,152 rows)."""
    import torch

    with torch.no_grad():
        policy.model.paligemma_with_expert.paligemma.lm_head.weight[vocab:] = 0


def _pi0_fast_tokenizers(staging: Path, spec: PolicySpec, kwargs: dict[str, Any], seed: int) -> Any:
    """pi0-FAST's text tokenizer (PaliGemma-sized) and FAST action tokenizer (fitted on synthetic
    chunks of this checkpoint's shape), written into the staging folder; the config names them there
    while the model is built. Returns the text tokenizer."""
    from lerobot_zenoh.server.runners.fast_tokens import train_fast_tokenizer
    from lerobot_zenoh.checkpoint_builder.tiny_pi0_fast import save_paligemma_style_tokenizer, synthetic_chunks

    log.info("training pi0-FAST's tokenizers (text, FAST actions) ...")
    text = save_paligemma_style_tokenizer(staging / TOKENIZER_DIR)
    train_fast_tokenizer(synthetic_chunks(spec.chunk_size, spec.action_dim, seed=seed), staging / FAST_TOKENIZER_DIR)
    kwargs["text_tokenizer_name"] = str(staging / TOKENIZER_DIR)
    kwargs["action_tokenizer_name"] = str(staging / FAST_TOKENIZER_DIR)
    return text


@contextlib.contextmanager
def _fast_construction(config: Any):
    """pi0-FAST only: LeRobot's constructor and processor load the action tokenizer with
    ``trust_remote_code``; build them without it (`runners.pi0_fast.without_action_processor`)."""
    if getattr(config, "type", None) != "pi0_fast":
        yield
        return
    from lerobot_zenoh.server.runners.pi0_fast import without_action_processor

    with without_action_processor(config):
        yield


def _rename_fast_tokenizers(preprocessor: Any, config: Any) -> None:
    from lerobot.processor import ActionTokenizerProcessorStep, TokenizerProcessorStep

    for step in preprocessor.steps:
        if isinstance(step, TokenizerProcessorStep):
            step.tokenizer_name = config.text_tokenizer_name
        elif isinstance(step, ActionTokenizerProcessorStep):
            step.action_tokenizer_name = config.action_tokenizer_name
            step.paligemma_tokenizer_name = config.text_tokenizer_name
            step.trust_remote_code = False


@contextlib.contextmanager
def _tokenizer_named_anything(tokenizer: Any):
    """While LeRobot builds a VLA's processors, its tokenizer step gets `tokenizer` whatever name it
    asks the hub for (pi0/pi05 name PaliGemma's in code). Builder only; the step's saved name is set
    afterwards by `_rename_tokenizer`."""
    if tokenizer is None:
        yield
        return
    from lerobot.processor import tokenizer_processor

    original = tokenizer_processor.AutoTokenizer

    class _Local:
        @staticmethod
        def from_pretrained(*_args: Any, **_kwargs: Any) -> Any:
            return tokenizer

    tokenizer_processor.AutoTokenizer = _Local
    try:
        yield
    finally:
        tokenizer_processor.AutoTokenizer = original


def _rename_tokenizer(preprocessor: Any, name: str) -> None:
    from lerobot.processor import TokenizerProcessorStep

    for step in preprocessor.steps:
        if isinstance(step, TokenizerProcessorStep):
            step.tokenizer_name = name


def _check_output(output: Path, force: bool) -> None:
    if output.exists() and not output.is_dir():
        raise ConfigError("output_dir", f"{output} exists and is not a folder")
    if output.is_dir() and any(output.iterdir()):
        if not force:
            raise ConfigError(
                "output_dir", f"{output} exists and is not empty (use force / --force to replace it)"
            )
        if not (output / "config.json").is_file():
            raise ConfigError(
                "output_dir", f"{output} is not empty and holds no checkpoint (config.json); not replacing it"
            )


def _config_kwargs(policy_type: str, spec: PolicySpec, overrides: Mapping[str, Any] | None,
                   arch: Mapping[str, Any] | None) -> dict[str, Any]:
    from lerobot.configs import PreTrainedConfig

    config_cls = PreTrainedConfig.get_choice_class(policy_type)
    defaults = {}
    for f in dataclasses.fields(config_cls):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()

    user = dict(overrides or {})
    for key, value in user.items():
        if key in _MANAGED_FIELDS:
            raise ConfigError(f"overrides.{key}", "is set by the builder from its own arguments")
        if key not in defaults:
            raise ConfigError(f"overrides.{key}", f"{config_cls.__name__} has no such field")
        user[key] = _coerce(key, value, defaults[key])

    kwargs: dict[str, Any] = {"device": "cpu"}
    if "pretrained_backbone_weights" in defaults:
        kwargs["pretrained_backbone_weights"] = None
    kwargs.update(DEMO_OVERRIDES[policy_type])
    kwargs.update(user)
    if not spec.cameras:  # no policy here has an input other than state + images
        raise ConfigError("cameras", f"{policy_type} needs at least one camera")
    if policy_type in VLA_TYPES:  # the whole chunk is served (the client decides what to execute)
        kwargs["chunk_size"] = spec.chunk_size
        kwargs["n_action_steps"] = spec.chunk_size
        if policy_type in ("pi0", "pi05"):
            if arch is not None:  # a test architecture's images; else LeRobot's own (224x224)
                kwargs.setdefault("image_resolution", tuple(arch["image_resolution"]))
        if policy_type == "pi0_fast" and len(spec.action_names) > int(kwargs.get("max_action_dim", 32)):
            raise ConfigError("action_names", "more actions than pi0_fast's max_action_dim")
    elif policy_type == "act":
        kwargs["chunk_size"] = spec.chunk_size
        kwargs["n_action_steps"] = spec.chunk_size
    else:  # diffusion: horizon must hold n_obs_steps - 1 past steps + the chunk, in U-Net multiples
        if len(set(spec.cameras.values())) > 1:
            raise ConfigError("cameras", f"diffusion needs all cameras of one shape, got {spec.cameras}")
        n_obs_steps = kwargs.get("n_obs_steps", defaults["n_obs_steps"])
        down_dims = kwargs.get("down_dims", defaults["down_dims"])
        factor = 2 ** len(down_dims)
        needed = spec.chunk_size + n_obs_steps - 1
        kwargs.setdefault("horizon", math.ceil(needed / factor) * factor)
        if kwargs["horizon"] < needed:
            raise ConfigError("overrides.horizon", f"must be >= chunk_size + n_obs_steps - 1 = {needed}")
        kwargs["n_action_steps"] = spec.chunk_size
        kwargs.setdefault("drop_n_last_frames", kwargs["horizon"] - needed)
    return kwargs


def _coerce(key: str, value: Any, default: Any) -> Any:
    """Bring a JSON/YAML-typed override to the field's type (lists -> tuples, ints -> floats)."""
    if isinstance(value, list) and not isinstance(default, list):  # shapes/dims are tuples in configs
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if value is None or default is None or isinstance(default, dict | list):
        return value
    if isinstance(default, bool) != isinstance(value, bool) or not isinstance(value, type(default)):
        raise ConfigError(
            f"overrides.{key}", f"expected {type(default).__name__}, got {type(value).__name__} {value!r}"
        )
    return value


def _dataset_stats(
    spec: PolicySpec, stats: Mapping[str, Mapping[str, Sequence[float]]] | None, *, quantiles: bool = False
) -> dict[str, dict[str, list]]:
    out: dict[str, dict[str, list]] = {}
    for key, dim in ((OBS_STATE_KEY, spec.state_dim), (ACTION_KEY, spec.action_dim)):
        out[key] = {"mean": [0.0] * dim, "std": [1.0] * dim, "min": [-1.0] * dim, "max": [1.0] * dim}
        if quantiles:  # pi05 normalizes with quantiles (identity with these)
            out[key].update({q: [-1.0 if q in ("q01", "q10") else 1.0] * dim for q in _QUANTILE_NAMES})
    for key, given in (stats or {}).items():
        if key not in out:
            raise ConfigError(f"stats.{key}", f"only {OBS_STATE_KEY!r} and {ACTION_KEY!r} can be set")
        dim = len(out[key]["mean"])
        for name, values in given.items():
            if name not in _STAT_NAMES:
                raise ConfigError(f"stats.{key}.{name}", f"unknown statistic (use {', '.join(_STAT_NAMES)})")
            values = [float(v) for v in values]
            if len(values) != dim:
                raise ConfigError(f"stats.{key}.{name}", f"expected {dim} values, got {len(values)}")
            if name == "std" and min(values) <= 0:
                raise ConfigError(f"stats.{key}.std", "every std must be > 0")
            out[key][name] = values
    for cam in spec.cameras:
        out[f"{OBS_IMAGES_PREFIX}{cam}"] = {
            "mean": [[[m]] for m in _IMAGENET_MEAN],
            "std": [[[s]] for s in _IMAGENET_STD],
            "min": [[[0.0]]] * 3,
            "max": [[[1.0]]] * 3,
        }
    return out
