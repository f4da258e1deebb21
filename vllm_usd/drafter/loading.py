"""Load a drafter (model and tokenizer) with one-line errors that name the fix."""

from __future__ import annotations

import os

import torch

from vllm_usd.drafter.attention import ATTN_NAME, register_attention


class DrafterLoadError(ValueError):
    pass


def load_drafter_config_and_tokenizer(path: str, *, revision: str | None = None, trust_remote_code: bool = False):
    """The drafter's (config, tokenizer), without its weights, with the same one-line errors as ``load_drafter``."""
    from transformers import AutoConfig, AutoTokenizer

    where = f"additional_config.usd.drafter = {path!r}"
    if os.path.sep in path and not os.path.exists(path):
        raise DrafterLoadError(f"vllm-usd: drafter folder not found ({where}). Point it at a local model folder or a hub id.")
    try:
        config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise DrafterLoadError(
                f"vllm-usd: the drafter needs custom code ({where}); vllm-usd never enables it by itself. "
                "Set usd.trust_remote_code = true only if you trust that repository."
            ) from exc
        raise DrafterLoadError(f"vllm-usd: cannot read the drafter's config ({where}): {exc}") from exc
    except OSError as exc:
        raise DrafterLoadError(f"vllm-usd: cannot load the drafter ({where}): {str(exc).splitlines()[0]}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001
        raise DrafterLoadError(
            f"vllm-usd: the drafter has no readable tokenizer ({where}): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}. "
            "Save the tokenizer next to the drafter's weights."
        ) from exc
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise DrafterLoadError(f"vllm-usd: the drafter's tokenizer has no tokenizer.json (fast tokenizer) ({where}).")
    return config, tokenizer


def load_drafter(path: str, *, dtype: str = "float32", revision: str | None = None,
                 trust_remote_code: bool = False):
    """Load (model, tokenizer) with clear, single-line errors."""
    from transformers import AutoModelForCausalLM

    where = f"additional_config.usd.drafter = {path!r}"
    config, tokenizer = load_drafter_config_and_tokenizer(path, revision=revision, trust_remote_code=trust_remote_code)
    register_attention()
    torch_dtype = getattr(config, "torch_dtype", None) if dtype == "auto" else getattr(torch, dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, revision=revision, trust_remote_code=trust_remote_code, dtype=torch_dtype,
            attn_implementation=ATTN_NAME,
        )
    except ValueError as exc:
        raise DrafterLoadError(
            f"vllm-usd: the drafter is not a causal language model ({where}): {str(exc).splitlines()[0]}"
        ) from exc
    except OSError as exc:
        raise DrafterLoadError(f"vllm-usd: cannot load the drafter's weights ({where}): {str(exc).splitlines()[0]}") from exc
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer
