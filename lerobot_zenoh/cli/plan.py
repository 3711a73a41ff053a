"""`lerobot-zenoh-plan --factory=F.yaml --profiles=P.yaml --output=DIR`: plan a fleet (docs/pipelines.md).

Writes DIR/plan.json, DIR/manifests/srvN.yaml, DIR/servers.sh and DIR/clients.sh (and what
lerobot-zenoh-admit reads: factory.yaml, profiles.yaml, plan_state.json), and prints the
summary (and, for each task with a `combined_model`, which way it is served and why, on stderr and
under `choices`). Exit codes: 0 planned; 2 a configuration mistake (one line naming the field) or an
infeasible fleet (one line naming the constraint that binds).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

PROG = "lerobot-zenoh-plan"


@dataclass
class PlanConfig:
    # The factory descriptor: servers, fleet classes, tasks and models (docs/pipelines.md).
    factory: str
    # The measured serving profiles (docs/pipelines.md, "Serving profiles").
    profiles: str
    # Folder for plan.json, manifests/, servers.sh and clients.sh; none: print the summary only.
    output: str | None = None
    # Stop the rate search after this many seconds (the best plan so far is kept).
    time_budget_s: float = 60.0


def main(argv: list[str] | None = None) -> int:
    from lerobot_zenoh.command_line import EXIT_CONFIG, one_line, parse, require_extra

    args = parse(PlanConfig, argv, PROG)  # before the imports below: --help and a mistake at once
    require_extra(PROG, "planner", "ortools")  # the ILP packing (OR-Tools CP-SAT)
    from lerobot_zenoh.errors import ConfigError
    from lerobot_zenoh.pipelines.deployment import write_deployment
    from lerobot_zenoh.pipelines.descriptor import load_factory
    from lerobot_zenoh.pipelines.planner import Infeasible, plan
    from lerobot_zenoh.pipelines.profiles import load_profiles
    try:
        factory = load_factory(args.factory)
        profiles = load_profiles(args.profiles)
        result = plan(factory, profiles, time_budget_s=args.time_budget_s)
    except ConfigError as exc:
        print(f"{PROG}: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    except Infeasible as exc:
        print(f"{PROG}: infeasible: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    if args.output:
        write_deployment(factory, result, args.output, profiles)
    for task, why in result.choices.items():  # a task's combined_model: which way, and why
        print(f"{PROG}: task {task}: {why}", file=sys.stderr)
    print(json.dumps(result.summary(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
