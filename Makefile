# Two commands do everything on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell scripts/find-python.sh)
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The venv is rebuilt only when its inputs change.
STAMP  := $(VENV)/.installed-stamp

# A Hugging Face hub lookup otherwise hangs ~80 s on machines without network access.
export HF_HUB_OFFLINE ?= 1
export HF_HUB_DISABLE_TELEMETRY ?= 1
export TOKENIZERS_PARALLELISM ?= false

DEMO_CHECKPOINT ?= checkpoints/demo_act
DEMO_SECONDS    ?= 20
DEMO_ROBOTS     ?= 2

.PHONY: help install test test-fast demo checkpoint clean

help:
	@echo "make demo    one policy server + $(DEMO_ROBOTS) simulated robots on loopback for $(DEMO_SECONDS) s"
	@echo "make test    the whole test suite (creates $(VENV) with Python 3.12 on first use)"
	@echo "make PYTHON=/path/to/python3.12 ...   to pick the interpreter"

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "Python 3.12 not found; use make PYTHON=..." >&2; exit 1; }
	@if [ -x $(PY) ] && ! $(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then \
		echo "$(VENV) is not Python 3.12; recreating"; rm -rf $(VENV); fi
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow"

checkpoint: $(STAMP)
	@test -f $(DEMO_CHECKPOINT)/config.json || $(VENV)/bin/lerobot-zenoh-build-checkpoint \
		--policy-type act --output $(DEMO_CHECKPOINT) --state-dim 6 \
		--cameras front:96x128,wrist:96x128 --chunk-size 50 --fps 30

demo: $(STAMP) checkpoint
	$(PY) -m lerobot_zenoh.demo --checkpoint $(DEMO_CHECKPOINT) --robots $(DEMO_ROBOTS) --seconds $(DEMO_SECONDS)

clean:
	rm -rf $(VENV) checkpoints .pytest_cache
