#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit tests and real multi-process gloo tests.
# Two pytest workers (HFTRAIN_TEST_WORKERS), each taking whole test files (--dist loadfile: a file's module fixtures,
# the expensive shared runs, are built once): a one-process test on one core beside a multi-process test on the
# other, the longest files first (tests/file_order.py, from tests/durations.json). HFTRAIN_TEST_WORKERS=0 runs
# everything in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${HFTRAIN_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
