"""What the server reports of each model: its telemetry figures and a snapshot of its counters.

The session table's lock is held only while its counters are copied (`SessionTable.snapshot`, typed); percentiles
and sums are computed here, outside it (docs/telemetry.md).
"""

from __future__ import annotations

import numpy as np

from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.server.session_table.records import SessionStats
from lerobot_zenoh.server.session_table.table import UNKNOWN_CLIENT
from lerobot_zenoh.server.model.served_model import ServedModel
from lerobot_zenoh.telemetry.publisher import percentile, process_memory

__all__ = ["model_figures", "model_stats"]


def model_figures(model: ServedModel) -> tuple[dict, dict]:
    """(model-level figures, per-client figures) for the Telemetry message (docs/telemetry.md).

    The session table's lock is held only while its counters are copied (`SessionTable.snapshot`, typed);
    percentiles are computed here.
    """
    snap = model.session_table.snapshot()
    publishers = dict(model.publishers)
    per_client: dict[str, dict] = {}
    for cid, s in snap.sessions.items():
        pub = publishers.get(cid)
        per_client[cid] = {
            **_session_figures(s.stats),
            "inference_ms_p50": percentile(s.stats.inference_ms, 50),
            "inference_ms_p99": percentile(s.stats.inference_ms, 99),
            "queue_ms_p50": percentile(s.stats.queue_ms, 50),
            "queue_ms_p99": percentile(s.stats.queue_ms, 99),
            # every latency since the session opened, in bins: Prometheus histograms (telemetry/histogram.py)
            **s.stats.inference_hist.figures("inference"),
            **s.stats.queue_hist.figures("queue"),
            **{f"rejected.{reason}": n for reason, n in s.stats.rejected.items()},
            # which tier computed this robot's chunks (a model with engines)
            **(model.dispatcher.client_figures(cid) if model.dispatcher is not None else {}),
            # chunks a client's stalled link made its publisher drop (transport/session.py QueuedPublisher)
            "actions_dropped": pub.dropped if pub is not None else 0,
        }
    total = snap.total()  # open and closed sessions
    unread = model.refused_unread
    inference_ms = [x for s in snap.sessions.values() for x in s.stats.inference_ms]
    queue_ms = [x for s in snap.sessions.values() for x in s.stats.queue_ms]
    metrics = {
        "clients": len(per_client),
        "sessions_open": len(per_client),
        "sessions_unknown_open": snap.unknown_open,
        "sessions_opened": snap.sessions_opened,
        **{f"sessions_closed.{reason}": n for reason, n in snap.sessions_closed.items()},
        **_session_figures(total),
        # (rejected: also those dropped before any session, unknown_client, too_many_clients and a
        # fresh unknown id's rate_limited, and those refused before their key was read: client_id_too_long)
        "observations_rejected": total.rejected_total + sum(snap.dropped.values()) + sum(unread.values()),
        **{f"rejected.{reason}": n for reason, n in unread.items()},
        **{f"rejected.{reason}": n for reason, n in snap.dropped.items()},
        **{f"rejected.{reason}": n for reason, n in total.rejected.items()},
        "actions_dropped": model.actions_dropped_closed + sum(p.dropped for p in publishers.values()),
        "inference_ms_p50": percentile(inference_ms, 50),
        "inference_ms_p99": percentile(inference_ms, 99),
        "queue_ms_p50": percentile(queue_ms, 50),
        "queue_ms_p99": percentile(queue_ms, 99),
        # of every session since start, open and closed (counts that only grow: Prometheus histograms)
        **total.inference_hist.figures("inference"),
        **total.queue_hist.figures("queue"),
        "serving": int(model.role is not None and model.role.active.is_set()),
        "failed": int(model.failed is not None),
        "loop_faults": model.loop_faults,
        "takeovers": model.role.takeovers if model.role is not None else 0,
        "takeovers_stalled": model.role.takeovers_stalled if model.role is not None else 0,
        "standby_dropped": model.standby_dropped,
        "answers_held": model.role.answers_held if model.role is not None else 0,
        "stepped_back": model.role.stepped_back if model.role is not None else 0,
        "primary_found_serving": model.role.primary_found_serving if model.role is not None else 0,
        "heartbeats_refused": model.role.heartbeats_refused if model.role is not None else 0,
        **({f"heartbeats_refused.{reason}": n for reason, n in model.role.heartbeats_refused_by.items()}
           if model.role is not None else {}),
        "heartbeats_superseded": model.role.heartbeats_superseded if model.role is not None else 0,
        "replacement_claims_ignored": model.role.replacement_claims_ignored if model.role is not None else 0,
        "observations_for_other_components": model.for_other_components,
        "answers_withheld": model.answers_withheld,
        **{f"answers.{kind}": n for kind, n in model.answers.items()},
        # Refusals published to the clients that read them (protocol 1.5), by reason
        **{f"refusals_sent.{reason}": n for reason, n in model.refusals_sent.items()},
        "batch_size_mean": float(np.mean(snap.batch_sizes)) if snap.batch_sizes else 1.0,
        "batch_fallbacks": model.adapter.batch_fallbacks,
        "jpeg_device_fallbacks": model.adapter.jpeg_device_fallbacks,
        **model.adapter.shared_memory_figures,
        **model.runner.figures(),  # the runner's own: language.*, decode.*, vlm.*
        "max_batch_size": model.max_batch_size,
        **{f"batch_profile.{b}_ms": t * 1000 for b, t in model.batch_profile_s.items()},
        **{f"scheduler.{k}": v for k, v in snap.scheduler.items()},
        # per engine: dispatched, answered, offload share, WAN RTT, estimate vs actual, re-queues
        **(model.dispatcher.figures() if model.dispatcher is not None else {}),
        **process_memory(),
    }
    return metrics, per_client


