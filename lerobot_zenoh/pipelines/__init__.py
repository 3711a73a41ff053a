"""Multi-model robot pipelines (after Rosa; docs/pipelines.md): task descriptors, serving profiles,
the fleet planner and admission control. Pure modules: no Zenoh, no torch."""
