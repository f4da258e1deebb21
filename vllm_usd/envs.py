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
    VLLM_USD_CACHE=DIR           where the demo pair (and the tests' tiny fixtures) are cached;
                                 default ~/.cache/vllm-usd
"""

from __future__ import annotations

import os

DISABLE = "VLLM_USD_DISABLE"
FIX_CPU_SAMPLER = "VLLM_USD_FIX_CPU_SAMPLER"
SKIP_FINGERPRINTS = "VLLM_USD_SKIP_FINGERPRINTS"
CACHE = "VLLM_USD_CACHE"

ALL = (DISABLE, FIX_CPU_SAMPLER, SKIP_FINGERPRINTS, CACHE)


def _flag(name: str) -> bool:
    return os.environ.get(name, "") == "1"


def disabled() -> bool:
    return _flag(DISABLE)


def fix_cpu_sampler() -> bool:
    return _flag(FIX_CPU_SAMPLER)


def skip_fingerprints() -> bool:
    return _flag(SKIP_FINGERPRINTS)


def set_fix_cpu_sampler() -> None:
    """Ask every engine process started from now on to install the CPU sampler fix."""
    os.environ[FIX_CPU_SAMPLER] = "1"


def cache_dir() -> str:
    return os.environ.get(CACHE) or "~/.cache/vllm-usd"
