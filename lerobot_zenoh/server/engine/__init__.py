"""Engines: what runs a batch the session table picked. Every engine a model's requests run on is one
`EngineExecutor` (`interface.py`); a model without `engines:` is its session table's scheduler with one
local executor (docs/architecture.md, "One engine core").

    interface.py          `Work` (a picked batch, its request records) and `EngineExecutor`: the leaf
                          every executor kind and every caller imports
    request_table.py      one record per request being computed, wherever it runs (pure)
    local.py              `local_executor`: the one executor of a model without `engines:`
    batch_executor.py     this process's runner, one forward pass per batch, on the caller's thread
    decoding_executor.py  this process's runner decoding step by step (pi0-FAST), on the inference thread
    threaded_executor.py  an executor on a thread of its own (the local engine of a model with `engines:`)
    serving.py            what this process's executors share: the batch path, answers, rejections
    admission.py          what the server reads of an observation once, and the one step every picked
                          request goes through before it runs

May import (server/): model, session_table, config, runners.
Must not be imported by: model, session_table, config, runners.
"""
