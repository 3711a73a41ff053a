#!/usr/bin/env bash
# `make bench-gpu` on a lent GPU machine, as one command: install the wheels
# scripts/prepare-device-wheels.sh put in .whl/ (carried with the call), offline, into a folder of
# their own, then run benchmarks/gpu.py from the working tree with its results in OUT_DIR (gpu.json,
# gpu.md, the compiling child's events and log, this run's log), written as each phase ends.
#   bash scripts/device-bench-gpu.sh OUT_DIR [benchmarks.gpu options...]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: device-bench-gpu.sh OUT_DIR [options]}"
shift
mkdir -p "$out"
start=$SECONDS
site=/tmp/lz-site
python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl > "$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
# The working tree first (its code is what is measured), then the carried wheels over the machine's own
# packages (transformers 5.5.4 and tokenizers 0.22.2 over the machine's newer ones).
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# A device command may run 600 s: the bench gets what the install left of 570 s, at most its 540.
budget=$(( 570 - (SECONDS - start) ))
(( budget > 540 )) && budget=540
echo "installed in $(( SECONDS - start )) s; bench budget ${budget} s"
timeout --signal=KILL $(( budget + 25 )) python3 -m benchmarks.gpu --out "$out" --budget-s "$budget" "$@" 2>&1 \
    | tee "$out/bench.log"
