#!/usr/bin/env bash
# Will this drafter help this target? Vocabulary overlap and running-text coverage.
# Usage: bash examples/analyze_pair.sh [TARGET DRAFTER] [--text FILE] [--json]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ $# -ge 2 ] && [ "${1#--}" = "$1" ]; then TARGET=$1; DRAFTER=$2; shift 2; else
  eval "$($PY -c 'from vllm_usd.demo_pair import ensure_real_pair as e; p = e(); print("TARGET=" + p["gemma3"], "DRAFTER=" + p["smollm2"])')"
fi
exec $PY -m vllm_usd.cli analyze "$TARGET" "$DRAFTER" "$@"
