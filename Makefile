# Two commands do everything on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell scripts/find-python.sh)
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The venv is rebuilt only when its inputs change.
STAMP  := $(VENV)/.installed-stamp
# `make bench*` also need LeRobot's gRPC stack (to compare against) and matplotlib (the figures).
BENCH_STAMP := $(VENV)/.bench-stamp
BENCH_ARGS ?=

# A Hugging Face hub lookup otherwise hangs ~80 s on machines without network access.
export HF_HUB_OFFLINE ?= 1
export HF_HUB_DISABLE_TELEMETRY ?= 1
export TOKENIZERS_PARALLELISM ?= false

# `make demo PORT=7450 ROBOTS=4 SECONDS=30 POLICY=diffusion` (or POLICY=smolvla, pi0, pi05: tiny VLAs)
PORT    ?= 7447
ROBOTS  ?= 2
SECONDS ?= 20
POLICY  ?= act
# COMPILE=default: the served model compiled (docs/policies.md, "Compiled inference")
COMPILE ?= off
DEMO_CHECKPOINT ?= checkpoints/demo_$(POLICY)

.PHONY: help install test test-fast test-core test-compile bench-compile demo checkpoint clean ci-tools lint

help:
	@echo "make demo    one policy server ($(POLICY)) on port $(PORT) + $(ROBOTS) simulated robots for $(SECONDS) s"
	@echo "             variables: PORT, ROBOTS, SECONDS, POLICY (act, diffusion, smolvla, pi0, pi05)"
	@echo "make checkpoint POLICY=smolvlm   a tiny VLM for task components (checkpoints/demo_smolvlm; docs/policies.md)"
	@echo "make test    the whole test suite (creates $(VENV) with Python 3.12 on first use); TEST_WORKERS=2 processes"
	@echo "make test-core   the serving core's unit tier (seconds)"
	@echo "make openpi-client-venv   the official openpi-client in .venv-openpi (the OpenPI front door's tests)"
	@echo "make PYTHON=/path/to/python3.12 ...   to pick the interpreter"

# pip prints its own progress: the first install downloads ~5 GB (torch) and takes a few minutes.
# [hardware]: LeRobot's feetech and dynamixel motor drivers, so SO-100/101 and Koch arms work as is.
$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "Python 3.12 not found; use make PYTHON=..." >&2; exit 1; }
	@if [ -x $(PY) ] && ! $(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then \
		echo "$(VENV) is not Python 3.12; recreating"; rm -rf $(VENV); fi
	@test -x $(PY) || { echo "== creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@echo "== upgrading pip"
	$(PY) -m pip install --upgrade pip
	@echo "== installing lerobot-zenoh with its test, robot, server, hardware, vla, planner and openpi extras (torch and LeRobot: ~5 GB the first time)"
	$(PY) -m pip install -e '.[test,robot,server,hardware,vla,planner,openpi,ros2]'
	@echo "== installed into $(VENV)"
	@touch $(STAMP)

install: $(STAMP)

# The fault tests need iptables in network namespaces (no sch_netem on the CI kernel). In CI (as
# root) it is installed from Debian's packages; elsewhere those tests skip with the reason.
ci-tools:
	@if [ "$$CI" = "true" ] && [ "$$(id -u)" = 0 ] && ! command -v iptables >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then \
		apt-get install -y -q iptables >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q iptables >/dev/null 2>&1; } \
		|| echo "iptables could not be installed: the fault tests will be skipped"; fi
	@# promtool (Debian's prometheus package, ~19 MB download) checks the monitor's /metrics; without it that check skips.
	@if [ "$$CI" = "true" ] && [ "$$(id -u)" = 0 ] && ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then \
		apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 \
		|| echo "promtool could not be installed: the promtool check of the monitor will be skipped"; fi

# The official openpi-client (numpy < 2) in an environment of its own, for the front door's tests
# (tests/test_openpi.py); without the package index they skip with the reason.
OPENPI_VENV ?= .venv-openpi
.PHONY: openpi-client-venv
openpi-client-venv:
	@scripts/openpi-client-venv.sh $(OPENPI_VENV) || echo "openpi-client could not be installed: the OpenPI front door's client tests will be skipped"

# The suite on TEST_WORKERS processes (pytest-xdist): 2 by default, one per core of the reference
# machine; TEST_WORKERS=1 runs it in one process, as `pytest` alone does.
TEST_WORKERS ?= 2
test: $(STAMP) ci-tools lint openpi-client-venv
	$(PY) -m pytest $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS))

