"""Randomly initialised LeRobot checkpoints built offline, for demos, tests and benchmarks.

`build.build_checkpoint` writes an ordinary LeRobot checkpoint folder (the console script
``lerobot-zenoh-build-checkpoint``, `lerobot_zenoh.cli.build_checkpoint`, is its command line);
`tiny_pi` holds the small pi0/pi0.5/pi0-FAST architectures such a checkpoint may declare, and
`tiny_pi0_fast` the tokenizers and shapes of an offline pi0-FAST; `in_memory` builds a model (real
size included: ``--architecture=full``) with its weights drawn on its device, for benchmarks, through
the server's own runner, from a folder written without weights. The server loads what this
package writes like any other checkpoint (docs/policies.md, "Building a checkpoint offline" and
"Tiny VLAs offline"). Importing this package imports nothing heavy; torch is imported by the
builder when it runs.
"""
