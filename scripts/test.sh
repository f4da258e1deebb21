#!/usr/bin/env bash
# The test command: installs what the tests need, then runs them all, two test files at a time
# (pytest-xdist, one file per worker: its engines and module fixtures stay together; a vLLM engine
# keeps about one core busy, so one file at a time left the other core idle); each worker's engines
# are bound to its own share of the CPUs, and the heaviest files start first (tests/conftest.py).
# Extra arguments go to pytest (e.g. scripts/test.sh -m "not engine"; -n 0 runs one file at a time).
# The 30 slowest tests are listed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest tests -p no:cacheprovider -rs --durations=30 -n 2 --dist loadfile "$@"
