"""Fault kit: reusable network faults run beside an honest client (tcp: sockets; zenoh: key floods).

    tcp.py    faults on a TCP (HTTP / websocket) surface, each a function of (host, port, ...) that
              runs until its count is spent or its stop event is set: connection storms, closes at
              each stage of a websocket handshake, resets (SO_LINGER 0), slowloris, idle sockets,
              oversized and pathological frames, floods at line rate, an open-file limit for a child
              process (`nofile_limit`). `beside(honest, fault)` runs one beside an honest client and
              returns its `Service` (served, p50/p99, errors). It imports nothing of the project's: a
              fault knows only the bytes of the surface it attacks.
    zenoh.py  faults on Zenoh key expressions: floods of a key at line rate or a set rate (random,
              truncated, deeply nested, oversized and forged payloads), hostile replies to queries,
              and `HonestRobot` / `Service` (the real robot client on the simulated robot, measured
              against a control window). It builds its forged messages with the project's codec.

Imported as `from testbed.fault_kit import tcp` by the tests and by the benchmark studies that measure a
surface under faults; like the rest of `testbed`, it imports nothing from `tests/` or `benchmarks/`.
Every network-facing surface gets the kit before it is called done: its fault tests run in the
default suite (short, assertions on counting and service, never on time) and the long measured runs
in `make test-faults`.
"""
