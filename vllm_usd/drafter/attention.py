"""Attention over the drafter's private slot KV cache, as a transformers attention function.

The GQA group is folded into the query length, and each row gets its own
causal (and sliding-window) mask. ``slot_attention`` reads the masks of the
forward in progress from the forward's ``BATCH_KWARG`` keyword, which transformers
hands down to its attention functions: no global state, so the forward traces
whole (``torch.compile(fullgraph=True)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ATTN_NAME = "vllm_usd_slots"
#: the model-forward keyword that carries the ``SlotBatch`` down to ``slot_attention`` (transformers
#: passes a forward's extra keywords to its attention functions); a traced forward needs it
BATCH_KWARG = "vllm_usd_slot_batch"


@dataclass
class SlotBatch:
    """Masks for one forward; read by the attention function."""

    full: torch.Tensor  # [R, 1, T, Lk] additive
    qpos: torch.Tensor  # [R, T] absolute query positions
    kpos: torch.Tensor  # [Lk]
    sliding: dict[int, torch.Tensor]



def _mask_for(batch: SlotBatch, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    if not window:
        return batch.full
    mask = batch.sliding.get(window)
    if mask is None:
        too_old = batch.kpos.view(1, 1, 1, -1) <= (batch.qpos - window).unsqueeze(1).unsqueeze(-1)
        mask = batch.full.masked_fill(too_old, torch.finfo(dtype).min)
        batch.sliding[window] = mask
    return mask


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                   sliding_window=None, softcap=None, **kwargs):
    """query [R, H, T, D]; key/value [R, Hkv, Lk, D] (views into the slot cache)."""
    batch = kwargs.get(BATCH_KWARG)
    r, h, t, d = query.shape
    hkv, lk = key.shape[1], key.shape[2]
    g = h // hkv
    if scaling is None:
        scaling = d ** -0.5
    q = query.reshape(r * hkv, g * t, d)
    k = key.reshape(r * hkv, lk, d)
    v = value.reshape(r * hkv, lk, value.shape[-1])
    scores = torch.bmm(q, k.transpose(1, 2)).mul_(scaling)  # [R*Hkv, G*T, Lk]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    mask = _mask_for(batch, sliding_window, scores.dtype) if batch is not None else attention_mask
    scores = scores.view(r, hkv, g, t, lk) + mask.unsqueeze(2)  # mask [R,1,1,T,Lk]
    probs = scores.float().softmax(dim=-1).to(v.dtype).view(r * hkv, g * t, lk)
    out = torch.bmm(probs, v)  # [R*Hkv, G*T, Dv]
    out = out.view(r, hkv, g, t, -1).reshape(r, h, t, -1).transpose(1, 2).contiguous()
    return out, None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, slot_attention)