def model_stats(model: ServedModel) -> dict:
    """A snapshot of every counter of one model, and per open session."""
    snap = model.session_table.snapshot()
    closed = snap.closed
    return {
        "unknown_rejected": snap.unknown_refused,
        "dropped": {**{k: v for k, v in snap.dropped.items() if k != UNKNOWN_CLIENT}, **model.refused_unread},
        "sessions_opened": snap.sessions_opened,
        "sessions_closed": snap.sessions_closed,
        # the counts of sessions since closed; served: every chunk served
        "totals": {"received": closed.received, "superseded": closed.superseded,
                   "refreshes": closed.refreshes, "refreshes_late": closed.refreshes_late,
                   **{f"rejected.{k}": v for k, v in closed.rejected.items()},
                   **{f"dropped.{k}": v for k, v in closed.dropped.items()},
                   "served": snap.total().served},
        "observations_for_other_components": model.for_other_components,
        "answers": dict(model.answers),
        "answers_withheld": model.answers_withheld,
        # Refusals told to clients (protocol 1.5), by reason, and those withheld (one a second per session)
        "refusals_sent": dict(model.refusals_sent),
        "refusals_withheld": model.refusals_withheld,
        "clients": {
            cid: {
                "received": s.stats.received,
                "superseded": s.stats.superseded,
                "served": s.stats.served,
                "refreshes": s.stats.refreshes,
                "refreshes_late": s.stats.refreshes_late,
                "rejected": dict(s.stats.rejected),
                "dropped": dict(s.stats.dropped),
                "inference_ms_p50": percentile(s.stats.inference_ms, 50),
            }
            for cid, s in snap.sessions.items()
        },
    }


def _session_figures(st: SessionStats) -> dict[str, int]:
    """The telemetry counters of one session, or of all (docs/telemetry.md)."""
    return {
        "observations_received": st.received,
        "observations_superseded": st.superseded,
        "observations_rejected": st.rejected_total,
        "observations_rate_limited": st.dropped.get(Reason.RATE_LIMITED, 0),
        "inferences": st.served,
        # re-fetch (protocol.md §10.7): refreshes that took their request's slot, and those dropped
        # on arrival because their request no longer waited (never served: no inference spent)
        "observations_refreshes": st.refreshes,
        "refreshes_late": st.refreshes_late,
    }
