"""DraftPair: everything a target/drafter pair needs to translate context, built once.

The proposer, the acceptance estimate and the benchmarks' diagnostics all
build the mapping, the drafter's fragment encoder and the drafter's BOS
through here, so they cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_usd.core.mapping import DEFAULT_MIN_SHARE, VocabMapping
from vllm_usd.core.translate import ContextTranslator, FragmentEncoder


def bos_it_adds(tokenizer) -> int | None:
    """The tokenizer's BOS id if encoding plain text starts with it, else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a").input_ids
    return bos if ids and ids[0] == bos else None


@dataclass(frozen=True)
class DraftPair:
    """The vocabulary mapping of a pair, the drafter's encoder, and the drafter's BOS."""

    mapping: VocabMapping
    encoder: FragmentEncoder
    draft_bos: int | None

    @classmethod
    def build(cls, target_tokenizer, draft_tokenizer, *, target_vocab_size: int | None = None,
              draft_vocab_size: int | None = None, min_share: float = DEFAULT_MIN_SHARE) -> "DraftPair":
        """Vocab sizes are the models' logits widths (they default to the tokenizers' lengths)."""
        mapping = VocabMapping.build(target_tokenizer, draft_tokenizer, target_vocab_size=target_vocab_size,
                                     draft_vocab_size=draft_vocab_size, min_share=min_share)
        return cls(mapping, FragmentEncoder(draft_tokenizer, mapping.draft_table), bos_it_adds(draft_tokenizer))

    @classmethod
    def for_models(cls, target_model, target_tokenizer, drafter_model, drafter_tokenizer,
                   min_share: float = 0.0) -> "DraftPair":
        """For two transformers models: the mapping spans their logits widths."""
        return cls.build(target_tokenizer, drafter_tokenizer,
                         target_vocab_size=int(target_model.get_output_embeddings().weight.shape[0]),
                         draft_vocab_size=int(drafter_model.get_output_embeddings().weight.shape[0]),
                         min_share=min_share)

    def translator(self, by_text: bool = False) -> ContextTranslator:
        """A fresh per-request context translator (``by_text``: all text re-encoded, see translate.py)."""
        return ContextTranslator(self.mapping, self.encoder, self.draft_bos, by_text=by_text)
