"""The policy server: robots' observations in, each model's answers out (docs/architecture.md, "Server
process"). Its rooms, each a package whose `__init__` is its map; imports point down this list only:

    shell/          the processes: `PolicyServer` (Zenoh wiring, ingest, the inference thread, status,
                    liveliness, telemetry figures) and the engine process (`role: engine`)
    dispatch/       a model with `engines:`: the dispatcher placing each picked request on an engine,
                    the links to remote engines, their health, the answers relayed back to the robots
    engine/         what runs a picked batch: the executor interface (`Work`, `EngineExecutor`), this
                    process's executors (batch, iteration-level, threaded), admission, serving, the
                    request table
    model/          one served model: `ServedModel`, its runner adapter (decode, infer, encode), the
                    batch JPEG decode, the batch profile, task routing, its serving role (hot standby)
    session_table/  the robots' sessions of one model and whom to serve next: the session table, its
                    plain records, the session rules, the roster, the cool-down of bad clients
    config/         the manifest, and the runner each of its entries asks for (`load_runner`)
    runners/        the policy runners behind one seam (`PolicyRunner`), their registry, hub checkpoints

A package imports only the packages below it (`tests/test_code_shape.py` checks each `__init__`'s
"May import" line, and that no module is in an import cycle, type hints included). From outside the
server: `cli/` imports `shell/policy_server.py`, `config/manifest.py` and `runners/hub.py`, the demo
`config/manifest.py`, `checkpoint_builder/` `runners/`, the OpenPI front door
`session_table/rate_limit.py`; nothing here imports `client/` or `cli/`.
"""
