"""Intersection drafting (TLI, Timor et al., ICML 2025): k drafts per request from the shared vocabulary.

Each position: the drafter's logits over the intersection (the pruned head,
or the full head restricted), one draft per row sampled like the request,
and q, the exact distribution it was drawn from. Drafts map to target ids
through the mapping's one sorted index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_usd.core.mapping import VocabMapping
from vllm_usd.core.sampling import DraftSamplingParams, sample_drafts
from vllm_usd.core.seeding import position_generators
from vllm_usd.drafter.base import DrafterRuntime
from vllm_usd.drafting.requests import DraftRows
from vllm_usd.drafting.timing import PhaseTimer


@dataclass
class DraftBatch:
    """What one step drafted, in the order of ``DraftRows``."""

    target_ids: torch.Tensor  # [B, k] target ids
    q: list[torch.Tensor] | None  # per position [B, n] in intersection order; None when every row is greedy


def sampling_params(rows: DraftRows, device: torch.device) -> DraftSamplingParams:
    states = rows.states
    return DraftSamplingParams.from_lists(
        temperature=[s.temperature for s in states], top_k=[s.top_k for s in states],
        top_p=[s.top_p for s in states], greedy=[s.greedy for s in states], device=device,
    )


class IntersectionDrafting:
    """Drafts k intersection tokens per request through a ``DrafterRuntime``."""

    def __init__(self, mapping: VocabMapping, runtime: DrafterRuntime, *, k: int, pruned_head: bool,
                 timer: PhaseTimer) -> None:
        self.mapping = mapping
        self.runtime = runtime
        self.k = k
        self.pruned_head = pruned_head
        self.timer = timer
        self.device = runtime.device
        # the mapping's one sorted index, where the drafter's logits are
        self._draft_ids = mapping.draft_ids.to(self.device)  # [n]
        self._target_ids = mapping.target_ids.to(self.device)  # [n]
        if pruned_head:
            runtime.set_output_rows(mapping.draft_ids)

    def _intersection_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.pruned_head else logits.index_select(-1, self._draft_ids)  # [B, n]

    def draft(self, rows: DraftRows, salt: int) -> DraftBatch:
        """k drafts for each row; ``salt`` (usd.seed) goes into every unseeded draw."""
        params = sampling_params(rows, self.device)
        keys = [s.key for s in rows.states]
        seeded = [s.seeded for s in rows.states]
        k, timer = self.k, self.timer
        index = torch.empty(len(rows), k, dtype=torch.long, device=self.device)  # [B, k] into the intersection
        qs: list[torch.Tensor] = []
        lengths = [len(seq) for seq in rows.sequences]
        with timer.phase("drafter_forward"):
            logits = self.runtime.catch_up(rows.req_ids, rows.sequences, rows.unchanged)
        for j in range(k):
            logits = self._intersection_logits(logits)
            with timer.phase("sample"):
                shared = None
                if not params.all_greedy:
                    params.generators, shared = position_generators(
                        keys, [pos + j for pos in rows.positions], seeded, salt, self.device)
                idx, q = sample_drafts(logits, params, shared)
            index[:, j] = idx
            qs.append(q)
            if j + 1 < k:
                next_tokens = self._draft_ids[idx].tolist()  # TODO(GPU): a host sync per position
                with timer.phase("drafter_forward"):
                    logits = self.runtime.forward(rows.req_ids, lengths, [[t] for t in next_tokens])
                lengths = [n + 1 for n in lengths]
        return DraftBatch(target_ids=self._target_ids[index], q=None if params.all_greedy else qs)
