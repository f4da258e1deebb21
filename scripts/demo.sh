#!/usr/bin/env bash
# The main job: install, fetch and convert the real pair (SmolLM2-135M-Instruct drafting
# for Gemma-3-270m), then generate with and without vllm-usd and compare.
# Arguments go to examples/demo.py (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} TOKENIZERS_PARALLELISM=false
# vLLM's own CPU binding (what a user gets): the target on one CPU per physical core, and the
# drafter on the target's CPUs (docs/cpu.md, "Correction (2026-12-05)").
exec .venv/bin/python examples/demo.py "$@"