# ruff, then the dead-code check (vulture; its paths and exceptions: pyproject.toml [tool.vulture]).
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m vulture

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow"

# Compiled inference (docs/policies.md, "Compiled inference"): the tests that compile a tiny pi0 with
# inductor (minutes on 2 cores; skipped by the other targets), and eager against compiled, side by side.
# BENCH_COMPILE_ARGS="--types pi0 --batches 1 --reps 3" for a shorter run.
BENCH_COMPILE_ARGS ?= --types pi0,pi05,smolvla,act --batches 1,8 --reps 7 --restart
test-compile: $(STAMP)
	LZ_TEST_COMPILE=1 $(PY) -m pytest tests/test_compiled.py tests/test_compiled_rtc.py

bench-compile: $(STAMP)
	$(PY) -m benchmarks.studies.compiled $(BENCH_COMPILE_ARGS)

# Compiled RTC (the guidance inside the graphs) against eager RTC (LeRobot's autograd guidance), side by
# side, with mixed leftovers in every batch: pi0, pi0.5 and SmolVLA at batch 1 and 8 (~6-8 min on 2 cores).
BENCH_COMPILE_RTC_ARGS ?= --types pi0,pi05,smolvla --batches 1,8 --reps 7 --rtc --threads 2
.PHONY: bench-compile-rtc
bench-compile-rtc: $(STAMP)
	$(PY) -m benchmarks.studies.compiled $(BENCH_COMPILE_RTC_ARGS)

# What compiling does to one server's capacity: the fleet benchmark's robots, each sending two JPEG
# cameras and a task, against a server serving a tiny pi0 eager, then compiled (every batch bucket up
# to max batch 8); the largest fleet within the stall budget for each, with chunks/s and chunk latency
# at it. About 16 min on 2 cores, plus about 9 min the first time to compile the buckets (inductor's
# cache is kept in outputs/compiled_capacity/). BENCH_COMPILED_CAPACITY_ARGS=--quick: a smoke run
# (~3 min with the cache warm).
BENCH_COMPILED_CAPACITY_ARGS ?=
.PHONY: bench-compiled-capacity
bench-compiled-capacity: $(STAMP)
	$(PY) -m benchmarks.studies.compiled_capacity $(BENCH_COMPILED_CAPACITY_ARGS)

# The GPU path in one command (docs/benchmarks.md, "On a lent GPU"): a real-size pi0.5 in bf16 built on
# the device, eager and CUDA-graph batches, images decoded on the device, RTC, two models on one GPU and
# robots per GPU by the fleet model, within 9 minutes on one H100; gpu.json and gpu.md land in
# BENCH_GPU_OUT as each phase ends. DRY_RUN=1: the same script on the CPU at the small shape (< 3 min).
# On a lent machine (no venv there): scripts/prepare-device-wheels.sh here, then
# scripts/device-bench-gpu.sh there, or BENCH_GPU_PY=python3 with the wheels on PYTHONPATH.
BENCH_GPU_OUT ?= outputs/bench_gpu
BENCH_GPU_ARGS ?=
BENCH_GPU_PY ?= $(PY)
.PHONY: bench-gpu
bench-gpu: $(if $(filter $(PY),$(BENCH_GPU_PY)),$(STAMP))
	$(BENCH_GPU_PY) -m benchmarks.gpu $(if $(DRY_RUN),--dry-run) --out $(BENCH_GPU_OUT) $(BENCH_GPU_ARGS)

# The serving core's pure parts (scheduler, placement, the dispatcher with a fake link and clock): seconds.
test-core: $(STAMP)
	$(PY) -m pytest -m core

checkpoint: $(STAMP)
	@test -f $(DEMO_CHECKPOINT)/config.json || $(VENV)/bin/lerobot-zenoh-build-checkpoint \
		--policy_type=$(POLICY) --output=$(DEMO_CHECKPOINT) --state_dim=6 \
		--cameras=front:96x128,wrist:96x128 --chunk_size=50 --fps=30

