#!/usr/bin/env bash
# hftrain on two or more GPUs in under ten minutes (scripts/gpu_check_multi.py): ddp, zero2, zero3, fsdp2, megatron
# tp2/pp2/cp2/ep2 and an FSDP1 export under torchrun over NCCL, each rank's max_memory_allocated against
# `hftrain plan`; one PASS/FAIL/SKIP line per check, exit 1 on a FAIL. Without GPUs every check is a SKIP (exit 0);
# `scripts/gpu_check_multi.sh --cpu` runs the same launches as gloo processes on the CPU (no time limit here).
# Options pass through: --nproc N (default 2), --only NAME, --budget SECONDS, --hidden H.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY="${PYTHON:-python3}"; fi
case " $* " in
  *" --cpu "*) exec "$PY" scripts/gpu_check_multi.py "$@" ;;
  *) exec timeout 600 "$PY" scripts/gpu_check_multi.py "$@" ;;
esac
