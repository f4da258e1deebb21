#!/usr/bin/env bash
# The main job: install, fetch and convert the real pair (SmolLM2-135M-Instruct drafting
# for Gemma-3-270m), then generate with and without vllm-usd and compare.
# Arguments go to examples/demo.py (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} TOKENIZERS_PARALLELISM=false
# vLLM's CPU worker binds its OpenMP threads to one CPU per physical core ("auto"); on this 2-vCPU
# VM that is one CPU of two. Binding both made the target alone (and vllm-usd) about 1.5x faster
# here (docs/cpu.md, "Threads and binding"). Only on small machines, and only when the variable is unset: on a
# large or multi-socket host, vLLM's own binding is the better default.
if [[ -z "${VLLM_CPU_OMP_THREADS_BIND:-}" && $(nproc) -le 4 ]]; then
    VLLM_CPU_OMP_THREADS_BIND=$(.venv/bin/python -c 'import os; print(",".join(map(str, sorted(os.sched_getaffinity(0)))))')
    export VLLM_CPU_OMP_THREADS_BIND
    echo "[demo] VLLM_CPU_OMP_THREADS_BIND=$VLLM_CPU_OMP_THREADS_BIND (every CPU; set it to override)"
fi
exec .venv/bin/python examples/demo.py "$@"