demo: $(STAMP) checkpoint
	DEMO_PORT_VARIABLE=PORT $(PY) -m lerobot_zenoh.demo --policy=$(POLICY) --checkpoint=$(DEMO_CHECKPOINT) --port=$(PORT) \
		--robots=$(ROBOTS) --seconds=$(SECONDS) --compile=$(COMPILE)

clean:
	rm -rf $(VENV) $(OPENPI_VENV) checkpoints outputs .pytest_cache

# Fleet study over real Zenoh and a real server (virtual robots in one process), the model's rungs
# and metrics, 3 seeds per point, capacity to one robot, set beside the model at the same scale
# (about 35 min on 2 cores; cached per run and code version in outputs/fleet_zenoh/): rewrites the
# generated block of "Fleet over real Zenoh" in docs/studies/fleet.md. FLEET_ARGS=--fresh re-runs
# everything; FLEET_ARGS="--lock <file>" serialises it with other benchmarks.
# bench-fleet-sim: the discrete-event model of the same fleet (a few minutes), "Fleet scheduling".
FLEET_ARGS ?=
.PHONY: bench-fleet bench-fleet-sim
bench-fleet: $(BENCH_STAMP)
	$(PY) -m benchmarks.studies.fleet_zenoh study --write-docs docs/studies/fleet.md $(FLEET_ARGS)

bench-fleet-sim: $(STAMP)
	$(PY) -m benchmarks.studies.fleet --write-docs docs/studies/fleet.md

# Re-fetch of stale observations on the real stack (docs/studies/refetch.md): robots of the reference
# client's own send trigger, chunk intake and buffer against a real server where requests queue, with
# re-fetch off and at each threshold (~3 min on 2 cores with these defaults).
REFETCH_ARGS ?= --robots 8 --scheduler fifo --refetch 0 0.1 0.2 --seeds 0 1 2
.PHONY: bench-refetch
bench-refetch: $(STAMP)
	$(PY) -m benchmarks.studies.refetch $(REFETCH_ARGS)

# The same model with tiers (docs/studies/edge-cloud-model.md, "Edge and cloud in the model"): edge-only / cloud-only /
# hybrid against the task arrival rate (Kairos Fig. 13, gpu and vla profiles), the WAN sweep (Fig. 17)
# and scale-out on one site; then wait ratio against FIFO over loads on fresh seeds ("Wait ratio
# against FIFO, re-measured"). Long: several hours on a shared 2-core machine (overloaded tiers are slow to simulate).
.PHONY: bench-hybrid-sim
bench-hybrid-sim: $(STAMP)
	$(PY) -m benchmarks.studies.fleet --hybrid --seeds 3 --duration-s 150 --write-docs docs/studies/edge-cloud-model.md
	$(PY) -m benchmarks.studies.fleet --order --order-batches 1 16 --profiles gpu --seeds 10 --first-seed 10 --loads 0.5 0.7 0.8 0.9 0.95 1.0 --write-docs docs/studies/edge-cloud-model.md

# Real-time chunking against blending (docs/studies/rtc.md, "Real-time chunking"): records a dataset
# with the client, trains a tiny SmolVLA on it with lerobot-train (once, ~10-15 min on 2 cores; cached
# in outputs/rtc/<settings>/), then about 15 min of measurements over real Zenoh. RTC_ARGS=--seeds 1 ...
RTC_STAMP := $(VENV)/.rtc-stamp
RTC_ARGS ?=
.PHONY: bench-rtc
$(RTC_STAMP): $(STAMP)
	$(PY) -m pip install -e '.[robot,vla,training]'
	@touch $@

bench-rtc: $(RTC_STAMP)
	$(PY) -m benchmarks.studies.rtc all --write-docs docs/studies/rtc.md $(RTC_ARGS)

