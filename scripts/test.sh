#!/usr/bin/env bash
# The test command: installs what the tests need, then runs them all.
# Extra arguments go to pytest (e.g. scripts/test.sh -m "not engine"). The 30 slowest tests are listed
# at the end, so that a CI log shows where the suite's hour goes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest tests -p no:cacheprovider -rs --durations=30 "$@"
