"""The session table of one model: the robots' sessions, their newest-only slots, and whom to serve
next (with its request scheduler). Pure decisions under one lock; it runs nothing (docs/architecture.md,
"Sessions"). These are robot sessions; Zenoh sessions are `transport/session.py`'s.

    table.py       `SessionTable`: admit, schedule, judge, expire, snapshot
    records.py     the plain data it holds and hands out: `Session`, `Slot`, `Ranking`, `Batch`, stats
    rules.py       the session rules: which observation a session accepts (pure functions)
    roster.py      which sessions exist: open, close, liveliness, the pool of unlisted clients
    rate_limit.py  the cool-down of clients whose observations keep being rejected (pure)

May import (server/): config, runners.
Must not be imported by: config, runners.
"""
