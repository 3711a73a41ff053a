"""Studies: benchmarks beside `make bench`'s core, each run as a module from the repository root
(``python -m benchmarks.studies.<name>``); they share the core's harness (`benchmarks/harness/`).
docs/benchmarks.md gives each one's command and results."""
