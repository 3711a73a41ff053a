"""What the server's loop adds for a model that writes text across frames: a pi0.5 entry with a
``language`` block serving a task's System 1 *and* System 2 from one prefill (docs/policies.md, "pi0.5:
actions and language from one prefill").

- `asked(item, obs)`: which of the item's two components an observation's `component_mask` asks
  (no mask: both).
- `with_text(runner, request, item, obs, actions)`: the runner's request with the text query
  (`LanguageQuery`: the System 2 prompt, the observation's seq id, whether actions are asked too);
  the runner refuses a bad one per request (`ProtocolError`: ``prompt_too_long``,
  ``text_over_token_limit``), counted like any bad observation.
- `advance(model, publish)`: after a batch's answers are out (actions are the hard deadline), or
  when the loop is idle, one frame of text for every robot on the engine (`Pi05LanguageRunner.advance`);
  each update becomes a `TextResult` on the robot's ``.../text`` key (`partial` until the last).

No Zenoh here: the shell passes its publish function.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import Observation, TextResult
from lerobot_zenoh.protocol.reasons import OutputKind

log = logging.getLogger(__name__)


def writes_text(runner: Any) -> bool:
    """Whether `runner` streams text across frames (it declares `streams_text`: a pi0.5 language runner)."""
    return runner.spec.capabilities.streams_text


def asked(item: Any, obs: Observation) -> tuple[bool, bool]:
    """(actions, text): what the observation asks of the pipeline `item` (None: a plain observation,
    which asks for actions only)."""
    if item is None:
        return True, False
    mask = obs.component_mask
    text = item.text is not None and (mask is None or bool(mask >> item.text.bit & 1))
    return mask is None or bool(mask >> item.bit & 1), text


def with_text(runner: Any, request: Any, item: Any, obs: Observation, actions: bool) -> Any:
    """`request` asking the item's System 2 text too; checked by the runner (ProtocolError)."""
    from lerobot_zenoh.server.runners.pi05_language import LANGUAGE_EXTRA, LanguageQuery

    query = LanguageQuery(prompt=item.text.prompt, max_new_tokens=item.text.max_new_tokens, tag=obs.seq_id,
                          actions=actions)
    request = dataclasses.replace(request, extras={**request.extras, LANGUAGE_EXTRA: query})
    runner.check_request(request)
    return request


def advance(model: Any, publish: Callable[[str, bytes], None], server_id: str) -> int:
    """One frame of text for every robot of `model`'s runner; returns the updates published."""
    runner = model.runner
    if not writes_text(runner) or not runner.language_active:
        return 0
    t0 = time.monotonic()
    updates = runner.advance()
    ms = (time.monotonic() - t0) * 1000
    for u in updates:
        payload = codec.encode(TextResult(response_to_seq_id=int(u.tag), text=u.text, inference_time_ms=ms,
                                          server_id=server_id, partial=not u.final))
        try:
            publish(u.session_id, payload)
        except Exception as exc:  # a closed link costs this robot its text, never the loop
            log.warning("text for %s not published: %s", u.session_id, exc)
            continue
        model.answers[OutputKind.TEXT if u.final else "text_partial"] += 1
    return len(updates)
