"""Estimate USD's acceptance offline, before serving: teacher-forced on a text.

For every position of the target's tokenization of a text, the target's
next-token distribution p and the drafter's intersection-restricted q (given
the drafter's translation of the same prefix) are computed with transformers.

- Greedy: a draft is accepted while it equals the target's argmax. Engine steps
  are simulated on the text as vLLM runs them (accept a run of matches up to
  k, then one target token), which gives the acceptance length per k.
- Sampling (temperature 1, or ``temperature``: p and q both scaled): a draft is accepted with probability
  alpha = sum_x min(p(x), q(x)) at each position; the expected tokens per step
  are 1 + sum_{j=1..k} prod_{m<j} alpha_{i+m}, averaged over start positions.

No vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_usd.core.pair import DraftPair
from vllm_usd.drafter.base import DrafterRuntime
from vllm_usd.drafter.hf_runtime import HFDrafterRuntime


@dataclass
class AcceptanceEstimate:
    positions: int
    greedy_match_rate: float  # share of positions where the drafter's argmax is the target's
    mean_alpha: float  # mean sum_x min(p, q) at temperature 1
    greedy_length: dict[int, float]  # k -> simulated acceptance length (greedy)
    sampled_length: dict[int, float]  # k -> expected acceptance length (temperature 1)

    def recommend_k(self, cost_ratio: float, greedy: bool = True) -> int:
        """The k with the best projected speedup (E[len]) / (1 + k * cost_ratio)."""
        lengths = self.greedy_length if greedy else self.sampled_length
        return max(lengths, key=lambda k: lengths[k] / (1 + k * cost_ratio))


def _simulate_greedy(match: list[bool], k: int) -> tuple[int, int]:
    """(tokens emitted, engine steps) over one text, drafting k per step."""
    i, steps, emitted = 0, 0, 0
    while i < len(match):
        run = 0
        while run < k and i + run < len(match) and match[i + run]:
            run += 1
        steps += 1
        emitted += run + 1
        i += run + 1
    return emitted, steps


def _expected_sampled(alpha: list[float], k: int) -> float:
    if not alpha:
        return 1.0
    total = 0.0
    for i in range(len(alpha)):
        length, survive = 1.0, 1.0
        for j in range(k):
            if i + j >= len(alpha):
                break
            survive *= alpha[i + j]
            length += survive
        total += length
    return total / len(alpha)


@torch.inference_mode()
def estimate_acceptance(
    target_model, target_tokenizer, drafter_model, drafter_tokenizer,
    sequences: list[list[int]], score_from: list[int] | None = None, ks: range = range(1, 9),
    runtime: DrafterRuntime | None = None, temperature: float = 1.0,
) -> AcceptanceEstimate:
    """``sequences``: target token ids (prompt + text). Positions before
    ``score_from[i]`` give context only. Both models are transformers causal
    LMs; the drafter must have been loaded with ``load_drafter``. ``runtime``: draft
    with this runtime instead (another weight format of the same drafter, llama.cpp on its GGUF);
    ``drafter_model`` then only gives the drafter's vocabulary size."""
    pair = DraftPair.for_models(target_model, target_tokenizer, drafter_model, drafter_tokenizer)
    mapping = pair.mapping
    if runtime is None:
        longest = 4 * max(len(ids) for ids in sequences) + 64  # room for a drafter that cuts text finer
        runtime = HFDrafterRuntime(drafter_model, max_len=longest, max_requests=1, kv_budget_bytes=1 << 34)
    runtime.set_output_rows(mapping.draft_ids)

    match: list[bool] = []
    alpha: list[float] = []
    greedy_runs: list[list[bool]] = []
    for s, ids in enumerate(sequences):
        first = max(1, score_from[s] if score_from else 1)
        p = (target_model(torch.tensor([ids])).logits[0].float() / temperature).softmax(-1)  # [L, V]
        translator = pair.translator()
        translator.start(ids[:first])
        runtime.add("seq")
        run: list[bool] = []
        known = 0
        for pos in range(first, len(ids) + 1):
            if pos > first:
                _, appended = translator.feed([ids[pos - 1]])
                known = len(translator.draft_ids) - len(appended)
            if pos == len(ids) or not translator.draft_ids:
                break
            q = (runtime.catch_up(["seq"], [translator.draft_ids], [known])[0].float() / temperature).softmax(-1)  # [n]
            p_pos = p[pos - 1]
            drafted = int(mapping.target_ids[int(q.argmax())])
            hit = drafted == int(p_pos.argmax())
            run.append(hit)
            match.append(hit)
            alpha.append(float(torch.minimum(p_pos[mapping.target_ids], q).sum()))
        runtime.free("seq")
        greedy_runs.append(run)

    def greedy_len(k: int) -> float:
        counts = [_simulate_greedy(run, k) for run in greedy_runs]
        steps = sum(c[1] for c in counts)
        return sum(c[0] for c in counts) / steps if steps else 1.0

    return AcceptanceEstimate(
        positions=len(match),
        greedy_match_rate=sum(match) / len(match) if match else 0.0,
        mean_alpha=sum(alpha) / len(alpha) if alpha else 0.0,
        greedy_length={k: greedy_len(k) for k in ks},
        sampled_length={k: _expected_sampled(alpha, k) for k in ks},
    )
