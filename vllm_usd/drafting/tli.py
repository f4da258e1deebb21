"""Intersection drafting (TLI, Timor et al., ICML 2025): k drafts per request from the shared vocabulary.

Each position: the drafter's logits over the intersection (the pruned head, or the full head restricted),
one draft per row sampled like the request, and q, the exact distribution it was drawn from. Drafts map
to target ids through the mapping's one sorted index.

Between positions everything stays on the device: the sampled indices feed the next drafter forward in
place. The step ends with its one copy to the host, the drafted indices, from which both the target ids
handed to vLLM and the drafter's own record of its tokens are read.

The confidence stop (``usd.confidence_stop``): a row's drafts end after the first one to which
the drafter gave less than the threshold's probability (its softmax over the intersection, at
temperature 1), as transformers' ``assistant_confidence_threshold`` does. Each kept draft was
still drawn from its q, so the stop changes lengths only. The cut is applied with the step's one
copy to the host; on a CPU drafter, where reading is free, the step also ends as soon as every
row stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_usd.core.mapping import VocabMapping
from vllm_usd.core.sampling import DraftSamplingParams, sample_drafts
from vllm_usd.core.device import to_device
from vllm_usd.core.seeding import DraftUniforms
from vllm_usd.drafter.base import DrafterRuntime
from vllm_usd.drafting.requests import DraftRows
from vllm_usd.drafting.timing import PhaseTimer


@dataclass
class DraftBatch:
    """What one step drafted, in the order of ``DraftRows``."""

    target_ids: list[list[int]]  # per row, its drafts as target ids (its length of them)
    q: list[torch.Tensor] | None  # per position j [B_j, n] (the first B_j rows drafted j), intersection order;
    # None when every row is greedy


def sampling_params(rows: DraftRows, device: torch.device) -> DraftSamplingParams:
    states = rows.states
    return DraftSamplingParams.from_lists(
        temperature=[s.temperature for s in states], top_k=[s.top_k for s in states],
        top_p=[s.top_p for s in states], greedy=[s.greedy for s in states], device=device,
    )


class IntersectionDrafting:
    """Drafts k intersection tokens per request through a ``DrafterRuntime``."""

    def __init__(self, mapping: VocabMapping, runtime: DrafterRuntime, *, k: int, pruned_head: bool,
                 timer: PhaseTimer, confidence_stop: float = 0.0) -> None:
        self.mapping = mapping
        self.runtime = runtime
        self.k = k
        self.pruned_head = pruned_head
        self.timer = timer
        self.confidence_stop = confidence_stop
        self.device = runtime.device
        # the mapping's one sorted index, where the drafter's logits are
        self._draft_ids = mapping.draft_ids.to(self.device)  # [n]
        self._draft_ids_host: list[int] = mapping.draft_ids.tolist()
        self._target_ids_host: list[int] = mapping.target_ids.tolist()
        self._uniforms = DraftUniforms()
        if pruned_head:
            runtime.set_output_rows(mapping.draft_ids)

    def _intersection_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.pruned_head else logits.index_select(-1, self._draft_ids)  # [B, n]

    def draft(self, rows: DraftRows, salt: int, lengths: list[int] | None = None) -> DraftBatch:
        """Drafts for each row; ``salt`` (usd.seed) goes into every unseeded draw.

        ``lengths``: drafts per row, 1..k, longest first (None: k each). Position j runs
        only for the first rows whose length exceeds j: the drafter stops for the others.
        """
        if lengths is None:
            lengths = [self.k] * len(rows)
        params = sampling_params(rows, self.device)
        keys = [s.key for s in rows.states]
        seeded = [s.seeded for s in rows.states]
        depth, timer = lengths[0], self.timer
        index = torch.zeros(len(rows), depth, dtype=torch.long, device=self.device)  # [B, depth] into the intersection
        qs: list[torch.Tensor] = []  # per position j: [B_j, n], B_j rows still drafting
        context = [len(seq) for seq in rows.sequences]
        active, step_params = len(rows), params  # rows still drafting: the first ``active`` (longest first)
        cut = torch.full((len(rows),), depth, dtype=torch.long, device=self.device)  # [B] drafts kept per row
        uniforms = None if params.all_greedy else to_device(  # [B, depth]: the step's draws, one copy
            self._uniforms.draw(keys, rows.positions, seeded, salt, depth), torch.float32, self.device)
        with timer.phase("drafter_forward"):
            logits = self.runtime.catch_up(rows.req_ids, rows.sequences, rows.unchanged)
        for j in range(depth):
            if step_params.temperature.shape[0] != active:  # rows at their length dropped out
                step_params = params.prefix(active)
            logits = self._intersection_logits(logits)
            with timer.phase("sample"):
                idx, q = sample_drafts(logits, step_params, None if uniforms is None else uniforms[:active, j])
            index[:active, j] = idx
            qs.append(q)
            if self.confidence_stop > 0 and j + 1 < depth and self._stop_unconfident(logits, idx, cut[:active], j):
                break
            if j + 1 < depth:
                go_on = sum(1 for n in lengths[:active] if n > j + 1)
                next_tokens = self._draft_ids[idx[:go_on]]  # [go_on] drafter ids, left on the device
                with timer.phase("drafter_forward"):
                    logits = self.runtime.forward_next(rows.req_ids[:go_on], context[:go_on], next_tokens)
                context = [n + 1 for n in context[:go_on]]
                active = go_on
        picked = torch.cat([index, cut.unsqueeze(1)], dim=1).tolist()  # the step's one copy to the host
        self._settle_drafter_tokens(picked, lengths, len(qs))
        target = [[self._target_ids_host[i] for i in row[:min(n, row[-1])]] for row, n in zip(picked, lengths)]
        return DraftBatch(target_ids=target, q=None if params.all_greedy else qs)

    def _stop_unconfident(self, logits: torch.Tensor, idx: torch.Tensor, cut: torch.Tensor, j: int) -> bool:
        """Cut each row whose draft at ``j`` fell below the threshold to j + 1 drafts (``cut``: [active],
        in place). True when every row has stopped and the drafter's device reads for free (a CPU)."""
        confidence = torch.softmax(logits.float(), dim=-1).gather(1, idx.unsqueeze(1)).squeeze(1)  # [active]
        cut.copy_(torch.where((confidence < self.confidence_stop) & (cut > j + 1), j + 1, cut))
        return self.device.type == "cpu" and bool((cut <= j + 1).all())

    def _settle_drafter_tokens(self, picked: list[list[int]], lengths: list[int], positions: int) -> None:
        """Tell the runtime the drafter ids it was fed in place, in its call order: position j's
        forward (of the ``positions`` sampled) took the drafts at j of the rows drafting past j."""
        fed = [self._draft_ids_host[row[j]] for j in range(positions - 1)
               for row, n in zip(picked, lengths) if n > j + 1]
        self.runtime.settle_from_host(fed)
