"""Multi-model robot pipelines (Rosa, seed 000 section 3): task descriptors, serving profiles, the
fleet planner and admission control. Pure modules: no Zenoh, no torch (docs/pipelines.md)."""
