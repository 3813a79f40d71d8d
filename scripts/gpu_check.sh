#!/usr/bin/env bash
# hftrain on one GPU in under ten minutes: one PASS/FAIL/SKIP line per check, exit 1 on a FAIL (scripts/gpu_check.py).
# On a machine without a GPU only the CPU net runs. Sets up .venv first when it is missing (CPU torch on this
# project's machines; a GPU machine with its own CUDA torch may run `python scripts/gpu_check.py` directly).
# Two or more GPUs: scripts/gpu_check_multi.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY="${PYTHON:-python3}"; fi
exec timeout 600 "$PY" scripts/gpu_check.py
