"""Policy runners: one module per policy family behind one seam (`base.PolicyRunner`).

    base.py        the seam: PolicySpec + RunnerCapabilities, InferenceRequest, InferenceResult,
                   PolicyRunner, BaseRunner (warm-up, `infer` convenience); no torch
    lerobot.py     what every LeRobot family shares: reading a checkpoint, the spec, pre/post-processing,
                   load options (device, dtype, local assets), the loaded-weights check
    compiled.py    compiled inference (the manifest's `compile`): one torch.compile graph per batch bucket
    compile_cache.py  the compile cache folder (`compile_cache_dir`): who may write there, checked at start-up
    act.py         ACT (one forward pass per batch)
    diffusion.py   Diffusion (per-session history, seeded noise, denoising updates)
    flow_matching.py  SmolVLA, pi0, pi0.5 (task-conditioned, one forward pass per batch, per-row noise)
    pi0_fast.py    pi0-FAST (autoregressive FAST tokens, decoded by the project's own code) with
                   decode_batch.py (iteration-level batching, KV slots) and fast_tokens.py (the format)
    synthetic.py   a torch-free fake with a set latency (tests, benchmarks), and scripted task
                   components (text, verdicts, silence)
    vlm.py         a transformers VLM as a task component: System 2 text, safety / monitor verdicts
    pi05_language.py  pi0.5 answering System 1 and System 2 from one prefill, text batched across
                   frames and robots (a manifest entry's `language` block)

`RUNNERS` maps LeRobot's policy type (``config.json``'s ``type``) to the runner class serving it, as
`register_scheduler` does for schedulers: a new family is one module with a `LeRobotRunner` subclass
that declares its capabilities (`capabilities_for`), registered with `register_runner` (here for the
built-in ones, or by a plugin at import; docs/policies.md). The server decides from the declared
capabilities, never by probing a runner's class. Importing this package imports neither torch nor
lerobot. `hub.py` resolves a checkpoint or asset named by Hugging Face hub id into its snapshot folder.

May import (server/): nothing. Runners know no manifest (`server/config/runner_loading.py` builds a
runner from a manifest entry) and no serving; every room above imports them.
"""

from __future__ import annotations

from pathlib import Path

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
from lerobot_zenoh.server.runners.flow_matching import FlowMatchingRunner
from lerobot_zenoh.server.runners.lerobot import LeRobotRunner, LoadOptions, RtcSettings, read_config
from lerobot_zenoh.server.runners.pi0_fast import Pi0FastRunner

__all__ = [
    "REFUSED",
    "RUNNERS",
    "BaseRunner",
    "InferenceRequest",
    "InferenceResult",
    "LoadOptions",
    "PolicyRunner",
    "PolicySpec",
    "RtcSettings",
    "RunnerCapabilities",
    "load_policy_runner",
    "register_runner",
]

#: LeRobot policy type -> the runner class that serves its checkpoints.
RUNNERS: dict[str, type[LeRobotRunner]] = {
    "act": ActRunner,
    "diffusion": DiffusionRunner,
    "pi0": FlowMatchingRunner,
    "pi05": FlowMatchingRunner,
    "pi0_fast": Pi0FastRunner,
    "smolvla": FlowMatchingRunner,
}

