"""Dispatch: a model with `engines:` (docs/server.md, "Engines"): its requests placed across several
engines, local and remote. The wire between an edge scheduler and its engines is `protocol/dispatch.py`.

    dispatcher.py       `Dispatcher`: each round drain events and time-outs, rank, place
                        (`scheduling/placement.py`), record, hand each engine's executor its work
    host.py             `DispatchHost`: what the dispatcher asks of the process around it (a protocol)
    engine_link.py      what the scheduler knows of each engine (`EngineState`), the transport seam it
                        uses, the probe and answer threads of remote engines
    engine_health.py    the failure machine of the engines: up, down, suspect, restarted (pure)
    answer_relay.py     an engine's answer matched to its request and published to the robot
    remote_executor.py  a remote engine (`role: engine`) as an `EngineExecutor`

May import (server/): engine, model, session_table, config, runners.
Must not be imported by: engine, model, session_table, config, runners (only `shell/` uses it).
"""
