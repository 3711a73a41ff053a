"""Fault kit: reusable network faults run beside an honest client (tcp: sockets; zenoh: key floods).

    tcp.py    faults on a TCP (HTTP / websocket) surface, each a function of (host, port, ...) that
              runs until its count is spent or its stop event is set: connection storms, closes at
              each stage of a websocket handshake, resets (SO_LINGER 0), slowloris, idle sockets,
              oversized and pathological frames, floods at line rate, an open-file limit for a child
              process (`nofile_limit`). `beside(honest, fault)` runs one beside an honest client and
              returns its `Service` (served, p50/p99, errors).
    zenoh.py  faults on Zenoh key expressions (key floods).

Imported by bare name from the tests (`from fault_kit import tcp`): tests/ is on pytest's path.
Nothing here imports the project's code: a fault knows only the bytes of the surface it attacks.
"""
