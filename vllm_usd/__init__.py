"""vllm-usd: universal speculative decoding for vLLM.

``vllm_usd.UniversalProposer`` is the stable class path for vLLM's
``speculative_config={"method": "custom_class", "model": ...}``.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["UniversalProposer", "speculative_args", "__version__"]


def __getattr__(name: str):
    # Lazy: importing vllm_usd must not import vLLM (the core works without it).
    if name == "UniversalProposer":
        from vllm_usd.vllm_adapter.proposer import UniversalProposer

        return UniversalProposer
    if name == "speculative_args":
        from vllm_usd.config import speculative_args

        return speculative_args
    raise AttributeError(f"module 'vllm_usd' has no attribute {name!r}")
