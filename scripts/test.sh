#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit tests and real multi-process gloo tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
