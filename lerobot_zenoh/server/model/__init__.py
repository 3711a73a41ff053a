"""One served model: what the server holds for each manifest entry, and what turns its bytes into
answers. No scheduling decisions; it runs on the shell's threads (the shell also starts the heartbeat
thread of `failover.py`).

    served_model.py    `ServedModel`: runner, session table, runner adapter, status, action publishers,
                       serving role, who runs its requests, and what the server counts for it
    runner_adapter.py  `RunnerAdapter`: the body decode, a batch checked and prepared, one `runner.run`
                       per batch, the chunk cut and encoded (wire <-> `PolicyRunner`)
    jpeg_batch.py      the JPEG frames of a whole batch, decoded at once
    batch_profiling.py the latency-vs-batch profile measured at start-up (`max_batch_size: auto`)
    routing.py         multi-model task routing, off the single-model path; text_stream.py: System 2
                       text written across frames
    failover.py        hot standby: whether this server serves a model right now (`ServingRole`, built
                       with the model), and the heartbeats of served work a standby judges by

May import (server/): session_table, config, runners.
Must not be imported by: session_table, config, runners.
"""
