#!/usr/bin/env bash
# The vLLM-free GPU check: paged attention, q, host syncs (any unexpected one fails), graph replay,
# memory and step times on cuda (or the CPU when
# there is none), one JSON line. Needs torch, transformers and tokenizers, not vLLM.
#   bash scripts/gpu_check.sh [cuda|cpu]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3)}
# every launch synchronous: a device-side assert (an index read from freed memory, say) names its kernel
CUDA_LAUNCH_BLOCKING=${CUDA_LAUNCH_BLOCKING:-1} exec "$PY" scripts/gpu_check.py "$@"
