"""The llama.cpp drafter's weight type: its GGUF as shipped, or requantized once to a faster type.

llama.cpp's CPU matmul speed depends on the weight type, not only on its size. On this
machine (AVX2, ``benchmarks/drafter_step.py --formats gguf gguf:q8_0 ...``) SmolLM2-135M's
Q4_1 GGUF runs a decode step slower than the same weights requantized to Q8_0, at every batch
size, though Q8_0 reads 1.5x the bytes; the 4-bit types with repacked kernels (Q4_0, IQ4_NL)
are faster still but round the 4-bit weights a second time, and draft noticeably differently
(README, "Drafter speed"). ``usd.drafter_gguf_type`` picks the type the drafter runs in:

- ``"file"``: the GGUF as it is;
- a llama.cpp type name (``GGUF_TYPES``): the GGUF requantized to that type, once, into
  ``$VLLM_USD_CACHE/gguf/`` (about a second for a 135M model), and reused after that;
- ``"auto"`` (default): ``AUTO_TARGET_TYPE`` for a GGUF of a type measured slow here
  (``SLOW_FILE_TYPES``), the file as it is otherwise.

Requantizing keeps drafting lossless: q is the distribution the requantized drafter's own
logits give.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger("vllm.usd")

# llama.cpp file types by name (llama_ftype in llama.h) a drafter may be requantized to. The 16-bit
# types are never picked by auto: they read twice Q8_0's bytes and ran slower here, but their
# kernels come closer to the weight-read limit (README, "Drafter speed").
GGUF_TYPES: dict[str, int] = {"q4_0": 2, "iq4_nl": 25, "q4_1": 3, "q4_k_m": 15, "q8_0": 7, "f16": 1, "bf16": 32}
CHOICES = ("auto", "file", *GGUF_TYPES)

# file types measured slower here than their Q8_0 requantization (benchmarks/drafter_step.py
# --formats gguf gguf:q8_0): Q4_1. Gemma-3's Q4_K_M ran as fast as its Q8_0 copy and stays as it is.
SLOW_FILE_TYPES = frozenset({3})
AUTO_TARGET_TYPE = "q8_0"


def file_type(gguf: str) -> int:
    """The GGUF's ``general.file_type`` (llama_ftype), read by llama.cpp without loading its weights."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(gguf.encode(), params)
    if not model:
        raise ValueError(f"vllm-usd: llama.cpp cannot read the drafter GGUF {gguf!r}")
    try:
        buf = ctypes.create_string_buffer(32)
        n = llama_cpp.llama_model_meta_val_str(model, b"general.file_type", buf, len(buf))
        return int(buf.value) if n > 0 else -1
    finally:
        llama_cpp.llama_model_free(model)


def resolve(gguf_type: str, current: int) -> str | None:
    """The type to requantize to, or None to run the file as it is."""
    if gguf_type == "file":
        return None
    if gguf_type == "auto":
        return AUTO_TARGET_TYPE if current in SLOW_FILE_TYPES else None
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"vllm-usd: usd.drafter_gguf_type = {gguf_type!r} is not one of {', '.join(CHOICES)}.")
    return None if GGUF_TYPES[gguf_type] == current else gguf_type


def requantized_path(gguf: str, gguf_type: str, cache_root: str) -> Path:
    """Where the requantized copy of ``gguf`` lives: keyed by the source's path, size and mtime."""
    st = os.stat(gguf)
    key = hashlib.sha256(f"{os.path.realpath(gguf)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = Path(gguf).name.removesuffix(".gguf")
    return Path(os.path.expanduser(cache_root)) / "gguf" / f"{stem}-{key}-{gguf_type}.gguf"


def requantize(gguf: str, gguf_type: str, out: Path) -> None:
    """Write ``gguf`` requantized to ``gguf_type`` at ``out``, atomically (ranks may race: same bytes)."""
    import llama_cpp

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = GGUF_TYPES[gguf_type]
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(gguf.encode(), str(tmp).encode(), params)
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise ValueError(f"vllm-usd: llama.cpp could not requantize {gguf!r} to {gguf_type} (code {rc}). "
                         "Set usd.drafter_gguf_type = \"file\" to run the GGUF as it is.")
    os.replace(tmp, out)


def drafter_gguf(gguf: str, gguf_type: str, cache_root: str) -> tuple[str, str]:
    """The GGUF the drafter runs, and its type's name (``"file"`` when it is the source as it is)."""
    target = resolve(gguf_type, file_type(gguf))
    if target is None:
        return gguf, "file"
    out = requantized_path(gguf, target, cache_root)
    if not out.is_file():
        start = time.perf_counter()
        try:
            requantize(gguf, target, out)
        except (OSError, ValueError) as exc:
            if gguf_type != "auto":
                raise
            # auto is a speed-up, not something the user asked for: never fail a start for it
            logger.warning("vllm-usd: could not requantize the drafter GGUF to %s (%s); running %s as it is. "
                           "Set usd.drafter_gguf_type = \"file\" to skip the attempt.", target, exc, gguf)
            return gguf, "file"
        logger.info("vllm-usd: requantized the drafter GGUF %s to %s in %.1fs: %s", gguf, target,
                    time.perf_counter() - start, out)
    return str(out), target
