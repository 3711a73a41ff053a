#!/usr/bin/env bash
# Build the virtual environment the OpenPI front door's tests drive it from: the official
# openpi-client from the package index, in an environment of its own (it requires numpy < 2, the
# project needs numpy 2). Idempotent: a finished environment is kept (its stamp names the version).
#   scripts/openpi-client-venv.sh [VENV]     (default .venv-openpi; PYTHON=... picks the interpreter)
set -euo pipefail
VENV="${1:-.venv-openpi}"
VERSION="0.1.2"
STAMP="$VENV/.openpi-client-$VERSION"
[ -f "$STAMP" ] && exit 0
PYTHON="${PYTHON:-$("$(dirname "$0")/find-python.sh" 2>/dev/null || command -v python3)}"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
# openpi-client 0.1.2 imports typing_extensions without declaring it.
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "openpi-client==$VERSION" typing_extensions
"$VENV/bin/python" -c "import openpi_client.websocket_client_policy, openpi_client.action_chunk_broker"
touch "$STAMP"
