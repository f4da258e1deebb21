"""Drafter runtimes: the drafter model plus its own per-request KV cache. No vLLM import."""

from vllm_usd.drafter.base import DrafterRuntime
from vllm_usd.drafter.hf_runtime import HFDrafterRuntime
from vllm_usd.drafter.loading import DrafterLoadError, load_drafter

__all__ = ["DrafterLoadError", "DrafterRuntime", "HFDrafterRuntime", "load_drafter"]
