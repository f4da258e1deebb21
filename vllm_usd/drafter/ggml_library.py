"""The ggml libraries inside llama-cpp-python: which CPU kernels it ships, and loading one set.

A portable build (``scripts/setup-env.sh``: ``GGML_BACKEND_DL`` with ``GGML_CPU_ALL_VARIANTS``)
ships one CPU backend per x86-64 feature level, ``libggml-cpu-<variant>.so``, and ggml scores
each against the CPU it runs on (0: cannot run here). A native build links a single CPU backend
compiled for its build host. Which variant serves, and with which buffer types, is the native
probe's verdict (``native_probe.py``).

Scoring ``dlopen``s every variant and listing buffer types runs the chosen one's code, so both
happen only in the probe's child process. A worker imports ``llama_cpp`` and loads the one
variant the verdict names, after the probe has run it on this host.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
from pathlib import Path

GGML_BACKEND_DEVICE_TYPE_CPU = 0
_loaded_variant: list[str | None] = []  # the CPU backend this process loaded (at most one)


def library_dir() -> Path | None:
    """``llama_cpp/lib``, found without importing llama_cpp (which loads native code)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def cpu_variants(libdir: Path) -> list[str]:
    """The CPU backend variants of a portable build (file names, sorted); [] for a native build."""
    return sorted(p.name for p in libdir.glob("libggml-cpu-*.so"))


def variant_name(file_name: str | None) -> str:
    """``libggml-cpu-icelake.so`` -> ``icelake``; None (a native build's one backend) -> ``native``."""
    if file_name is None:
        return "native"
    return file_name.removeprefix("libggml-cpu-").removesuffix(".so")


# -- which variants to build: ggml's x86-64 list and score, read from /proc/cpuinfo --------------
# ggml's feature -> the /proc/cpuinfo flags it checks (ggml-cpu/arch/x86/cpu-feats.cpp), and the
# score each adds (the same bits, so the order matches the probe's, which asks ggml itself).
_X86_FEATURES = {
    "FMA": (("fma",), 1), "F16C": (("f16c",), 1 << 1), "SSE42": (("sse4_2",), 1 << 2),
    "BMI2": (("bmi2",), 1 << 3), "AVX": (("avx",), 1 << 4), "AVX2": (("avx2",), 1 << 5),
    "AVX_VNNI": (("avx_vnni",), 1 << 6),
    "AVX512": (("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"), 1 << 7),
    "AVX512_VBMI": (("avx512vbmi",), 1 << 8), "AVX512_BF16": (("avx512_bf16",), 1 << 9),
    "AVX512_VNNI": (("avx512_vnni",), 1 << 10), "AMX_TILE": (("amx_tile",), 0), "AMX_INT8": (("amx_int8",), 1 << 11),
}
_BASE = ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2")
# GGML_CPU_ALL_VARIANTS on x86-64 Linux (ggml/src/CMakeLists.txt of llama-cpp-python 0.3.36)
X86_VARIANTS: dict[str, tuple[str, ...]] = {
    "x64": (), "sse42": ("SSE42",), "sandybridge": ("SSE42", "AVX"), "ivybridge": ("SSE42", "AVX", "F16C"),
    "piledriver": ("SSE42", "AVX", "F16C", "FMA"), "haswell": _BASE, "skylakex": _BASE + ("AVX512",),
    "cannonlake": _BASE + ("AVX512", "AVX512_VBMI"), "cascadelake": _BASE + ("AVX512", "AVX512_VNNI"),
    "icelake": _BASE + ("AVX512", "AVX512_VBMI", "AVX512_VNNI"),
    "cooperlake": _BASE + ("AVX512", "AVX512_VNNI", "AVX512_BF16"),
    "zen4": _BASE + ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"),
    "alderlake": _BASE + ("AVX_VNNI",),
    "sapphirerapids": _BASE + ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8"),
}


