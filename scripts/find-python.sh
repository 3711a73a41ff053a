#!/usr/bin/env bash
# Print a command that runs Python 3.12 (lerobot 0.6.1 needs it), or fail with a hint.
# pyenv's python3.12 shim fails unless PYENV_VERSION names a 3.12, so try the real binaries too.
is312() { "$@" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }
for c in python3.12 $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | sort -rV) \
         /usr/local/bin/python3.12 /usr/bin/python3.12 python3 python; do
  if is312 "$c"; then command -v "$c"; exit 0; fi
done
echo "no Python 3.12 found; install one or run: make PYTHON=/path/to/python3.12" >&2
exit 1
