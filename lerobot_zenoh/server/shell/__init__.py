"""The shell: the server's processes, which move bytes and own the threads; no decision is made here.

    policy_server.py   `PolicyServer`: pre-warm and profile each model, open Zenoh, start the parts
                       below, status responders, liveliness tokens, hot standby roles, telemetry, stop;
                       the `DispatchHost` its dispatchers call back into
    ingest.py          the subscriptions and Zenoh callbacks (hand-over only) and what a reload changes
    inference_loop.py  the one inference thread (schedule -> execute -> update per model) and its supervision
    figures.py         each model's telemetry figures and counter snapshot, outside the session table's lock
    engine_worker.py   the engine process (`role: engine`): runs what an edge scheduler dispatches to it

May import (server/): dispatch, engine, model, session_table, config, runners.
Nothing in the server imports it; `cli/server.py` does.
"""
