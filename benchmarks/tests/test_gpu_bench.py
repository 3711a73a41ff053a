"""`make bench-gpu` (benchmarks/gpu.py): its smoke run end to end on the CPU, so the GPU command cannot
rot between lent machines; its phase bookkeeping (a figure file after every phase, a failing phase
recorded while the later ones still run); and, on a CUDA machine only, two models on one GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_writes_every_phase_and_the_docs_block(tmp_path):
    """The same script as the GPU run, tiny and on the CPU: every phase ends done or skipped with a
    reason (compiling is off in the smoke preset, images on the device and two models need CUDA)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    from benchmarks.gpu import BEGIN, END, PHASES

    phases = data["phases"]
    assert list(phases) == list(PHASES)
    assert {name: p["status"] for name, p in phases.items()} == {
        "environment": "done", "build": "done", "eager": "done", "compiled": "skipped", "images": "skipped",
        "rtc": "done", "two_models": "skipped", "fleet": "done"}, {n: p.get("error") for n, p in phases.items()}
    assert all(phases[n].get("reason") for n in ("compiled", "images", "two_models"))
    eager = phases["eager"]["batches"]
    assert set(eager) == {"1", "2"} and all(0 < b["p50_ms"] <= b["p90_ms"] for b in eager.values())
    assert all(b["batch_fallbacks"] == 0 for b in eager.values())
    assert phases["build"]["parameters"] > 1e6 and phases["environment"]["torch"]
    cases = {(r["case"], r["batch"]) for r in phases["rtc"]["rows"]}
    assert ("every row a leftover", 1) in cases and ("half the rows a leftover", 2) in cases
    fleet = phases["fleet"]
    assert fleet["profile_source"] == "eager" and set(fleet["profile_ms"]) == {"1", "2"}
    assert [r["rung"] for r in fleet["rungs"]][0] == "FIFO, one at a time"
    assert all(str(r["robots"]).removeprefix(">= ").isdigit() for r in fleet["rungs"])
    block = (tmp_path / "gpu.md").read_text()
    assert block.startswith(BEGIN) and block.rstrip().endswith(END)
    assert "| eager | done |" in block and "Robots per GPU" in block


def test_each_phase_is_written_when_it_ends_and_a_failure_stops_only_itself(tmp_path, monkeypatch):
    from benchmarks import gpu

    seen: list[set[str]] = []

    def phase(name, figures):
        def run(self, available):
            written = tmp_path / "gpu.json"
            seen.append(set(json.loads(written.read_text())["phases"]) if written.exists() else set())
            if isinstance(figures, Exception):
                raise figures
            return dict(figures)
        return run

    for name in gpu.PHASES:
        monkeypatch.setattr(gpu.Run, f"phase_{name}", phase(name, {"note": name}))
    monkeypatch.setattr(gpu.Run, "phase_eager", phase("eager", RuntimeError("the GPU caught fire")))
    monkeypatch.setattr(gpu.Run, "phase_images", phase("images", {"status": "skipped", "reason": "no CUDA"}))
    data = gpu.Run(gpu.PRESETS["smoke"], tmp_path).all()
    # before each phase ran, the file held every phase before it
    assert seen == [set()] + [set(gpu.PHASES[:i]) for i in range(1, len(gpu.PHASES))]
    statuses = {name: p["status"] for name, p in data["phases"].items()}
    assert statuses["eager"] == "failed" and "the GPU caught fire" in data["phases"]["eager"]["error"]
    assert statuses["images"] == "skipped" and statuses["fleet"] == "done"
    block = (tmp_path / "gpu.md").read_text()
    assert "| eager | failed |" in block and "| images | skipped |" in block


def test_a_spent_budget_skips_the_remaining_phases_with_the_reason(tmp_path, monkeypatch):
    from benchmarks import gpu

    for name in gpu.PHASES:
        monkeypatch.setattr(gpu.Run, f"phase_{name}", lambda self, available: {})
    run = gpu.Run(gpu.PRESETS["smoke"], tmp_path)
    run.deadline = run.t0 - 1  # already past
    data = run.all()
    assert data["phases"]["environment"]["status"] == "done"
    assert all(data["phases"][n]["status"] == "skipped" and "budget" in data["phases"][n]["reason"]
               for n in gpu.PHASES[1:])


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_two_models_on_one_gpu_serve_what_each_serves_alone(tmp_path):
    """Two models on one GPU, one decoding its JPEG frames with nvJPEG (images_on_device), served from
    two threads at once: every chunk equals the chunk of the same batch served alone (the decode's
    stream order, runners/device_images.py)."""
    from dataclasses import replace

    from benchmarks import gpu

    settings = replace(gpu.PRESETS["smoke"], device="cuda", batches=(1, 4))
    run = gpu.Run(settings, tmp_path)
    run.phase_build(60.0)
    run.phase_eager(60.0)
    run.phase_images(60.0)
    figures = run.phase_two_models(60.0)
    # the same kernels on the same inputs: equal up to float32 rounding (memory overwritten would be garbage)
    assert figures["batches"] >= 5 and figures["max_diff"] <= 1e-4 and figures["device_fallbacks"] == 0
