"""Attention over the drafter's paged KV cache, as a transformers attention function.

The runtime's cache view writes each new token's keys and values into its
block, then hands the layer the request's blocks gathered in position order
(``[R, Hkv, L, D]``). ``paged_attention`` runs torch's
``scaled_dot_product_attention`` on them with a per-row boolean mask: causal,
and for sliding-window layers also windowed. SDPA picks a fused kernel where the
device has one and never keeps a float copy of the scores per layer; the GQA
group is folded into the query length. Only a model with attention-logit soft-capping (Gemma-2),
which SDPA cannot express, takes the explicit path.

The masks of the forward in progress travel in the forward's ``BATCH_KWARG``
keyword, which transformers hands down to its attention functions: no global
state, so the forward traces whole (``torch.compile(fullgraph=True)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTN_NAME = "vllm_usd_paged"
#: the model-forward keyword that carries the ``PagedBatch`` down to ``paged_attention``
BATCH_KWARG = "vllm_usd_paged_batch"
#: the attention kernel, for the start-up log
KERNEL = "torch scaled_dot_product_attention over gathered KV blocks"


@dataclass
class PagedBatch:
    """Where one forward reads and writes: the masks its attention layers apply."""

    qpos: torch.Tensor  # [R, T] absolute position of each new token
    kpos: torch.Tensor  # [L] position of each gathered key (blocks in order: key i is position i)
    causal: torch.Tensor  # [R, 1, T, L] bool, True where a query may attend
    windowed: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (window, group) -> mask

    @classmethod
    def build(cls, qpos: torch.Tensor, key_len: int) -> "PagedBatch":
        kpos = torch.arange(key_len, device=qpos.device)
        causal = kpos.view(1, 1, 1, -1) <= qpos.view(qpos.shape[0], 1, qpos.shape[1], 1)
        return cls(qpos=qpos, kpos=kpos, causal=causal)

    def mask(self, window: int | None, group: int = 1) -> torch.Tensor:
        """[R, 1, group * T, L]: the causal mask, and keys within ``window`` of the query where one is set;
        repeated ``group`` times along the queries (for queries with the GQA group folded in)."""
        key = (window or 0, group)
        mask = self.windowed.get(key)
        if mask is None:
            mask = self.causal
            if window:
                recent = self.kpos.view(1, 1, 1, -1) > (self.qpos - window).unsqueeze(1).unsqueeze(-1)
                mask = mask & recent
            if group > 1:
                rows, _, t, keys = mask.shape
                mask = mask.unsqueeze(2).expand(rows, 1, group, t, keys).reshape(rows, 1, group * t, keys)
            self.windowed[key] = mask
        return mask


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    sliding_window=None, softcap=None, **kwargs):
    """query [R, H, T, D]; key/value [R, Hkv, L, D] gathered from the pool. Returns ([R, T, H, D], None).

    The GQA group is folded into the query length (``[R, Hkv, G*T, D]``) rather than handed to SDPA
    as ``enable_gqa``: torch's CPU kernel splits its work by query length, and a one-token decode
    step has too little of it per head (measured: 5x slower per layer at batch 32 in bfloat16).
    """
    batch: PagedBatch | None = kwargs.get(BATCH_KWARG)
    rows, heads, t, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    if softcap:
        out = _softcapped(query, key, value, batch.mask(sliding_window) if batch is not None else attention_mask,
                          scaling, softcap)
        return out.transpose(1, 2).contiguous(), None
    mask = batch.mask(sliding_window, group) if batch is not None else attention_mask
    folded = query.reshape(rows, kv_heads, group * t, dim)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)  # [R, Hkv, G*T, Dv]
    out = out.view(rows, kv_heads, group, t, -1).reshape(rows, heads, t, -1)
    return out.transpose(1, 2).contiguous(), None


def _softcapped(query, key, value, mask, scaling, softcap):
    """Attention with tanh soft-capping of the logits, which SDPA has no option for."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * (scaling or query.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.float().softmax(dim=-1).to(value.dtype), value)


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