#: LeRobot 0.6.1 policy types the server refuses at start-up, and why (docs/policies.md has the table).
#: A type in neither table is refused as unknown (e.g. a plugin): it needs a runner module first.
REFUSED: dict[str, str] = {
    "gaussian_actor": "an RL actor that returns single actions (its predict_action_chunk raises "
                      "NotImplementedError): there is no chunk to serve",
    "tdmpc": "an RL planner: predict_action_chunk reads observation queues that select_action fills inside "
             "the shared model, and its MPPI planner keeps the previous plan in the model (per-robot state)",
    "vqbet": "predict_action_chunk reads n_obs_steps observation queues that select_action fills inside the "
             "shared model; it needs a runner keeping that history per session (as Diffusion's does)",
    "multi_task_dit": "predict_action_chunk reads observation queues filled inside the shared model, and it "
                      "loads CLIP vision/text encoders from the hub at construction",
    "lingbot_va": "a streaming world model: its KV cache, first-chunk flag and executed actions live inside "
                  "the model for one episode of one robot",
    "groot": "GR00TN17.from_pretrained loads its backbone with trust_remote_code=True (hard-coded) and fetches the "
             "GR00T-N1.7-3B weights and a Cosmos backbone with hf_hub_download at construction: code from the "
             "hub would run on the server",
    "xvla": "predict_action_chunk fills observation queues inside the shared model (populate_queues), so "
            "sessions would mix; its tokenizer is a config field (tokenizer_name) that could name a local folder",
    "eo1": "not served yet: its Qwen2.5-VL backbone is a config field (vlm_base, a local folder works) but there "
           "is no runner for it and no offline tiny model to test one",
    "molmoact2": "not served yet: its MolmoAct2 base checkpoint and FAST tokenizer are config fields "
                 "(checkpoint_path, discrete_action_tokenizer; a local folder is used as is, a hub id is fetched "
                 "with snapshot_download) but there is no runner for it and no offline tiny model to test one",
    "wall_x": "loads its action tokenizer with trust_remote_code=True (action_tokenizer_path) and "
              "predict_action_chunk fills observation queues inside the shared model (populate_queues)",
    "evo1": "not served yet: its InternVL3 VLM is a config field (vlm_model_name, a local folder works) but there "
            "is no runner for it and no offline tiny model to test one",
    "vla_jepa": "predict_action_chunk fills observation queues inside the shared model (populate_queues); its "
                "Qwen3-VL and V-JEPA encoders are config fields (qwen_model_name, jepa_encoder_name)",
    "fastwam": "builds its Wan 2.2 video model, T5 tokenizer and text encoder (base_model_id: the hub id or a "
               "local Wan 2.2 folder) at construction; no runner and no offline tiny model yet",
}


def register_runner(policy_type: str, runner_cls: type[LeRobotRunner], *, replace: bool = False) -> None:
    """Serve checkpoints of LeRobot policy type `policy_type` with `runner_cls` (a `LeRobotRunner`
    subclass: `from_checkpoint`, `capabilities_for`). A type already served is refused unless
    `replace`; a type the server refuses (`REFUSED`) becomes served once registered."""
    if not (isinstance(runner_cls, type) and issubclass(runner_cls, LeRobotRunner)):
        raise TypeError(f"register_runner({policy_type!r}): {runner_cls!r} is not a LeRobotRunner subclass")
    if policy_type in RUNNERS and not replace:
        raise ValueError(f"policy type {policy_type!r} is served by {RUNNERS[policy_type].__name__} already "
                         "(replace=True to serve it with another runner)")
    RUNNERS[policy_type] = runner_cls
    REFUSED.pop(policy_type, None)


def load_policy_runner(pretrained_path: str | Path, device: str = "cpu", *,
                       options: LoadOptions | None = None) -> PolicyRunner:
    """Load a local LeRobot checkpoint folder as the runner `RUNNERS` names for its policy type,
    on `device` (or as `options` say: device, dtype, local asset folders).

    A hub id is resolved into its snapshot folder first, by `load_runner` (server/config/runner_loading.py,
    through `hub.py`). Raises `PolicyError` naming the path on any failure, and for a type without a
    runner, the type and the supported ones.
    """
    path = Path(pretrained_path)
    config = read_config(path)
    runner_cls = RUNNERS.get(config.type)
    if runner_cls is None:
        why = REFUSED.get(config.type, "no runner serves this type")
        raise PolicyError(f"{path}: policy type {config.type!r} is not served: {why} "
                          f"(supported: {', '.join(sorted(RUNNERS))})")
    return runner_cls.from_checkpoint(path, config, options or LoadOptions(device=device))
