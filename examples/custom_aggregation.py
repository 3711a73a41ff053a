"""Your own blending of overlapping action chunks, as a draccus choice.

Register a subclass of AggregateConfig; its `blend(old, new)` gets (K, D) stacks of the K
overlapping steps. Then name it on the command line, importing this module first:

    lerobot-robot-client --plugins=examples.custom_aggregation --aggregate.type=ema \
        --aggregate.new_weight_first=0.9 --robot.type=zenoh_sim ...

or pass it in code (`RobotClientConfig(aggregate=RampConfig())`), as `main()` below does.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import numpy as np

from lerobot_zenoh.scheduling.action_buffer import AggregateConfig


@AggregateConfig.register_subclass("ema")
@dataclass
class RampConfig(AggregateConfig):
    """Trust the new chunk more and more along the overlap: new weight ramps from `first` to 1."""

    new_weight_first: float = field(default=0.5, metadata={"help": "weight of the new chunk at the first overlapping step"})

    def blend(self, old: np.ndarray, new: np.ndarray) -> np.ndarray:
        k = old.shape[0]
        w = np.linspace(self.new_weight_first, 1.0, num=k, dtype=np.float32)[:, None] if k > 1 else np.float32(self.new_weight_first)
        return (1 - w) * old + w * new


def main() -> None:
    parser = argparse.ArgumentParser(description="run one simulated robot with the ramp aggregation")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()

    from fleet_on_one_server import run_fleet  # noqa: PLC0415 (same folder)

    run_fleet(robots=1, seconds=args.seconds, aggregate=RampConfig(new_weight_first=0.6), buffer_time_s=0.8)


if __name__ == "__main__":
    main()
