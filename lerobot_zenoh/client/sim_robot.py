"""A simulated robot that is a real LeRobot ``Robot``: first-order joints and rendered cameras.

For running the client, the tests and the benchmarks without hardware. Build it from its config
(:class:`~lerobot_zenoh.client.config_sim_robot.SimRobotConfig`, registered as ``zenoh_sim``)
directly or through ``lerobot.robots.make_robot_from_config``.

Dynamics, advanced by one control period ``dt = 1 / fps`` on every :meth:`SimRobot.send_action`:

- position mode (actions ``<joint>.pos`` are targets): ``x += (1 - exp(-dt / tau)) * (cmd - x)``,
  the exact discretisation of ``tau * dx/dt = cmd - x``;
- velocity mode (actions ``<joint>.vel``): ``x += v * dt``; holding still is a zero velocity,
  which is what the fail-safe must send (docs/client.md, "Failures"), see :meth:`SimRobot.fail_safe_action`.

Observations are ``<joint>.pos`` for every joint plus one ``(H, W, 3)`` uint8 RGB image per
camera. The images are drawn from the joint positions (a background gradient turned by the
first joint, a disc moved by the next two and sized by the last, a bar turned by another), so
they change as the robot moves; each camera looks at a different combination of joints. Scenes
are drawn with vectorised numpy at most 160 pixels on a side and resized up with OpenCV;
optional pixel noise (``image_noise_std``) makes frames compress more like a real camera's.
An observation of two 96x128 cameras costs well under a millisecond.
"""

from __future__ import annotations

import math

import cv2
import numpy as np
from lerobot.lerobot_types import RobotAction, RobotObservation
from lerobot.robots import Robot
from lerobot.utils.constants import HF_LEROBOT_CALIBRATION, ROBOTS
from lerobot.utils.decorators import check_if_already_connected, check_if_not_connected

from lerobot_zenoh.client.config_sim_robot import SimRobotConfig

__all__ = ["SimRobot", "SimRobotConfig"]


# Scenes are drawn at most this many pixels on a side and resized up: the content is smooth, so
# this keeps two 480x640 cameras at about a millisecond instead of tens.
_MAX_DRAWN_SIDE = 160
# Noise comes from a precomputed texture cropped at a random offset each frame, split into
# positive and negative uint8 parts for OpenCV's saturating add/subtract: drawing fresh Gaussian
# noise for a 480x640x3 frame would cost about 10 ms.
_NOISE_MARGIN = 32


class _SceneRenderer:
    """Draws one camera's image from normalised joint features; grids and noise are made once."""

    def __init__(self, height: int, width: int, camera_index: int, noise_std: float, rng: np.random.Generator):
        self.shape = (height, width, 3)
        shrink = min(1.0, _MAX_DRAWN_SIDE / max(height, width))
        h, w = max(round(height * shrink), 1), max(round(width * shrink), 1)
        scale = 1.0 / max(h - 1, 1)
        # Units where the image height is 1; broadcasting (h, 1) against (1, w) avoids full grids.
        self._y = (np.arange(h, dtype=np.float32) * scale)[:, None]
        self._x = (np.arange(w, dtype=np.float32) * scale)[None, :]
        self._aspect = (w - 1) * scale
        self._resize = (h, w) != (height, width)
        self._camera_index = camera_index
        self._zoom = 1.0 + 0.5 * (camera_index % 3)  # cameras see the scene from different distances
        self._out = np.empty((h, w, 3), dtype=np.float32)
        self._rng = rng
        self._noise: tuple[np.ndarray, np.ndarray] | None = None
        if noise_std > 0:
            texture = rng.normal(0.0, noise_std, size=(height + _NOISE_MARGIN, width + _NOISE_MARGIN, 3))
            self._noise = (
                np.clip(texture, 0, 255).astype(np.uint8),
                np.clip(-texture, 0, 255).astype(np.uint8),
            )

    def render(self, features: np.ndarray) -> np.ndarray:
        n = len(features)

        def f(k: int) -> float:  # each camera watches the joints in a different order
            return float(features[(k + self._camera_index) % n])

        x, y, out = self._x, self._y, self._out
        angle = math.pi * f(0) + 0.7 * self._camera_index
        ramp = np.clip(0.5 + 0.6 * ((x - 0.5 * self._aspect) * math.cos(angle) + (y - 0.5) * math.sin(angle)), 0, 1)
        out[..., 0] = 40 + 180 * ramp
        out[..., 1] = 60 + 120 * y + 30 * f(3)
        out[..., 2] = 90 + 100 * (1 - ramp) * (1 - y)

        cx = 0.5 * self._aspect + 0.3 * self._zoom * f(1)
        cy = 0.5 + 0.3 * self._zoom * f(2)
        radius = (0.12 + 0.06 * f(n - 1 - self._camera_index)) * self._zoom
        dx, dy = x - cx, y - cy
        disc = dx * dx + dy * dy < radius * radius
        out[disc] = (230, 200 - 80 * f(1), 40)

        bar_angle = math.pi * f(4) / 2
        along = dx * math.cos(bar_angle) + dy * math.sin(bar_angle)
        across = dy * math.cos(bar_angle) - dx * math.sin(bar_angle)
        bar = (np.abs(across) < 0.025) & (np.abs(along - 1.6 * radius) < 0.15)
        out[bar] = (245, 245, 245)

        image = np.clip(out, 0, 255).astype(np.uint8)
        height, width, _ = self.shape
        if self._resize:
            image = cv2.resize(image, (width, height), interpolation=cv2.INTER_LINEAR)
        if self._noise is not None:
            dy0, dx0 = self._rng.integers(0, _NOISE_MARGIN, size=2)
            window = (slice(dy0, dy0 + height), slice(dx0, dx0 + width))
            plus, minus = self._noise
            image = cv2.subtract(cv2.add(image, plus[window]), minus[window])
        return image