def x86_score(variant: str, flags: set[str]) -> int:
    """ggml's score of an x86-64 ``variant`` on a CPU with these /proc/cpuinfo ``flags`` (0: cannot run)."""
    score = 1
    for feature in X86_VARIANTS[variant]:
        needs, bit = _X86_FEATURES[feature]
        if not flags.issuperset(needs):
            return 0
        score += bit
    return score


def variants_to_build(flags: set[str] | None = None, machine: str | None = None) -> list[str]:
    """The CPU variants a portable build for this host needs: the two ggml scores best here.

    The native probe only ever tries those two (``native_probe.candidates``), so the other twelve
    are build time for nothing. [] where the host is not x86-64: build every variant.
    """
    import platform

    if (machine or platform.machine()) not in ("x86_64", "AMD64"):
        return []
    if flags is None:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    scores = {name: x86_score(name, flags) for name in X86_VARIANTS}
    return sorted((n for n, s in scores.items() if s > 0), key=lambda n: (-scores[n], n))[:2]


def build_id(libdir: Path) -> str:
    """What identifies the build: every shared library's name, size and time (a rebuild changes them)."""
    h = hashlib.sha256()
    for p in sorted(libdir.glob("*.so*")):
        st = p.stat()
        h.update(f"{p.name}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _ggml() -> ctypes.CDLL:
    """The libggml that llama_cpp itself loaded (wheels hold copies, not links: ``libggml.so`` and
    ``libggml.so.0`` are two files, and opening the wrong one by path would load a second registry)."""
    import llama_cpp  # noqa: F401 - loads libllama, and through it libggml and libggml-base

    soname = min((p.name for p in library_dir().glob("libggml.so.*")), key=len, default="libggml.so")
    return ctypes.CDLL(soname)  # a bare name: the object already loaded under that soname


# -- child process only -------------------------------------------------------------------------
def variant_scores(libdir: Path) -> dict[str, int]:
    """ggml's score of each variant on this CPU (higher: more of its features; 0: cannot run)."""
    import llama_cpp  # noqa: F401 - loads libggml-base, which every variant links to

    scores = {}
    for name in cpu_variants(libdir):
        lib = ctypes.CDLL(str(libdir / name))
        lib.ggml_backend_score.restype = ctypes.c_int
        scores[name] = int(lib.ggml_backend_score())
    return scores


def load_cpu_backend(variant: str | None) -> None:
    """Register the CPU backend ``variant`` (a file in ``library_dir()``), once per process.

    A native build's linked backend registers itself (``variant`` None). Call before
    ``llama_backend_init``, which would otherwise look for variants next to the Python binary.
    """
    if _loaded_variant:
        if _loaded_variant[0] != variant:
            raise RuntimeError(f"vllm-usd: this process already runs llama.cpp's {variant_name(_loaded_variant[0])} "
                               f"CPU kernels; it cannot switch to {variant_name(variant)}")
        return
    if variant is not None:
        ggml = _ggml()
        ggml.ggml_backend_load.restype = ctypes.c_void_p
        ggml.ggml_backend_load.argtypes = [ctypes.c_char_p]
        if not ggml.ggml_backend_load(str(library_dir() / variant).encode()):
            raise RuntimeError(f"vllm-usd: llama.cpp could not load its CPU backend {variant}")
    _loaded_variant.append(variant)


def extra_buffer_types() -> list[str]:
    """Names of the extra buffer types (repacked or AMX weights) the loaded CPU backend offers."""
    ggml = _ggml()
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    ggml.ggml_backend_buft_name.restype = ctypes.c_char_p
    ggml.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    dev = ggml.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        return []
    fn = ggml.ggml_backend_reg_get_proc_address(ggml.ggml_backend_dev_backend_reg(dev),
                                                b"ggml_backend_dev_get_extra_bufts")
    if not fn:
        return []
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)(dev)
    names = []
    i = 0
    while bufts and bufts[i]:
        names.append(ggml.ggml_backend_buft_name(bufts[i]).decode())
        i += 1
    return names
