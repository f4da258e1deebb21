"""Drafter runtimes: the drafter model plus its own per-request KV cache."""

from vllm_usd.drafter.base import DrafterRuntime
from vllm_usd.drafter.hf_runtime import HFDrafterRuntime, load_drafter

__all__ = ["DrafterRuntime", "HFDrafterRuntime", "load_drafter"]
