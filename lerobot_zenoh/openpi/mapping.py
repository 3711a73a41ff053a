"""Which OpenPI key is which camera, state and task of the served model: declared, checked, applied.

    images:                        # OpenPI key -> the model's camera
      observation/image: front
      observation/wrist_image: wrist
    state: observation/state       # a 1-D numeric array of the model's state_dim, or a list of keys
                                   # whose arrays are joined in order (DROID: joint_position, gripper_position)
    prompt: prompt                 # the task string (optional; default_prompt when absent)
    ignore: []                     # keys a client sends that the model does not use (dropped)

A key is looked up as written first; a key with ``/`` that is not there is then followed through
nested maps (``images/cam_high`` reads ``obs["images"]["cam_high"]``, as ALOHA's client sends).
`check` compares the mapping with the model's status at start-up (one line naming the key);
`apply` turns one decoded request into (state, {camera: HxWx3 uint8}, task) or raises a
``ProtocolError`` naming the key. What the fleet would refuse is refused here with the fleet's own
reason (a prompt over the protocol's ``MAX_TASK_BYTES``: ``task_too_long``), so the door never
sends, and resends, what cannot be served.
"""

from __future__ import annotations

import numpy as np
from pydantic import Field, field_validator

from lerobot_zenoh.config import Settings
from lerobot_zenoh.errors import ConfigError, ProtocolError
from lerobot_zenoh.openpi.wire import OpenPIReason
from lerobot_zenoh.protocol.messages import MAX_TASK_BYTES, Status
from lerobot_zenoh.protocol.reasons import Reason

__all__ = ["KeyMapping"]

_MISSING = object()


class KeyMapping(Settings):
    config_prefix = "mapping"

    images: dict[str, str] = Field(default_factory=dict)
    state: str | tuple[str, ...] | None = None
    prompt: str | None = "prompt"
    default_prompt: str = Field("", max_length=MAX_TASK_BYTES)
    ignore: tuple[str, ...] = ()

    @field_validator("images")
    @classmethod
    def _one_key_per_camera(cls, value: dict[str, str]) -> dict[str, str]:
        cams = list(value.values())
        twice = sorted({c for c in cams if cams.count(c) > 1})
        if twice:
            raise ValueError(f"camera {twice[0]!r} is named by more than one OpenPI key")
        return value

    @property
    def state_keys(self) -> tuple[str, ...]:
        return (self.state,) if isinstance(self.state, str) else tuple(self.state or ())

    def keys(self) -> set[str]:
        return {*self.images, *self.state_keys, *([self.prompt] if self.prompt else [])}

    def check(self, status: Status) -> None:
        """ConfigError (one line naming the key) when the mapping does not fit the served model."""
        cams = status.expected_cameras
        for key, cam in self.images.items():
            if cam not in cams:
                raise ConfigError(f"mapping.images.{key}", f"camera {cam!r} is not a camera of model "
                                  f"{status.model_id!r} (it has: {', '.join(sorted(cams)) or 'none'})")
        unmapped = sorted(set(cams) - set(self.images.values()))
        if unmapped:
            raise ConfigError("mapping.images", f"the model's camera {unmapped[0]!r} has no OpenPI key "
                              f"(add '<openpi key>: {unmapped[0]}')")
        if status.state_dim and not self.state_keys:
            raise ConfigError("mapping.state", f"model {status.model_id!r} takes a state of {status.state_dim} "
                              "values: name the OpenPI key that carries it (e.g. observation/state)")

    def largest_request(self, status: Status) -> int:
        """Bytes of the arrays and prompt of the largest request this mapping accepts for `status`'s
        model: its cameras' raw pixels, its state as float64, a prompt of the fleet's limit."""
        pixels = sum(h * w * 3 for h, w in status.expected_cameras.values())
        return pixels + 8 * (status.state_dim or 0) + MAX_TASK_BYTES

    def apply(self, obs: dict, status: Status) -> tuple[np.ndarray, dict[str, np.ndarray], str]:
        """(state float32 (state_dim,), {camera: HxWx3 uint8}, task) from one request."""
        known = self.keys()
        for key in obs:
            if key not in known and key not in self.ignore and not any(k.startswith(key + "/") for k in known):
                raise ProtocolError(OpenPIReason.UNKNOWN_KEY, f"key {key!r} is not in the front door's mapping "
                                    f"(it reads: {', '.join(sorted(known))})")
        images = {cam: self._image(obs, key, status.expected_cameras[cam]) for key, cam in self.images.items()}
        state = self._state(obs, status.state_dim)
        task = self.default_prompt
        if self.prompt:
            value = _lookup(obs, self.prompt)
            if value is not _MISSING:
                if isinstance(value, bytes):
                    value = value.decode("utf-8", "replace")
                if not isinstance(value, str):
                    raise ProtocolError(OpenPIReason.BAD_PROMPT, f"{self.prompt!r} must be a string, "
                                        f"got {type(value).__name__}")
                task = value
        if len(task.encode("utf-8", "surrogatepass")) > MAX_TASK_BYTES:  # the fleet's own limit and reason
            raise ProtocolError(Reason.TASK_TOO_LONG, f"the prompt is {len(task.encode('utf-8', 'surrogatepass'))} "
                                f"bytes; the fleet takes at most {MAX_TASK_BYTES}")
        return state, images, task

    def _image(self, obs: dict, key: str, hw: tuple[int, int]) -> np.ndarray:
        value = _lookup(obs, key)
        if value is _MISSING:
            raise ProtocolError(OpenPIReason.MISSING_KEY, f"image key {key!r} is missing")
        h, w = hw
        if not isinstance(value, np.ndarray) or value.dtype != np.uint8:
            what = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
            raise ProtocolError(OpenPIReason.BAD_DTYPE, f"{key!r} must be a uint8 image array, got {what}")
        if value.shape == (h, w, 3):
            return value
        if value.shape == (3, h, w):  # channels first, as ALOHA's client sends
            return np.ascontiguousarray(value.transpose(1, 2, 0))
        raise ProtocolError(OpenPIReason.WRONG_IMAGE_SHAPE, f"{key!r} has shape {value.shape}, the model's camera "
                            f"takes ({h}, {w}, 3) or (3, {h}, {w})")

    def _state(self, obs: dict, state_dim: int | None) -> np.ndarray:
        keys = self.state_keys
        if not keys:
            return np.zeros(0, np.float32)
        parts = []
        for key in keys:
            value = _lookup(obs, key)
            if value is _MISSING:
                raise ProtocolError(OpenPIReason.MISSING_KEY, f"state key {key!r} is missing")
            if not isinstance(value, np.ndarray) or value.dtype.kind not in "biuf" or value.ndim > 1:
                raise ProtocolError(OpenPIReason.BAD_STATE, f"{key!r} must be a 1-D numeric array")
            parts.append(value.reshape(-1).astype(np.float32))
        state = np.concatenate(parts)
        named = " + ".join(repr(k) for k in keys)
        if state_dim is not None and state.size != state_dim:
            raise ProtocolError(OpenPIReason.BAD_STATE, f"{named} {'gives' if len(keys) == 1 else 'give'} "
                                f"{state.size} values, the model takes ({state_dim},)")
        if not np.all(np.isfinite(state)):
            raise ProtocolError(OpenPIReason.BAD_STATE, f"{named}: a NaN or an infinity")
        return state


def _lookup(obs: dict, key: str):
    if key in obs:
        return obs[key]
    node = obs
    for part in key.split("/"):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node
