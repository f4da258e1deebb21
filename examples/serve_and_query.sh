#!/usr/bin/env bash
# Serve SmolLM2-135M-Instruct (target, has a chat template) drafted by Gemma-3-270m with vllm-usd,
# query it with the OpenAI client, print the spec-decode metrics, and stop the server.
# Usage: bash examples/serve_and_query.sh [TARGET DRAFTER]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ $# -ge 2 ]; then TARGET=$1; DRAFTER=$2; else
  eval "$($PY -c 'from vllm_usd.demo_pair import ensure_real_pair as e; p = e(); print("TARGET=" + p["smollm2"], "DRAFTER=" + p["gemma3"])')"
fi
PORT=${PORT:-8000}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# vllm-usd serve prints the plain vLLM command it runs (python -m vllm.entrypoints.openai.api_server ...)
$PY -m vllm_usd.cli serve "$TARGET" --drafter "$DRAFTER" -k 3 --host 127.0.0.1 --port "$PORT" \
  --dtype float32 --enforce-eager --max-model-len 1024 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 200); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  sleep 2
done
$PY examples/openai_client.py --base-url "http://127.0.0.1:$PORT/v1"
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^vllm:spec_decode_num_(drafts|accepted_tokens)_total'