class SimRobot(Robot):
    """A LeRobot robot without hardware. See the module docstring for the dynamics and images."""

    config_class = SimRobotConfig
    name = "zenoh_sim"

    def __init__(self, config: SimRobotConfig):
        # Robot.__init__ creates a calibration folder under the user's cache; a simulated robot
        # has nothing to calibrate and its constructor does no I/O, so the same attributes are
        # set here without touching the filesystem.
        self.robot_type = self.name
        self.id = config.id
        self.calibration_dir = config.calibration_dir or HF_LEROBOT_CALIBRATION / ROBOTS / self.name
        self.calibration_fpath = self.calibration_dir / f"{self.id}.json"
        self.calibration = {}

        self.config = config
        self.dt_s = config.dt_s
        self._joints = list(config.joints)
        self._suffix = ".pos" if config.control_mode == "position" else ".vel"
        self._initial = np.array([config.initial_positions.get(j, 0.0) for j in self._joints], dtype=np.float64)
        self._positions = self._initial.copy()
        self._commanded = self._initial.copy() if config.control_mode == "position" else np.zeros_like(self._initial)
        self._alpha = 1.0 - math.exp(-self.dt_s / config.time_constant_s)
        self._rng = np.random.default_rng(config.seed)
        self._renderers = {
            cam: _SceneRenderer(h, w, i, config.image_noise_std, self._rng)
            for i, (cam, (h, w)) in enumerate(config.cameras.items())
        }
        self._connected = False
        self.steps = 0  # control periods simulated (send_action calls)

    # -- features

    @property
    def observation_features(self) -> dict:
        features: dict = {f"{j}.pos": float for j in self._joints}
        features.update({cam: r.shape for cam, r in self._renderers.items()})
        return features

    @property
    def action_features(self) -> dict:
        return {f"{j}{self._suffix}": float for j in self._joints}

    # -- lifecycle

    @property
    def is_connected(self) -> bool:
        return self._connected

    @check_if_already_connected
    def connect(self, calibrate: bool = True) -> None:
        self._connected = True
        self.configure()

    @property
    def is_calibrated(self) -> bool:
        return True

    def calibrate(self) -> None:
        """Nothing to calibrate."""

    def configure(self) -> None:
        """Nothing to configure: the dynamics are fixed by the config."""

    @check_if_not_connected
    def disconnect(self) -> None:
        self._connected = False

    # -- I/O

    @check_if_not_connected
    def get_observation(self) -> RobotObservation:
        cfg = self.config
        measured = self._positions
        if cfg.position_noise_std > 0:
            measured = measured + self._rng.normal(0.0, cfg.position_noise_std, size=measured.shape)
        obs: RobotObservation = {f"{j}.pos": float(v) for j, v in zip(self._joints, measured, strict=True)}
        features = np.tanh(self._positions / 50.0)  # joints in LeRobot's +-100 range -> (-1, 1)
        for cam, renderer in self._renderers.items():
            obs[cam] = renderer.render(features)
        return obs

    @check_if_not_connected
    def send_action(self, action: RobotAction) -> RobotAction:
        """Command the joints named in `action` and advance the dynamics by one control period.

        Joints absent from `action` keep their previous command. Returns the full command sent.
        Raises ``ValueError`` for a key that is not an action feature or a non-finite value.
        """
        index = {f"{j}{self._suffix}": i for i, j in enumerate(self._joints)}
        for key, value in action.items():
            if key not in index:
                raise ValueError(f"{key!r} is not an action of this robot; expected keys {list(index)}")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"action {key!r} is not finite: {value}")
            self._commanded[index[key]] = value
        if self._suffix == ".pos":
            self._positions += self._alpha * (self._commanded - self._positions)
        else:
            self._positions += self._commanded * self.dt_s
        self.steps += 1
        return {key: float(self._commanded[i]) for key, i in index.items()}

    # -- for the client's fail-safe and for tests

    @property
    def positions(self) -> np.ndarray:
        """True joint positions (no observation noise), in joint order."""
        return self._positions.copy()

    @property
    def commanded(self) -> np.ndarray:
        """The last command per joint: targets in position mode, velocities in velocity mode."""
        return self._commanded.copy()

    def hold_action(self) -> RobotAction:
        """The current positions as position targets (``<joint>.pos``): holds a position-controlled robot."""
        return {f"{j}.pos": float(v) for j, v in zip(self._joints, self._positions, strict=True)}

    def zero_velocity_action(self) -> RobotAction:
        """Zero for every joint velocity (``<joint>.vel``): stops a velocity-controlled robot."""
        return {f"{j}.vel": 0.0 for j in self._joints}

    def fail_safe_action(self) -> RobotAction:
        """What to send when no policy action is available: hold position, or zero velocity."""
        return self.hold_action() if self._suffix == ".pos" else self.zero_velocity_action()

    def reset(self) -> None:
        """Back to the initial positions and commands (e.g. between recorded episodes)."""
        self._positions = self._initial.copy()
        self._commanded = self._initial.copy() if self._suffix == ".pos" else np.zeros_like(self._initial)
