"""The llama.cpp drafter's weight type: its GGUF as shipped, or requantized once to a faster type.

llama.cpp's CPU matmul speed depends on the weight type and on the host, not only on the
bytes read: SmolLM2-135M's Q4_1 GGUF ran slower than its Q8_0 copy on one of this project's
machines (AVX2) and faster on another (AVX-512, with repacked kernels). So ``auto`` measures.
A 4-bit GGUF is never rounded to 4 bits a second time: that drafts noticeably differently
(docs/performance.md, "Drafter speed"). ``usd.drafter_gguf_type`` picks the type the drafter runs in:

- ``"file"``: the GGUF as it is;
- a llama.cpp type name (``GGUF_TYPES``): the GGUF requantized to that type, once, into
  ``$VLLM_USD_CACHE/gguf/`` (about a second for a 135M model), and reused after that;
- ``"auto"`` (default): whichever of ``candidates`` steps fastest at batch 1 on this host, as the
  native probe times them (``select.probe_verdict``): a 4-bit file as it is or as Q8_0; a wider
  one as Q8_0 or Q4_0.

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
# kernels come closer to the weight-read limit (docs/performance.md, "Drafter speed").
GGUF_TYPES: dict[str, int] = {"q4_0": 2, "iq4_nl": 25, "q4_1": 3, "q4_k_m": 15, "q8_0": 7, "f16": 1, "bf16": 32}
CHOICES = ("auto", "file", *GGUF_TYPES)

# 16- and 32-bit files read too many bytes to be worth timing: auto times their 8- and 4-bit copies only
WIDE_FILE_TYPES = frozenset({0, 1, 32})  # f32, f16, bf16


_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def file_type(gguf: str) -> int:
    """The GGUF's ``general.file_type`` (llama_ftype), read in Python (no native code in a worker)."""
    return int(read_gguf(gguf)[0].get("general.file_type", -1))


def read_gguf(gguf: str) -> tuple[dict[str, object], list[tuple[int, int]]]:
    """The GGUF's scalar metadata and, per tensor, (first byte, bytes) of its data; refused in one line
    when the file is not a whole GGUF (a bad header, or tensors past the end of a truncated file)."""
    fix = ("Re-download or re-convert it, point usd.drafter_gguf at a whole GGUF, or set "
           "usd.drafter_runtime = \"transformers\".")
    try:
        meta, spans = _parse_gguf(gguf)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a bad file
        raise ValueError(f"vllm-usd: the drafter GGUF {gguf!r} cannot be read ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else 'bad header'}). {fix}") from None
    size = os.path.getsize(gguf)
    end = max((first + n for first, n in spans), default=0)
    if not spans or end > size:
        raise ValueError(f"vllm-usd: the drafter GGUF {gguf!r} is truncated: its tensors need {end} bytes but the "
                         f"file has {size}. {fix}")
    return meta, spans


