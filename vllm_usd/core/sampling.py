"""Draft one token per row from the intersection, and say exactly what q was.

The drafter's logits are restricted to the intersection (renormalised there by
the softmax), then each row's temperature, top-k and top-p are applied. The
resulting q is the distribution the draft is drawn from, and is what the
target's rejection sampler must see. Greedy rows take the argmax; their q is
one-hot at the draft, which vLLM's rejection sampler treats exactly like "no
q" (accept iff u <= p(d); residual is p with d removed), so it is lossless
whether or not a q tensor is handed over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_usd.core.device import to_device


@dataclass
class DraftSamplingParams:
    """Per-row settings for one batch of drafts.

    temperature: [B] float, ignored for greedy rows.
    top_k:       [B] int64, <= 0 or >= n means off.
    top_p:       [B] float, >= 1 means off.
    greedy:      [B] bool.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    greedy: torch.Tensor
    any_top_k: bool = False
    any_top_p: bool = False
    all_greedy: bool = False
    all_random: bool = False
    greedy_rows: tuple[int, ...] = ()  # host copy of the greedy rows: no device sync to find them

    @classmethod
    def from_lists(
        cls,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        greedy: list[bool],
        device: torch.device | str = "cpu",
    ) -> "DraftSamplingParams":
        return cls(
            temperature=to_device(temperature, torch.float32, torch.device(device)),
            top_k=to_device(top_k, torch.long, torch.device(device)),
            top_p=to_device(top_p, torch.float32, torch.device(device)),
            greedy=to_device(greedy, torch.bool, torch.device(device)),
            any_top_k=any(0 < k for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            greedy_rows=tuple(i for i, g in enumerate(greedy) if g),
        )

    def prefix(self, n: int) -> "DraftSamplingParams":
        """The first ``n`` rows: slices on the device, nothing copied."""
        greedy_rows = tuple(i for i in self.greedy_rows if i < n)
        return DraftSamplingParams(
            self.temperature[:n], self.top_k[:n], self.top_p[:n], self.greedy[:n],
            self.any_top_k, self.any_top_p, len(greedy_rows) == n, not greedy_rows, greedy_rows,
        )


def draft_distribution(logits: torch.Tensor, params: DraftSamplingParams) -> torch.Tensor:
    """q over the intersection. logits: [B, n] (already restricted) -> q: [B, n] float32.

    Greedy rows get a softmax at temperature 1 here; ``sample_drafts`` replaces
    it with the one-hot q they are actually drawn from.
    """
    logits = logits.to(torch.float32)
    temp = torch.where(params.greedy, torch.ones_like(params.temperature), params.temperature)
    scaled = logits / temp.clamp_min(1e-5).unsqueeze(-1)
    if params.any_top_k or params.any_top_p:
        n = scaled.shape[-1]
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if params.any_top_k:
            k = torch.where((params.top_k <= 0) | (params.top_k > n), torch.full_like(params.top_k, n), params.top_k)
            drop |= torch.arange(n, device=scaled.device).unsqueeze(0) >= k.unsqueeze(-1)
        if params.any_top_p:
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
            drop |= mass_before >= params.top_p.unsqueeze(-1)
        drop[:, 0] = False  # always keep the best token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
    return scaled.softmax(dim=-1)


def sample_drafts(
    logits: torch.Tensor,
    params: DraftSamplingParams,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one draft per row.

    logits: [B, n] restricted to the intersection (``draft_ids`` order); uniforms: [B] in [0, 1), on
    the logits' device, one per row (``seeding.DraftUniforms``; None when every row is greedy).
    Returns (index [B] into the intersection, q [B, n] float32), where q is the exact distribution
    each row's index was drawn from: the index is q's inverse CDF at the row's uniform, for every row
    in one batched search (no generator, no per-row call).
    """
    if params.all_greedy:
        index = logits.argmax(dim=-1)
        q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        q.scatter_(-1, index.unsqueeze(-1), 1.0)
        return index, q
    if uniforms is None:
        raise ValueError("sample_drafts: sampled rows need uniforms")
    q = draft_distribution(logits, params)
    cdf = q.cumsum(dim=-1)  # [B, n]
    total = cdf[:, -1:]  # [B, 1]
    # strictly below the total, so the search lands on a token q gives mass (never on a zero past it)
    point = torch.minimum(uniforms.unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, point, right=True).squeeze(-1)  # [B]: the first token whose cdf passes it
    greedy_rows = list(params.greedy_rows)
    if greedy_rows:
        g_rows = to_device(greedy_rows, torch.long, logits.device)
        g_index = logits[g_rows].argmax(dim=-1)
        index[g_rows] = g_index
        q[g_rows] = 0.0
        q[g_rows, g_index] = 1.0
    return index, q
