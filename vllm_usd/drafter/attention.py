"""Attention over the drafter's paged KV cache, as a transformers attention function.

The runtime's cache view writes each new token's keys and values into its
block, then hands the layer the request's blocks gathered in position order
(``[R, Hkv, L, D]``). ``paged_attention`` runs torch's
``scaled_dot_product_attention`` on them with a per-row boolean mask: causal,
and for sliding-window layers also windowed. SDPA picks a fused kernel where the
device has one and never keeps a float copy of the scores per layer; GQA is
its ``enable_gqa``. Only a model with attention-logit soft-capping (Gemma-2),
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
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window -> its mask

    @classmethod
    def build(cls, qpos: torch.Tensor, key_len: int) -> "PagedBatch":
        kpos = torch.arange(key_len, device=qpos.device)
        causal = kpos.view(1, 1, 1, -1) <= qpos.view(qpos.shape[0], 1, qpos.shape[1], 1)
        return cls(qpos=qpos, kpos=kpos, causal=causal)

    def mask(self, window: int | None) -> torch.Tensor:
        """[R, 1, T, L]: the causal mask, and keys within ``window`` of the query where one is set."""
        if not window:
            return self.causal
        mask = self.windowed.get(window)
        if mask is None:
            recent = self.kpos.view(1, 1, 1, -1) > (self.qpos - window).unsqueeze(1).unsqueeze(-1)
            mask = self.causal & recent
            self.windowed[window] = mask
        return mask


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    sliding_window=None, softcap=None, **kwargs):
    """query [R, H, T, D]; key/value [R, Hkv, L, D] gathered from the pool. Returns ([R, T, H, D], None)."""
    batch: PagedBatch | None = kwargs.get(BATCH_KWARG)
    mask = batch.mask(sliding_window) if batch is not None else attention_mask
    if softcap:
        out = _softcapped(query, key, value, mask, scaling, softcap)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                             enable_gqa=key.shape[1] != query.shape[1])
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
