"""The workloads every benchmark shares: cameras and sizes, realistic camera frames, a robot that replays them.

Frames are synthetic but look like a camera's to a JPEG encoder: a smoothly lit scene with textured
surfaces, hard-edged objects, a moving gripper, a slow camera drift and fresh sensor noise in every
frame. A 480x640 frame compresses to 60-90 KB at quality 90, like a real one (a constant frame would
compress to almost nothing and flatter every JPEG-based path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cv2
import numpy as np

FPS = 30
DT_S = 1.0 / FPS
CHUNK_SIZE = 50
ACTION_DIM = 6
JPEG_QUALITY = 90


@dataclass(frozen=True)
class Workload:
    """Cameras, 6-D state, chunks of 50x6 at 30 Hz."""

    key: str  # also a Zenoh key chunk and a LeRobot "model path"
    label: str
    cameras: tuple[tuple[str, int, int], ...]  # (name, height, width)

    @property
    def camera_shapes(self) -> dict[str, tuple[int, int]]:
        return {name: (h, w) for name, h, w in self.cameras}

    @property
    def raw_bytes(self) -> int:
        return sum(h * w * 3 for _, h, w in self.cameras)


WORKLOADS = {
    w.key: w
    for w in (
        Workload("cam2_480x640", "2 x 480x640", (("front", 480, 640), ("wrist", 480, 640))),
        Workload("cam1_224x224", "1 x 224x224", (("front", 224, 224),)),
        Workload("cam3_720x1280", "3 x 720x1280", (("front", 720, 1280), ("wrist", 720, 1280), ("top", 720, 1280))),
    )
}
MAIN_WORKLOAD = "cam2_480x640"


# ----------------------------------------------------------------------------- frames


class SceneCamera:
    """One camera's view: a fixed textured world, cropped with a slow drift, plus moving objects and noise."""

    MARGIN = 48

    def __init__(self, height: int, width: int, seed: int):
        rng = np.random.default_rng(seed)
        self.height, self.width = height, width
        hh, ww = height + 2 * self.MARGIN, width + 2 * self.MARGIN
        # Lighting and large colour regions: a few random values upsampled smoothly.
        grey = rng.uniform(90, 150)
        low = (grey + 0.45 * (rng.uniform(40, 220, size=(5, 7, 3)) - grey)).astype(np.float32)
        world = cv2.resize(low, (ww, hh), interpolation=cv2.INTER_CUBIC)
        yy = np.linspace(0.0, 1.0, hh, dtype=np.float32)[:, None, None]
        world += 40.0 * (yy - 0.5)  # light from above
        # Surface texture (wood, fabric, table): mid-frequency noise at two scales.
        for scale, amp in ((8, 14.0), (3, 9.0)):
            tex = rng.normal(0.0, 1.0, size=(hh // scale + 1, ww // scale + 1, 1)).astype(np.float32)
            world += amp * cv2.resize(tex, (ww, hh), interpolation=cv2.INTER_LINEAR)[..., None]
        world = np.clip(world, 0, 255).astype(np.uint8)
        # Hard-edged static objects: boxes, cylinders (as discs), cables (lines).
        for _ in range(10):
            colour = tuple(int(c) for c in rng.integers(0, 255, size=3))
            x, y = int(rng.integers(0, ww)), int(rng.integers(0, hh))
            s = int(rng.integers(hh // 20, hh // 6))
            kind = rng.integers(0, 3)
            if kind == 0:
                cv2.rectangle(world, (x, y), (x + s, y + int(s * rng.uniform(0.5, 1.5))), colour, -1, cv2.LINE_AA)
            elif kind == 1:
                cv2.circle(world, (x, y), s // 2, colour, -1, cv2.LINE_AA)
            else:
                cv2.line(world, (x, y), (int(rng.integers(0, ww)), int(rng.integers(0, hh))), colour,
                         max(2, s // 12), cv2.LINE_AA)
        self.world = world
        # Sensor noise: a precomputed texture cropped at a random offset per frame (fresh-looking, cheap).
        noise = rng.normal(0.0, 3.0, size=(height + 32, width + 32, 3))
        self._noise_pos = np.clip(noise, 0, 255).astype(np.uint8)
        self._noise_neg = np.clip(-noise, 0, 255).astype(np.uint8)
        self._rng = rng

    def frame(self, k: int) -> np.ndarray:
        h, w, m = self.height, self.width, self.MARGIN
        ox = int(m + 0.8 * m * math.sin(0.05 * k))
        oy = int(m + 0.6 * m * math.cos(0.037 * k))
        img = np.ascontiguousarray(self.world[oy:oy + h, ox:ox + w])
        # The gripper: a grey body and two fingers moving across the view.
        cx = int(w * (0.5 + 0.3 * math.sin(0.09 * k)))
        cy = int(h * (0.55 + 0.2 * math.cos(0.07 * k)))
        s = max(4, h // 10)
        cv2.rectangle(img, (cx - s, cy - 2 * s), (cx + s, cy), (150, 150, 160), -1, cv2.LINE_AA)
        gap = int(s * (0.4 + 0.3 * math.sin(0.2 * k)))
        for side in (-1, 1):
            x0 = cx + side * gap
            cv2.rectangle(img, (x0 - s // 4, cy), (x0 + s // 4, cy + s), (90, 90, 100), -1, cv2.LINE_AA)
        cv2.circle(img, (int(w * 0.3 + 20 * math.sin(0.11 * k)), int(h * 0.7)), s // 2, (200, 40, 40), -1, cv2.LINE_AA)
        dy, dx = self._rng.integers(0, 32, size=2)
        img = cv2.add(img, self._noise_pos[dy:dy + h, dx:dx + w])
        return cv2.subtract(img, self._noise_neg[dy:dy + h, dx:dx + w])


def make_frames(workload: Workload, n: int, seed: int = 0) -> dict[str, list[np.ndarray]]:
    """`n` consecutive RGB frames per camera of `workload` (deterministic for a seed)."""
    out = {}
    for i, (name, h, w) in enumerate(workload.cameras):
        cam = SceneCamera(h, w, seed * 100 + i)
        out[name] = [cam.frame(k * 3 + i) for k in range(n)]
    return out


def pool_size(workload: Workload) -> int:
    """Frames kept per camera: enough to vary, bounded in memory (720p frames are 2.7 MB)."""
    return 8 if workload.raw_bytes > 4_000_000 else 16


# ----------------------------------------------------------------------------- robot


def make_pool_robot(workload: Workload, frames: dict[str, list[np.ndarray]] | None = None, seed: int = 0,
                    connect: bool = True):
    """A real LeRobot `Robot` (the project's simulated arm) whose cameras replay pre-rendered frames.

    Replaying keeps the cost of `get_observation` out of every measurement: a real camera driver
    hands over a frame it already has.
    """
    from lerobot_zenoh.client.sim_robot import SimRobot, SimRobotConfig

    class PoolRobot(SimRobot):
        def __init__(self, config, frames):
            super().__init__(config)
            self._frames = frames
            self._k = 0

        def get_observation(self):
            obs = {f"{j}.pos": float(v) for j, v in zip(self._joints, self._positions, strict=True)}
            self._k += 1
            for cam, pool in self._frames.items():
                obs[cam] = pool[self._k % len(pool)]
            return obs

    config = SimRobotConfig(cameras=dict(workload.camera_shapes), fps=FPS, seed=seed,
                            initial_positions={"shoulder_pan": 10.0, "elbow_flex": -20.0})
    robot = PoolRobot(config, frames if frames is not None else make_frames(workload, pool_size(workload), seed))
    if connect:
        robot.connect()
    return robot