def _parse_gguf(gguf: str) -> tuple[dict[str, object], list[tuple[int, int]]]:
    """GGUF v2/v3 (little-endian): header, key-value pairs (arrays skipped), tensor infos."""
    import mmap
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(gguf, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0

        def take(fmt: str):
            nonlocal pos
            values = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize("<" + fmt)
            return values[0] if len(values) == 1 else values

        def string() -> str:
            nonlocal pos
            n = take("Q")
            if pos + n > len(buf):
                raise ValueError("a string runs past the end of the file")
            pos += n
            return bytes(buf[pos - n:pos]).decode("utf-8", errors="replace")

        def value(kind: int):
            nonlocal pos
            if kind == _STRING:
                return string()
            if kind == _ARRAY:
                item, count = take("I"), take("Q")
                if item in (_STRING, _ARRAY):
                    for _ in range(count):
                        value(item)
                else:
                    pos += struct.calcsize("<" + _SCALAR[item]) * count
                return None
            return take(_SCALAR[kind])

        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        pos = 4
        version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}")
        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(take("I"))
        infos = []
        for _ in range(n_tensors):
            string()
            dims = [take("Q") for _ in range(take("I"))]
            kind, offset = take("I"), take("Q")
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            n = 1
            for d in dims:
                n *= d
            infos.append((offset, n * size // block))
        align = int(meta.get("general.alignment") or 32)
        start = pos + (-pos % align)
        return meta, [(start + offset, n) for offset, n in infos]


def auto_types(current: int) -> list[str | None]:
    """What ``auto`` times, for a file of type ``current``: None for the file as it is, else a type name."""
    if current in WIDE_FILE_TYPES:
        return ["q8_0", "q4_0"]
    if current == GGUF_TYPES["q8_0"]:
        return [None, "q4_0"]
    return [None, "q8_0"]  # 4-bit files never as Q4_0 (a second 4-bit rounding); 5- and 6-bit ones neither


def resolve(gguf_type: str, current: int) -> str | None:
    """The type to requantize to, or None to run the file as it is (not for ``auto``: see ``candidates``)."""
    if gguf_type == "file":
        return None
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"vllm-usd: usd.drafter_gguf_type = {gguf_type!r} is not one of {', '.join(CHOICES)}.")
    return None if GGUF_TYPES[gguf_type] == current else gguf_type


def requantized_path(gguf: str, gguf_type: str, cache_root: str) -> Path:
    """Where the requantized copy of ``gguf`` lives: keyed by the source's path, size and mtime."""
    st = os.stat(gguf)
    key = hashlib.sha256(f"{os.path.realpath(gguf)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = Path(gguf).name.removesuffix(".gguf")
    return Path(os.path.expanduser(cache_root)) / "gguf" / f"{stem}-{key}-{gguf_type}.gguf"


def requantize_here(gguf: str, gguf_type: str, out: Path) -> None:
    """Write ``gguf`` requantized to ``gguf_type`` at ``out``, atomically (ranks may race: same bytes).
    Native code: ``requantize`` runs it in the probe's child process."""
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


def requantize(gguf: str, gguf_type: str, out: Path) -> None:
    """``requantize_here`` in a child process: a crash or a hang there is a ValueError here."""
    from vllm_usd.drafter.native_probe import run_child

    out.parent.mkdir(parents=True, exist_ok=True)
    result = run_child({"call": "requantize", "gguf": gguf, "gguf_type": gguf_type, "out": str(out)})
    if not result.ok or not out.is_file():
        raise ValueError(f"vllm-usd: llama.cpp could not requantize {gguf!r} to {gguf_type}: {result.outcome}. "
                         "Set usd.drafter_gguf_type = \"file\" to run the GGUF as it is.")


def candidates(gguf: str, gguf_type: str, cache_root: str) -> list[tuple[str, str]]:
    """(the GGUF to run, its type's name, ``"file"`` for the source as it is) for each type to try: the
    one ``gguf_type`` names, or every type ``auto`` times (those that fail to requantize left out)."""
    if gguf_type != "auto":
        return [drafter_gguf(gguf, gguf_type, cache_root)]
    out = []
    for target in auto_types(file_type(gguf)):
        try:
            out.append(drafter_gguf(gguf, target or "file", cache_root))
        except (OSError, ValueError) as exc:  # auto is a speed-up, not something the user asked for
            logger.warning("vllm-usd: could not requantize the drafter GGUF to %s (%s); not timing it", target, exc)
    return out or [(gguf, "file")]


def drafter_gguf(gguf: str, gguf_type: str, cache_root: str) -> tuple[str, str]:
    """The GGUF the drafter runs for a named ``gguf_type``, and its type's name (``"file"`` when it is the
    source as it is); requantized into the cache the first time."""
    target = resolve(gguf_type, file_type(gguf))
    if target is None:
        return gguf, "file"
    out = requantized_path(gguf, target, cache_root)
    if not out.is_file():
        start = time.perf_counter()
        requantize(gguf, target, out)
        logger.info("vllm-usd: requantized the drafter GGUF %s to %s in %.1fs: %s", gguf, target,
                    time.perf_counter() - start, out)
    return str(out), target
