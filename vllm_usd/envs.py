"""Every ``VLLM_USD_*`` environment variable vllm-usd reads, in one place.

Read them through the functions here, never with ``os.environ`` elsewhere in
the package, so that this file is the whole list:

    VLLM_USD_DISABLE=1           register() does nothing (vLLM stays untouched)
    VLLM_USD_FIX_CPU_SAMPLER=1   register() installs the CPU rejection-sampler fix in every
                                 engine, vLLM's own drafters included (vllm-usd's proposer
                                 installs it for itself either way)
    VLLM_USD_SKIP_FINGERPRINTS=1 experts only: apply the patches even where a vLLM function they
                                 rely on differs from every release vllm-usd was checked against
                                 (logged as a warning each time; see `vllm-usd doctor`)
    VLLM_USD_CACHE=DIR           where the demo pair (and the tests' tiny fixtures), requantized
                                 GGUFs and the native probe's verdicts are cached; default ~/.cache/vllm-usd
    VLLM_USD_METRICS_DIR=DIR     where workers leave their drafting-failure counts for the Prometheus
                                 collector in the user's process; set there before the engine starts
                                 (vllm_adapter/failures.py), a fresh temporary folder by default
    VLLM_USD_CPU_GRAPHS=1        on the CPU, the transformers drafter's decode steps go through the
                                 graph path too: captured at start-up by drafter/graph_double.py, the
                                 strict stand-in for CUDA graphs, and replayed (tests; slower than eager)
"""

from __future__ import annotations

import os

DISABLE = "VLLM_USD_DISABLE"
FIX_CPU_SAMPLER = "VLLM_USD_FIX_CPU_SAMPLER"
SKIP_FINGERPRINTS = "VLLM_USD_SKIP_FINGERPRINTS"
CACHE = "VLLM_USD_CACHE"
METRICS_DIR = "VLLM_USD_METRICS_DIR"
CPU_GRAPHS = "VLLM_USD_CPU_GRAPHS"

ALL = (DISABLE, FIX_CPU_SAMPLER, SKIP_FINGERPRINTS, CACHE, METRICS_DIR, CPU_GRAPHS)


def _flag(name: str) -> bool:
    return os.environ.get(name, "") == "1"


def disabled() -> bool:
    return _flag(DISABLE)


def fix_cpu_sampler() -> bool:
    return _flag(FIX_CPU_SAMPLER)


def skip_fingerprints() -> bool:
    return _flag(SKIP_FINGERPRINTS)


def cpu_graphs() -> bool:
    return _flag(CPU_GRAPHS)


def set_fix_cpu_sampler() -> None:
    """Ask every engine process started from now on to install the CPU sampler fix."""
    os.environ[FIX_CPU_SAMPLER] = "1"


def cache_dir() -> str:
    return os.environ.get(CACHE) or "~/.cache/vllm-usd"


def metrics_dir() -> str | None:
    return os.environ.get(METRICS_DIR) or None


def set_metrics_dir(path: str) -> None:
    """Every engine process started from now on leaves its failure counts in ``path``."""
    os.environ[METRICS_DIR] = path
