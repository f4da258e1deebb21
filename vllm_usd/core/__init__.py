"""The vLLM-free core: token bytes, the vocabulary mapping, context translation,
draft sampling with its exact q, and stateless seeding.

Imports torch, tokenizers and transformers, never vLLM.
"""

from vllm_usd.core.mapping import VocabMapping
from vllm_usd.core.pair import DraftPair
from vllm_usd.core.sampling import DraftSamplingParams, draft_distribution, sample_drafts
from vllm_usd.core.token_bytes import TokenTable, build_token_table
from vllm_usd.core.translate import ContextTranslator, FragmentEncoder

__all__ = [
    "ContextTranslator",
    "DraftPair",
    "DraftSamplingParams",
    "FragmentEncoder",
    "TokenTable",
    "VocabMapping",
    "build_token_table",
    "draft_distribution",
    "sample_drafts",
]