# The dynamic execution horizon of the flow-matching VLA that bench-rtc trained (docs/studies/rtc.md,
# "Execution horizon of a flow-matching VLA"; rewrites its generated block): needs outputs/rtc/ from
# `make bench-rtc`. FM_HORIZON_ARGS="--seeds 1 --probes 8" for a shorter run.
FM_HORIZON_ARGS ?=
.PHONY: bench-fm-horizon
bench-fm-horizon: $(RTC_STAMP)
	$(PY) -m benchmarks.studies.fm_horizon --rtc-dir outputs/rtc --write-docs docs/studies/rtc.md $(FM_HORIZON_ARGS)

# Fault tests in network namespaces (root; part of `make test` too) and a soak run.
SOAK_MINUTES ?= 30
SOAK_ROBOTS  ?= 4
# Robots coming and going (one stops every 60 s, every other one killed) with two 480x640 cameras
# each: on one host they use the same-host path, so its shared memory is soaked too.
SOAK_ARGS    ?= --cameras 480x640,480x640 --churn-s 60
.PHONY: test-faults soak
test-faults: $(STAMP)
	$(PY) -m pytest tests/test_faults.py -s

# The TCP fault kit (testbed/fault_kit/tcp.py) run long on the OpenPI front door and the monitor's /metrics,
# each fault beside an honest client (printed), then the front door's memory and an honest
# openpi-client's latency beside 8 connections of 16 MiB nested frames (docs/openpi.md, "Under faults").
.PHONY: test-faults-tcp
test-faults-tcp: $(STAMP) openpi-client-venv
	LZ_FAULTS_LONG=1 $(PY) -m pytest tests/test_openpi_faults.py tests/test_fault_kit_tcp.py -s
	$(PY) -m benchmarks.studies.openpi_door_faults

# The OpenPI front door against a Zenoh robot on the same model, and openpi-clients served at once
# through it (docs/benchmarks.md, "OpenPI front door"; ~5 min on 2 cores).
OPENPI_FRONT_DOOR_ARGS ?=
.PHONY: bench-openpi-front-door
bench-openpi-front-door: $(STAMP) openpi-client-venv
	$(PY) -m benchmarks.studies.openpi_front_door --venv $(OPENPI_VENV) $(OPENPI_FRONT_DOOR_ARGS)

# The ROS 2 front door's added latency beside the same robot through lerobot-robot-client (docs/ros2.md).
ROS2_DOOR_ARGS ?= --seconds 30
.PHONY: bench-ros2-door
bench-ros2-door: $(STAMP)
	$(PY) -m benchmarks.studies.ros2_door $(ROS2_DOOR_ARGS)

soak: $(STAMP)
	$(PY) -m benchmarks.studies.soak --minutes $(SOAK_MINUTES) --robots $(SOAK_ROBOTS) $(SOAK_ARGS)

# Hot standby over mutual TLS via a router (docs/reliability.md, "Start-up and step-back"): 20 start-ups
# of real server processes with the primary ready 1.8 s ahead, and 20 primaries frozen mid-batch (SIGSTOP
# 2-12 s, then SIGCONT); `make test` runs a few of each. About 6 min on 2 cores.
.PHONY: test-failover-faults
test-failover-faults: $(STAMP)
	LZ_TEST_FAILOVER_FAULTS=1 $(PY) -m pytest tests/test_failover_tls.py -s -p no:xdist

# Benchmarks against LeRobot's gRPC async inference and the physical floor (docs/benchmarks.md): a few
# minutes on 2 cores; BENCH_ARGS=--full for the long runs. Shaped links need root (network namespaces).
# Rewrites the results table of README.md from the run (benchmarks/results_table.py), but not from a run
# whose load average was above the core count (BENCH_ARGS=--allow-loaded writes it, marked as loaded).

