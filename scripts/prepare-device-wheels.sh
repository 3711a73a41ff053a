#!/usr/bin/env bash
# The wheels a lent GPU machine lacks for `make bench-gpu`, into .whl/ (git-ignored: it travels as a
# carried path), and a check that they and the working tree fit the 64 MiB a device call carries.
#
# The machine has Python 3.12, torch, torchvision, triton, numpy, safetensors, huggingface-hub, msgpack,
# PyYAML, OpenCV and the rest of a CUDA image, but not LeRobot, draccus or pydantic, and a transformers
# (and tokenizers) newer than LeRobot 0.6.1 accepts (< 5.6). This downloads, without their
# dependencies, the versions this project's virtual environment runs of exactly what `benchmarks/gpu.py`
# imports that the machine lacks (found by running `python -m benchmarks.gpu --smoke` on a site folder
# holding only the machine's packages plus these), and builds this project's own wheel (for its
# metadata; the code itself runs from the carried working tree). On the machine,
# scripts/device-bench-gpu.sh installs them offline:
#     python3 -m pip install --no-index --no-deps --target /tmp/lz-site .whl/*.whl
#
#   scripts/prepare-device-wheels.sh            (PY=... names the Python of the project's venv)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
DEST=.whl
LIMIT_MIB=64

# Distribution names; each version is the one installed in $PY's environment.
NEEDED=(
    lerobot            # the policies, processors and configs (0.6.1)
    draccus mergedeep toml termcolor  # LeRobot's configs and their needs
    gymnasium farama-notifications    # imported by LeRobot's policy factory
    transformers tokenizers           # the versions LeRobot 0.6.1 accepts (< 5.6; tokenizers <= 0.23.0)
    pydantic pydantic-core annotated-types typing-inspection  # the manifest's and runners' settings
    eclipse-zenoh simplejpeg          # this project's transport and JPEG codec (imported by the server code)
)

specs=()
for name in "${NEEDED[@]}"; do
    version="$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")"
    specs+=("$name==$version")
done

rm -rf "$DEST"
mkdir -p "$DEST"
echo "== downloading ${#specs[@]} wheels for CPython 3.12 on x86-64 Linux, without dependencies"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
    -d "$DEST" "${specs[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
echo "== building lerobot-zenoh's own wheel (its metadata; the code runs from the working tree)"
# setuptools leaves build/ and the egg-info in the tree: removed after, unless they were there before.
leftovers=()
for d in build lerobot_zenoh.egg-info; do [ -e "$d" ] || leftovers+=("$d"); done
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$DEST" . >/dev/null 2>&1
for d in "${leftovers[@]}"; do rm -rf "$d"; done

# What a device call carries: the working tree (tracked files and untracked ones git does not ignore)
# plus the carried .whl/.
tree_bytes=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 stat -c %s 2>/dev/null \
              | awk '{s += $1} END {print s + 0}')
wheel_bytes=$(find "$DEST" -type f -name '*.whl' -exec stat -c %s {} + | awk '{s += $1} END {print s + 0}')
echo "== wheels in $DEST:"
find "$DEST" -type f -name '*.whl' -exec stat -c '%s %n' {} + | sort -rn | awk '{printf "%8.2f MiB  %s\n", $1 / 1048576, $2}'
awk -v w="$wheel_bytes" -v t="$tree_bytes" -v l="$LIMIT_MIB" 'BEGIN {
    printf "%8.2f MiB  wheels\n%8.2f MiB  working tree\n%8.2f MiB  in all, of %d MiB a device call carries\n",
           w / 1048576, t / 1048576, (w + t) / 1048576, l
    exit (w + t > l * 1048576) }' || { echo "over the limit: carry less" >&2; exit 1; }
echo "== on the device: bash scripts/device-bench-gpu.sh \"\$OUT\"   (carry: .whl)"
