"""The inference thread and its supervision.

One thread drives every model, each a step of schedule -> execute -> update: it closes expired
sessions, runs each model with engines through its dispatcher (`server/dispatch/dispatcher.py`: place,
dispatch, relay; never waits on an engine) and hands each other model's next batch, as its session
table's scheduler picked it, to the model's one local executor (`server/engine/interface.py`), round
robin; it sleeps when nothing waits.

Supervised: a fault in one model's turn is logged with its traceback and counted (`loop_faults`);
after `MAX_FAULTS_IN_A_ROW` with no work done in between (each within `FAULT_WINDOW_S` of the
last), that model stops being served *visibly*
(`_withdraw`: its role never serves again, so status queries go unanswered; its liveliness token is
undeclared, so a hot standby takes over; telemetry says `serving: 0`, `failed: 1`). A fault outside
any model's turn withdraws them all. When no model is served any more, `failed` is set and the
console script exits non-zero: never a half-alive process that still looks healthy.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from lerobot_zenoh.server.engine import admission
from lerobot_zenoh.server.engine.interface import Work
from lerobot_zenoh.server.model.served_model import ServedModel
from lerobot_zenoh.server.engine.serving import EXPIRY_PERIOD_S, Serving

log = logging.getLogger(__name__)

#: Faults in one model's turns, with no work done in between and each within FAULT_WINDOW_S of
#: the one before, after which it is withdrawn.
MAX_FAULTS_IN_A_ROW = 3
FAULT_WINDOW_S = 10.0

__all__ = ["InferenceLoop", "MAX_FAULTS_IN_A_ROW"]


class InferenceLoop:
    """`start()` the thread; `stop` and `wake` are the server's events; `tokens` its liveliness
    tokens by app prefix (undeclared when a model is withdrawn)."""

    def __init__(self, models: list[ServedModel], serving: Serving, stop: threading.Event, wake: threading.Event,
                 tokens: dict[str, object]):
        self.models = models
        self.serving = serving
        self.stop = stop
        self.wake = wake
        self.tokens = tokens
        self.failed = threading.Event()  # no model is served any more
        # Per model (by app prefix): faults in a row with no work between, and when the last was.
        self._streaks: dict[str, _FaultStreak] = {}
        self._thread = threading.Thread(target=self._run, name="inference", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float) -> bool:
        """Wait for the thread; True when it finished."""
        if self._thread.ident is not None:
            self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        """The inference thread, supervised: a fault in one model's turn is logged with its
        traceback and counted, and after `MAX_FAULTS_IN_A_ROW` in a row that model stops being
        served *visibly* (`_withdraw`); a fault outside any model's turn withdraws them all. A dead
        loop never leaves a server that still looks healthy."""
        try:
            self._loop()
        except BaseException as exc:
            log.critical("the inference loop died: %s: %s", type(exc).__name__, exc, exc_info=True)
            for model in self.models:
                self._withdraw(model, f"inference loop died ({type(exc).__name__})")

    def _loop(self) -> None:
        turn = 0
        next_expiry = 0.0
        while not self.stop.is_set():
            self.wake.clear()
            now = time.monotonic()
            if now >= next_expiry:
                next_expiry = now + EXPIRY_PERIOD_S
                for model in self.models:
                    self._supervised(model, self.serving.expire, model, now)
            served = False
            for model in self.models:
                if model.dispatcher is not None and model.failed is None:  # place, dispatch, relay; never wait
                    if self._supervised(model, model.dispatcher.round, time.monotonic()):
                        served = True
                        _served_work(model)
            for i in range(len(self.models)):
                model = self.models[(turn + i) % len(self.models)]
                if model.dispatcher is not None or model.failed is not None:
                    continue
                if model.role is not None and not model.role.may_serve(time.monotonic()):
                    continue  # standing by, or held after waking from a freeze (server/model/failover.py)
                batch = self._supervised(model, admission.schedule, model, time.monotonic())
                if batch is not None:
                    turn = (turn + i + 1) % len(self.models)
                    t0 = time.monotonic()
                    self._supervised(model, model.engine.submit, Work(batch), served=True,
                                     on_fault=lambda m=model, b=batch: _release(m, b))
                    _served_work(model, time.monotonic() - t0)
                    served = True
                    break
            if not served and not sum(self._text_turn(m) for m in self.models):
                self.wake.wait(EXPIRY_PERIOD_S)

    def _text_turn(self, model: ServedModel) -> int:
        """One frame's worth of a language runner's text; the tokens (or answers) it advanced."""
        advanced = self._supervised(model, self.serving.advance_text, model) or 0
        if advanced:
            _served_work(model)
        return advanced

    def _supervised(self, model: ServedModel, fn, *args, on_fault=None, served: bool = False):
        """`fn(*args)` for one model's turn; a fault is logged, counted and, `MAX_FAULTS_IN_A_ROW`
        with no work done in between (`served`, or `fn` returned something: a batch, a dispatch),
        ends the model's service (`_withdraw`). Returns what `fn` returned (None on a fault)."""
        if model.failed is not None:
            return None
        try:
            out = fn(*args)
        except Exception as exc:
            now = time.monotonic()
            streak = self._streaks.setdefault(model.app.prefix, _FaultStreak())
            if now - streak.last_s > FAULT_WINDOW_S:  # an isolated fault long after the last one
                streak.count = 0
            streak.last_s = now
            streak.count += 1
            model.loop_faults += 1
            log.error("%s: serving loop fault %d in a row (%s: %s)", model.app.prefix, streak.count,
                      type(exc).__name__, exc, exc_info=True)
            if on_fault is not None:
                try:
                    on_fault()
                except Exception:
                    log.exception("%s: could not release the batch of the failed turn", model.app.prefix)
            if streak.count >= MAX_FAULTS_IN_A_ROW:
                self._withdraw(model, f"{streak.count} serving loop faults in a row ({type(exc).__name__})")
            return None
        if served or out:
            self._streaks.pop(model.app.prefix, None)
        return out

    def withdraw(self, model: ServedModel, why: str) -> None:
        """End this server's service of `model` visibly (a replaced primary, server/model/failover.py)."""
        self._withdraw(model, why)

    def _withdraw(self, model: ServedModel, why: str) -> None:
        """Stop serving a model where everyone can see it: its role never serves again (status
        queries go unanswered, observations are dropped), its liveliness token is undeclared (a hot
        standby takes over), telemetry says `serving: 0` and `failed: 1`. When no model is served
        any more, `failed` is set and the console script exits non-zero."""
        if model.failed is not None:
            return
        model.failed = why
        if model.role is not None:
            model.role.fail()
        token = self.tokens.pop(model.app.prefix, None)
        if token is not None:
            try:
                token.undeclare()
            except Exception as exc:
                log.warning("%s: could not withdraw its liveliness token: %s", model.app.prefix, exc)
        log.critical("%s: no longer served (%s); its liveliness token and status are withdrawn", model.app.prefix, why)
        if all(m.failed is not None for m in self.models):
            self.failed.set()


@dataclass
class _FaultStreak:
    """One model's faults in a row with no work done between (`InferenceLoop._supervised`)."""

    count: int = 0
    last_s: float = float("-inf")


def _served_work(model: ServedModel, duration_s: float | None = None) -> None:
    """A turn that did work, for the heartbeat a hot standby judges this server by (server/model/failover.py)."""
    if model.role is not None:
        model.role.note_turn(duration_s)


def _release(model: ServedModel, batch) -> None:
    """A batch whose turn failed: computed no longer, so its robots' next requests are served."""
    model.session_table.finish([], [s.client_id for s, _ in batch.items], time.monotonic(), 0.0)