$(BENCH_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install -e '.[test,robot,server,hardware,vla,planner,openpi,bench]'
	@touch $(BENCH_STAMP)

.PHONY: bench
bench: $(BENCH_STAMP)
	$(PY) -m benchmarks.run_all --write-readme README.md $(BENCH_ARGS)

# The JPEG codecs side by side (OpenCV, simplejpeg, PyTurboJPEG if its system library is there).
.PHONY: bench-codec
bench-codec: $(STAMP)
	$(PY) -m benchmarks.studies.codec

# A batch's JPEG decode on the CPU: decoders (simplejpeg, OpenCV, torchvision, Pillow) and thread
# layouts side by side, 2 and 3 cameras at 96x128, 224x224 and 480x640, batches of 1 and 8
# (docs/benchmarks.md, "JPEG decode of a batch"; a minute or two).
.PHONY: bench-jpeg-batch
bench-jpeg-batch: $(STAMP)
	$(PY) -m benchmarks.studies.jpeg_batch

# Rosa's workloads on the real stack (docs/studies/pipelines.md, "Multi-model pipelines: planned fleet vs
# baselines, measured"; rewrites its generated block): planned, shared and dedicated deployments written by the deployment code,
# server processes from their manifests, the real pipeline clients; ~25 min on 2 cores with the
# defaults (P4 and Mix2 at 8, 16, 32 robots, 3 runs each). PIPELINES_RUN_ARGS="--sizes 8 --seeds 1" ...
PIPELINES_RUN_ARGS ?= --workloads P4 Mix2 --sizes 8 16 32 --seeds 3 --seconds 15 --warmup 5
.PHONY: bench-pipelines-run
bench-pipelines-run: $(STAMP)
	$(PY) -m benchmarks.studies.pipelines_run $(PIPELINES_RUN_ARGS) --write-docs docs/studies/pipelines.md

# The same workloads in the planner's model (docs/studies/pipelines.md, "in the model"; rewrites its
# generated block; seconds).
.PHONY: bench-pipelines-plan
bench-pipelines-plan: $(STAMP)
	$(PY) -m benchmarks.studies.pipelines_plan --write-docs docs/studies/pipelines.md

# A multi-model task's bytes on the link per control decision: published once vs once per component
# (docs/studies/pipelines.md, "Multi-model pipelines: bytes on the link"; iptables counters need root).
.PHONY: bench-pipeline-bytes
bench-pipeline-bytes: $(STAMP)
	$(PY) -m benchmarks.studies.pipeline_bytes
	$(PY) -m benchmarks.studies.pipeline_bytes --links

# Engine answer floods in plain mode beside a control (docs/security.md, "Engine answer floods"): two edge
# schedulers, each with an engine process and an honest robot, 100,000 made-up answers at 10,000/s on
# one engine's answer key (~2 min on 2 cores). ANSWER_FLOODS_ARGS="--server_source DIR": another checkout's servers.
ANSWER_FLOODS_ARGS ?=
.PHONY: bench-answer-floods
bench-answer-floods: $(STAMP)
	$(PY) -m benchmarks.studies.answer_floods $(ANSWER_FLOODS_ARGS)

# Floods of invented client ids against one server, a control server beside it (docs/security.md,
# "Resource limits against a hostile client"): 60 kB ids, then 64 kB tasks to a tiny SmolVLA (~2 min
# each on 2 cores). INGEST_FLOODS_ARGS="--server_source DIR": another checkout's servers.
INGEST_FLOODS_ARGS ?=
.PHONY: bench-ingest-floods
bench-ingest-floods: $(STAMP)
	$(PY) -m benchmarks.studies.ingest_floods --scenario long_ids $(INGEST_FLOODS_ARGS)
	$(PY) -m benchmarks.studies.ingest_floods --scenario long_tasks $(INGEST_FLOODS_ARGS)

# The fault kit's Zenoh floods at line rate (testbed/fault_kit/zenoh.py): every Zenoh subscriber that takes
# input from other processes flooded with each payload kind for FAULTS_FLOOD_S seconds after a control
# window of the same length, the honest robot's service printed for both (docs/reliability.md, "Floods
# of Zenoh keys"); a few minutes on 2 cores. `make test` runs the same tests short, with exact counts.
FAULTS_FLOOD_S ?= 10
.PHONY: test-faults-zenoh
test-faults-zenoh: $(STAMP)
	LZ_FAULTS_LONG=1 LZ_FAULTS_FLOOD_S=$(FAULTS_FLOOD_S) $(PY) -m pytest tests/test_fault_kit_zenoh.py tests/test_ros2_faults.py -s

# Scripted attacks on a robot's session in plain mode (docs/security.md, "Sessions against a forger").
.PHONY: bench-session-attacks
bench-session-attacks: $(STAMP)
	$(PY) -m benchmarks.studies.session_attacks

# pi0.5 actions + language from one prefill, and the VLM runner's batched text (docs/studies/pi05-language.md,
# "pi0.5: actions and language from one prefill"); needs lerobot[pi] (the `vla` extra), no Zenoh.
# LANGUAGE_ARGS="--device cuda --dtype bfloat16" runs the same table on a GPU.
LANGUAGE_ARGS ?= --threads 1
LANGUAGE_STAMP := $(VENV)/.language-stamp
.PHONY: bench-language
$(LANGUAGE_STAMP): $(STAMP)
	$(PY) -m pip install -e '.[vla]'
	@touch $@

bench-language: $(LANGUAGE_STAMP)
	$(PY) -m benchmarks.studies.language $(LANGUAGE_ARGS)

# Text never starves actions (docs/security.md, "Text beside actions, measured"): an honest robot beside
# 16 robots asking the same pi0.5 for actions and text, against the same fleet without text and with
# language.action_slo_ms, each condition on a fresh lerobot-policy-server over Zenoh on loopback
# (~10 min on 2 cores). TEXT_BUDGET_ARGS=--quick for a 2-minute smoke run.
TEXT_BUDGET_ARGS ?=
.PHONY: bench-text-budget
bench-text-budget: $(LANGUAGE_STAMP)
	$(PY) -m benchmarks.studies.text_budget $(TEXT_BUDGET_ARGS)


# Edge-only vs cloud-only vs hybrid (Kairos Fig. 13; docs/studies/edge-cloud-serving.md, "Edge-cloud serving"): an edge
# scheduler, a cloud engine process and Poisson task arrivals over shaped links (robots-edge 2.5 ms
# one way, edge-cloud 100 ms ONE WAY / 1 Gbit/s as Kairos' WAN, --wan-ms 50 for a 100 ms round trip;
# root for the namespaces); ~12 min on 2 cores with these defaults. HYBRID_ARGS="--rates 2,6,10,14
# --seeds 5 --duration-s 30" for a longer run, "--profile vla" for the VLA-shaped profiles. The model
# beside a run: python -m benchmarks.studies.fleet_hybrid_check <out>/hybrid.json --calibrate.
HYBRID_ARGS ?= --rates 2,6,10 --seeds 3 --duration-s 12 --warmup-s 3
.PHONY: bench-hybrid
bench-hybrid: $(STAMP)
	$(PY) -m benchmarks.studies.hybrid study $(HYBRID_ARGS)

# The model at a real hybrid run's settings, side by side (docs/studies/edge-cloud-model.md, "The model
# against the real runs"): HYBRID_RUN is the hybrid.json a `make bench-hybrid` run wrote.
HYBRID_RUN ?= /tmp/lz_hybrid/hybrid.json
.PHONY: bench-hybrid-check
bench-hybrid-check: $(STAMP)
	$(PY) -m benchmarks.studies.fleet_hybrid_check $(HYBRID_RUN) --calibrate

# Scale-out on one site (docs/studies/edge-cloud-serving.md, "Edge-cloud serving"): robots carried within the stall
# budget by 1, 2, 4 engine processes behind one scheduler against as many servers with robots
# assigned statically, over real Zenoh on loopback (synthetic GPUs that sleep); ~15 min on 2 cores.
SCALEOUT_ARGS ?= --engines 1 2 4 --grid 2 3 4 5 --seeds 0 1 2 --measure-s 20
.PHONY: bench-hybrid-scaleout
bench-hybrid-scaleout: $(STAMP)
	$(PY) -m benchmarks.studies.fleet_scaleout $(SCALEOUT_ARGS)


# pi0-FAST decoding across robots (docs/studies/pi0-fast.md, "pi0-FAST: continuous batching across robots"):
# one at a time vs static vs continuous batching, tiny and small shapes, 1..16 robots. Needs only
# lerobot, torch, transformers, tokenizers, numpy. On a GPU: AR_ARGS="--device cuda --dtype bfloat16".
.PHONY: bench-autoregressive
bench-autoregressive: $(STAMP)
	$(PY) -m benchmarks.studies.autoregressive $(AR_ARGS)
