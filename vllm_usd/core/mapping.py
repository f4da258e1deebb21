"""The vocabulary intersection of a target and a drafter tokenizer.

One sorted index tensor, ``draft_ids``, serves pruning the drafter's logits,
scattering q into target order and mapping ids, so the three can never
disagree (the bug of pruning in ``get_vocab()`` order and scattering in id
order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_usd.core.token_bytes import ROLES, TokenTable, build_token_table

# Below this share of the drafter's vocabulary, drafting is pointless.
DEFAULT_MIN_SHARE = 0.01


def canonical_id_per_bytes(table: TokenTable) -> dict[bytes, int]:
    """bytes -> the one id that stands for them, over ordinary (non-special) ids.

    When several ids decode to the same bytes, a real piece beats a
    byte-fallback piece (SentencePiece has both "a" and <0x61>; the model
    predicts the first, and the tokenizer only emits <0x61> for bytes it has
    no piece for); otherwise the lowest id wins. Deterministic, and
    independent of any dict order.
    """
    chosen: dict[bytes, int] = {}
    fallback = table.fallback_ids
    for tid, b in enumerate(table.token_bytes):  # ascending ids
        if not b:
            continue
        have = chosen.get(b)
        if have is None or (have in fallback and tid not in fallback):
            chosen[b] = tid
    return chosen


@dataclass(frozen=True)
class VocabMapping:
    """Shared tokens of a target and a drafter vocabulary.

    Attributes (CPU int64 tensors):
        draft_ids:        [n] drafter ids in the intersection, strictly ascending.
        target_ids:       [n] the target id matched to each ``draft_ids[i]``.
        draft_to_target:  [draft_vocab_size] target id, or -1 where not shared.
        target_to_draft:  [target_vocab_size] drafter id, or -1 where not shared.
    """

    draft_ids: torch.Tensor
    target_ids: torch.Tensor
    draft_to_target: torch.Tensor
    target_to_draft: torch.Tensor
    target_table: TokenTable
    draft_table: TokenTable
    byte_only_matches: int  # matches whose raw token strings differ

    @property
    def size(self) -> int:
        return int(self.draft_ids.numel())

    @property
    def target_vocab_size(self) -> int:
        return int(self.target_to_draft.numel())

    @property
    def draft_vocab_size(self) -> int:
        return int(self.draft_to_target.numel())

    @classmethod
    def build(
        cls,
        target_tokenizer,
        draft_tokenizer,
        target_vocab_size: int | None = None,
        draft_vocab_size: int | None = None,
        min_share: float = DEFAULT_MIN_SHARE,
    ) -> "VocabMapping":
        """Match tokens that stand for the same bytes, and specials by role.

        Vocab sizes are the models' logits widths; they default to the
        tokenizers' lengths and may be larger (padded vocabularies).
        Raises ValueError when the intersection is below ``min_share`` of the
        drafter vocabulary.
        """
        t_table = build_token_table(target_tokenizer, target_vocab_size)
        d_table = build_token_table(draft_tokenizer, draft_vocab_size)
        return cls.from_tables(t_table, d_table, min_share=min_share,
                               target_strings=_id_to_token(target_tokenizer),
                               draft_strings=_id_to_token(draft_tokenizer))

    @classmethod
    def from_tables(
        cls,
        t_table: TokenTable,
        d_table: TokenTable,
        min_share: float = DEFAULT_MIN_SHARE,
        target_strings=None,
        draft_strings=None,
    ) -> "VocabMapping":
        t_first = canonical_id_per_bytes(t_table)
        d_first = canonical_id_per_bytes(d_table)
        pairs: dict[int, int] = {}  # draft id -> target id
        for b, did in d_first.items():
            tid = t_first.get(b)
            if tid is not None:
                pairs[did] = tid
        used_t, used_d = set(pairs.values()), set(pairs)
        for role in ROLES:  # specials: only through a role both tokenizers give
            tid, did = t_table.roles.get(role), d_table.roles.get(role)
            if tid is None or did is None or tid in used_t or did in used_d:
                continue
            pairs[did] = tid
            used_t.add(tid)
            used_d.add(did)

        n = len(pairs)
        if n == 0 or n < min_share * d_table.size:
            raise ValueError(
                f"vllm-usd: the target tokenizer '{t_table.name}' and the drafter tokenizer "
                f"'{d_table.name}' share {n} tokens ({n / max(d_table.size, 1):.2%} of the "
                f"drafter's {d_table.size}); at least {min_share:.0%} is needed. Pick a "
                "drafter whose tokenizer covers the same scripts as the target's."
            )
        draft_ids = torch.tensor(sorted(pairs), dtype=torch.long)
        target_ids = torch.tensor([pairs[d] for d in draft_ids.tolist()], dtype=torch.long)
        d2t = torch.full((d_table.size,), -1, dtype=torch.long)
        t2d = torch.full((t_table.size,), -1, dtype=torch.long)
        d2t[draft_ids] = target_ids
        t2d[target_ids] = draft_ids

        byte_only = 0
        if target_strings is not None and draft_strings is not None:
            for d, t in zip(draft_ids.tolist(), target_ids.tolist()):
                if d not in d_table.special_ids and target_strings(t) != draft_strings(d):
                    byte_only += 1
        return cls(draft_ids, target_ids, d2t, t2d, t_table, d_table, byte_only)

    def restrict(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[..., draft_vocab_size] -> [..., n], columns in ``draft_ids`` order."""
        return draft_logits.index_select(-1, self.draft_ids)

    def scatter_to_target(self, p: torch.Tensor) -> torch.Tensor:
        """[..., n] in ``draft_ids`` order -> [..., target_vocab_size], zero elsewhere."""
        out = p.new_zeros(*p.shape[:-1], self.target_vocab_size)
        out[..., self.target_ids] = p
        return out


def _id_to_token(tokenizer):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend.id_to_token if backend is not None else (lambda i: None)
