"""The vLLM-free core: vocabulary mapping, context translation and draft q.

Imports torch, tokenizers and transformers, never vLLM.
"""

from vllm_usd.vocab.mapping import VocabMapping
from vllm_usd.vocab.sampling import DraftProbsBuffer, DraftSamplingParams, draft_distribution, sample_drafts
from vllm_usd.vocab.token_bytes import TokenTable, build_token_table
from vllm_usd.vocab.translate import ContextTranslator, FragmentEncoder

__all__ = [
    "ContextTranslator",
    "DraftProbsBuffer",
    "DraftSamplingParams",
    "FragmentEncoder",
    "TokenTable",
    "VocabMapping",
    "build_token_table",
    "draft_distribution",
    "sample_drafts",
]
