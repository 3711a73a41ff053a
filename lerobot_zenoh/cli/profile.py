"""`lerobot-zenoh-profile --endpoint=tcp/HOST:PORT --model_id=... --profile_name=... --output=profiles.yaml`:
measure a running server's latency against request rate and add the rows to a profile file
(docs/pipelines.md, "Serving profiles"). Run it once per batch size (restart the server with that
`max_batch_size`). `--task=T` profiles a pi0.5 serving task T's System 1 and System 2 from one
prefill (action latency while text streams, text latency and decode cost). Exit codes (docs/client.md,
"Command lines"): 0 measured; 2 a configuration mistake (one line naming the flag); 3 no server answers.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROG = "lerobot-zenoh-profile"


@dataclass
class ProfileConfig:
    # The server's endpoint (e.g. tcp/127.0.0.1:7500).
    endpoint: str
    # Profile file to create or extend (rows of the same model and batch size are replaced).
    output: str
    # The model's name in the profile file (the key task descriptors use).
    profile_name: str
    # The served model's model_id (a key chunk of the served app).
    model_id: str = "act"
    # The served app's cluster_uuid (the server manifest's).
    cluster_uuid: str = "local"
    # The served app's experiment_tag (the server manifest's).
    experiment_tag: str = "default"
    # The served model's model_version.
    model_version: str = "v1"
    # The served model's application_tag.
    application_tag: str = "default"
    # The server's max_batch_size (the status does not carry it).
    batch_size: int = 1
    # discrete (action models) or continuous (autoregressive VLMs), for a new model entry.
    batching: str = "discrete"
    # The accelerator the server runs on (the factory's `servers.hardware` must match it). An existing
    # file of another hardware is refused: profiles of different hardware go to different files.
    hardware: str = "gpu"
    # The model's accelerator memory (GB), for a new model entry (the planner checks it against
    # `servers.memory_gb`). None: not stated.
    memory_gb: float | None = None
    # Virtual clients (ids profile-0..N-1; the server must accept them).
    clients: int = 32
    # Seconds of requests as fast as the server answers, to measure its maximum throughput first.
    saturation_s: float = 3.0
    # Seconds of requests at each offered rate (each of --fractions of the maximum).
    seconds_per_rate: float = 3.0
    # An answer not back this long after its observation counts as lost.
    timeout_s: float = 10.0
    # Fractions of the measured maximum throughput to offer (Rosa: 0.1 .. 1.0).
    fractions: list[float] = field(default_factory=lambda: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
    # A pi0.5 serving System 1 and System 2 from one prefill: the task whose stream it serves (its
    # manifest's pipeline item with `text`). The clients then ask actions (bit `action_bit`) every
    # request and text (bit `text_bit`) every `text_every`-th, and the rows get `text_mean_ms` and the
    # decode cost (the model entry: components [system1, system2]).
    task: str | None = None
    # With --task: the component bit of the actions (System 1) in the task's component mask.
    action_bit: int = 0
    # With --task: the component bit of the text (System 2) in the task's component mask.
    text_bit: int = 1
    # Ask text with every N-th request of a client (the task's System 2 `every_n_chunks`).
    text_every: int = 1
    # Logging level: DEBUG, INFO, WARNING or ERROR.
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        from lerobot_zenoh.command_line import check_log_level
        from lerobot_zenoh.errors import ConfigError

        if self.batch_size < 1:
            raise ConfigError("batch_size", f"must be >= 1, got {self.batch_size}")
        if self.clients < 1:
            raise ConfigError("clients", f"must be >= 1, got {self.clients}")
        if self.batching not in ("discrete", "continuous"):
            raise ConfigError("batching", f"{self.batching!r} is not discrete or continuous")
        for name in ("saturation_s", "seconds_per_rate", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be positive, got {getattr(self, name)}")
        if self.memory_gb is not None and not self.memory_gb > 0:
            raise ConfigError("memory_gb", f"must be positive, got {self.memory_gb}")
        for name in ("action_bit", "text_bit"):
            if not 0 <= getattr(self, name) < 32:
                raise ConfigError(name, f"must be 0..31, got {getattr(self, name)}")
        if self.action_bit == self.text_bit:
            raise ConfigError("text_bit", f"is action_bit ({self.action_bit}): the two components have their own bits")
        if self.text_every < 1:
            raise ConfigError("text_every", f"must be >= 1, got {self.text_every}")
        check_log_level(self.log_level)
        if not self.fractions or any(not 0 < f <= 2 for f in self.fractions):
            raise ConfigError("fractions", f"each must be in (0, 2], got {self.fractions}")


def main(argv: list[str] | None = None) -> int:
    import logging
    from pathlib import Path

    from lerobot_zenoh.command_line import EXIT_CONFIG, EXIT_NO_SERVER, Spellings, one_line, parse, warn_old_spellings

    args = sys.argv[1:] if argv is None else list(argv)
    warn_old_spellings(PROG, args, {"--log-level": "--log_level"})
    # before the imports below: --help and a mistake at once
    args = parse(ProfileConfig, args, PROG, Spellings(aliases={"--log-level": "--log_level"}))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from lerobot_zenoh.errors import ConfigError, KeyExprError, TransportError
    from lerobot_zenoh.pipelines.profiles import dump_profiles, load_profiles
    from lerobot_zenoh.pipelines.profiles import TWO_COMPONENTS
    from lerobot_zenoh.pipelines.profiling import Profiler, ProfileRun, TextProfile, add_points
    from lerobot_zenoh.protocol.keys import validate_chunk
    from lerobot_zenoh.protocol.keys import AppKey
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import ZenohSettings

    try:
        app = AppKey(args.cluster_uuid, args.experiment_tag, args.model_id, args.model_version, args.application_tag)
        _ = app.status  # validates every chunk
        text = None
        if args.task is not None:
            text = TextProfile(validate_chunk("task", args.task), args.action_bit, args.text_bit, args.text_every)
        existing = load_profiles(args.output) if Path(args.output).exists() else None
        if existing is not None and existing.hardware != args.hardware:
            raise ConfigError("hardware", f"{args.output} holds profiles measured on {existing.hardware!r}, not "
                              f"{args.hardware!r}: write this hardware's profiles to another file")
        settings = ZenohSettings(mode="peer", connect=[args.endpoint], multicast_scouting=False)
        with ZenohSession(settings).open() as session:
            run = ProfileRun(app, args.batch_size, clients=args.clients, saturation_s=args.saturation_s,
                             seconds_per_rate=args.seconds_per_rate, timeout_s=args.timeout_s,
                             fractions=tuple(args.fractions), text=text)
            points = Profiler(session, run).measure(log=lambda m: print(f"{PROG}: {m}", file=sys.stderr))
    except (ConfigError, KeyExprError) as exc:
        print(f"{PROG}: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    except TransportError as exc:
        print(f"{PROG}: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_NO_SERVER
    if not points:
        print(f"{PROG}: nothing was measured", file=sys.stderr)
        return EXIT_NO_SERVER
    profiles = add_points(existing, args.profile_name, points, batching=args.batching, hardware=args.hardware,
                          memory_gb=args.memory_gb, components=list(TWO_COMPONENTS) if text else None)
    Path(args.output).write_text(dump_profiles(profiles))
    print(f"{PROG}: {len(points)} rows for {args.profile_name} at batch size {args.batch_size} -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
