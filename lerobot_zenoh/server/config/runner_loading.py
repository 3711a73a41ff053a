"""The runner a manifest entry asks for: its `synthetic` policy, its VLM folder (`vlm`), or its
checkpoint folder (a local folder, else a Hugging Face hub id), with the family blocks it gives
handed to the runner that takes them. The bridge from the manifest down to `runners/`, which never
imports the manifest."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lerobot_zenoh.errors import ConfigError, PolicyError
from lerobot_zenoh.server.runners import LoadOptions, PolicyRunner, load_policy_runner, read_config

if TYPE_CHECKING:
    from lerobot_zenoh.server.config.manifest import Manifest, ModelEntry

__all__ = ["FAMILY_BLOCKS", "load_runner"]


def load_runner(manifest: Manifest, entry: ModelEntry) -> PolicyRunner:
    """Build the runner a manifest entry asks for: its `synthetic` policy, its VLM folder (`vlm`), or its
    checkpoint folder.
    Raises `PolicyError` (or `ConfigError`: a synthetic entry with `rtc.enabled`) naming the entry or the path."""
    field = f"server[{entry.model_id}]."
    if entry.compile.enabled:
        _check_compile(manifest, entry, field)
    if entry.synthetic is not None:
        if entry.rtc.enabled:
            raise ConfigError(f"{field}rtc.enabled", "the synthetic policy has no RTC guidance to configure; "
                                                     "declare RTC with synthetic.rtc instead")
        from lerobot_zenoh.server.runners.synthetic import SyntheticPolicy

        return SyntheticPolicy(entry.synthetic, fps=entry.fps)
    from lerobot_zenoh.server.runners.hub import checkpoint_folder

    # A local folder, else a Hugging Face hub id (downloaded, or from the cache offline).
    path = checkpoint_folder(entry.pretrained_path, manifest.resolve_path(entry),
                             f"{manifest.source}: server[{entry.model_id}].pretrained_path")
    if entry.vlm is not None:
        from lerobot_zenoh.server.runners.vlm import VlmRunner

        return VlmRunner.from_pretrained(path, entry.vlm, fps=entry.fps, device=entry.device, dtype=entry.dtype,
                                         field_prefix=field)
    options = LoadOptions(
        device=entry.device,
        dtype=entry.dtype,
        tokenizer_path=manifest.resolve_asset(entry.tokenizer_path),
        vlm_path=manifest.resolve_asset(entry.vlm_path),
        rtc=entry.rtc,
        compile=entry.compile,
        max_batch=entry.max_batch_size if isinstance(entry.max_batch_size, int) else entry.profile_max_batch,
        images_on_device=entry.images_on_device,
        field_prefix=field,
    )
    if entry.language is not None:  # pi0.5 answering text from the prefill of its actions
        from lerobot_zenoh.server.runners.pi05_language import Pi05LanguageRunner

        config = read_config(path)
        if config.type != "pi05":
            raise PolicyError(f"{field}language: {path} is a {config.type!r} checkpoint; text from the shared "
                              "prefill needs pi05")
        runner = Pi05LanguageRunner.from_checkpoint(path, config, options)
    else:
        runner = load_policy_runner(path, options=options)
    # The family blocks the manifest gives (each validated by the runner's own settings class),
    # handed to the runner that declares it takes them.
    takes = dict(runner.spec.capabilities.settings_blocks)
    for block in FAMILY_BLOCKS:
        settings = getattr(entry, block)
        if settings is None:
            continue
        if block not in takes:
            raise PolicyError(f"{field}{block}: {path} is a {runner.spec.policy_type!r} checkpoint, whose runner "
                              f"takes no {block} block ({FAMILY_BLOCKS[block]})")
        getattr(runner, takes[block])(settings)
    return runner


def _check_compile(manifest: Manifest, entry: ModelEntry, field: str) -> None:
    """A `compile` block the model cannot take, refused before anything loads (`ConfigError` naming it);
    the compile cache folder (the manifest's, else the server's private one) checked and put where
    inductor and Triton read it (`compile_cache.use_folder`: `ConfigError` naming compile_cache_dir)."""
    from lerobot_zenoh.server.runners.compile_cache import use_folder
    from lerobot_zenoh.server.runners.compiled import check_compile

    check_compile(entry.compile, entry.device, f"{field}compile")
    for block, what in (("synthetic", "the synthetic policy"), ("vlm", "a VLM component"),
                        ("language", "a pi0.5 answering text (language)")):
        if getattr(entry, block) is not None:
            raise ConfigError(f"{field}compile", f"{what} is not compiled; use off")
    # Inductor reads it on each compilation: one folder for the process. Made absolute by use_folder:
    # inductor runs the C++ compiler from another folder, so a relative path fails every compile.
    use_folder(manifest.resolve_asset(manifest.compile_cache_dir))


#: Manifest blocks that configure one policy family, and what each is for (the runner declares
#: which it takes: `RunnerCapabilities.settings_blocks`).
FAMILY_BLOCKS = {
    "decode": "it configures pi0_fast's continuous batching",
    "language": "it configures pi0.5's text from the shared prefill",
}
