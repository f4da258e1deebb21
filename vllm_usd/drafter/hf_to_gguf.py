"""A drafter given as a Hugging Face folder, converted once to a GGUF for llama.cpp.

The conversion is llama.cpp's own ``convert_hf_to_gguf.py`` (with its ``conversion``
package and its ``gguf-py``), from the source distribution of the installed
llama-cpp-python release: ``scripts/setup-env.sh`` unpacks them into
``$VLLM_USD_CACHE/llama.cpp-convert/<release>``. Nothing of the format is written
here. It runs in a child process, so an architecture it does not know is one
failed conversion, reported in one line, and the drafter stays on transformers.

The GGUF is written in 16-bit (``f16``: nothing rounded yet, so ``auto`` can time
its Q8_0 and Q4_0 copies, ``gguf_types.py``) and cached in ``$VLLM_USD_CACHE/gguf``,
keyed by the SHA-256 of the folder's files (config, tokenizer, weights) and the
converter's release: a folder whose weights change is converted again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

logger = logging.getLogger("vllm.usd")

OUT_TYPE = "f16"
#: the folder's files that decide the GGUF: weights, config and tokenizer (not READMEs, not other GGUFs)
KEYED_SUFFIXES = (".safetensors", ".bin", ".json", ".model", ".txt", ".tiktoken")
CONVERT_TIMEOUT_S = 900.0


class ConversionError(ValueError):
    """The folder could not be converted; the message is the one line the log shows."""


def converter_dir(cache_root: str) -> Path | None:
    """llama.cpp's converter for the installed llama-cpp-python release, where setup-env unpacked it."""
    try:
        release = metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        return None
    root = Path(os.path.expanduser(cache_root)) / "llama.cpp-convert" / release
    return root if (root / "convert_hf_to_gguf.py").is_file() else None


def folder_key(path: str, converter: Path) -> str:
    """SHA-256 of the folder's keyed files (names and contents) and the converter's release."""
    digest = hashlib.sha256(converter.name.encode())
    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        if not name.endswith(KEYED_SUFFIXES) or not os.path.isfile(file):
            continue
        digest.update(name.encode() + b"\0")
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def converted_path(path: str, cache_root: str, converter: Path) -> Path:
    name = Path(os.path.realpath(path)).name
    return Path(os.path.expanduser(cache_root)) / "gguf" / f"{name}-hf-{folder_key(path, converter)}-{OUT_TYPE}.gguf"


def convert_folder(path: str, cache_root: str, *, timeout_s: float = CONVERT_TIMEOUT_S) -> str:
    """The folder's GGUF, converting it first if no cached one exists. Raises ConversionError."""
    converter = converter_dir(cache_root)
    if converter is None:
        raise ConversionError("llama.cpp's converter is not installed (scripts/setup-env.sh unpacks it)")
    out = converted_path(path, cache_root, converter)
    if out.is_file():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    logger.info("vllm-usd: converting the drafter %s to a %s GGUF for llama.cpp (once; cached as %s)",
                path, OUT_TYPE.upper(), out)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(converter / "gguf-py"),
                                                                        os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run([sys.executable, str(converter / "convert_hf_to_gguf.py"), path, "--outfile", str(tmp),
                               "--outtype", OUT_TYPE], capture_output=True, text=True, timeout=timeout_s, env=env,
                              cwd=str(converter))
    except subprocess.TimeoutExpired:
        tmp.unlink(missing_ok=True)
        raise ConversionError(f"llama.cpp's converter ran past {timeout_s:.0f} s") from None
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        raise ConversionError(f"llama.cpp's converter failed ({lines[-1].strip() if lines else proc.returncode})")
    os.replace(tmp, out)
    logger.info("vllm-usd: converted the drafter to %s in %.1fs", out, time.perf_counter() - start)
    return str(out)
