"""The target's forward, timed at start-up at a few token counts, for the draft-length controller.

vLLM calls the proposer's ``load_model`` with the loaded target before it profiles memory and
allocates its KV cache. Where the target runs eagerly (``enforce_eager``; a compiled target is
first run by vLLM's own warm-up, so it is not timed here) the forwards here run then, on dummy ids with no attention metadata
(as vLLM's own profiling run does): the weights' and the logits' cost, not attention over
a KV cache, which the controller's measured cycles correct. The same logits time what verifying
sampled drafts adds (``verify_sampled``), which a step with sampled drafts pays in vLLM's rejection
sampler and a step without drafts does not. Every tensor-parallel rank runs
the same forwards (their collectives must meet); rank 0's times are the ones used.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from vllm_usd.drafting.timing import median_seconds

logger = logging.getLogger("vllm.usd")

TARGET_REPEATS = 3  # timed forwards per token count, after one warm-up
MAX_TIMED_TOKENS = 256  # the largest count timed (past it a step is priced in proportion to its tokens)


def token_counts(max_tokens: int) -> list[int]:
    """1, 2, 4, ... up to ``max_tokens`` (and ``max_tokens`` itself)."""
    counts, n = [], 1
    while n < max_tokens:
        counts.append(n)
        n *= 2
    return counts + [max(max_tokens, 1)]


Points = tuple[tuple[int, float], ...]


def time_target(model: Any, vllm_config: Any, counts: Sequence[int]) -> tuple[Points, Points]:
    """(tokens, median seconds of a forward with logits for every token) per count, and (rows, median
    seconds of ``verify_sampled`` over that many rows of those logits) per count; ((), ()) for a model
    without parameters. Raises where vLLM's forward context or the model refuses the call (the caller
    then prices steps as measured)."""
    from vllm.forward_context import set_forward_context

    try:
        device = next(model.parameters()).device
    except (StopIteration, AttributeError):
        return (), ()
    points: list[tuple[int, float]] = []
    verify: list[tuple[int, float]] = []
    with torch.inference_mode():
        for n in counts:
            ids = torch.zeros(n, dtype=torch.long, device=device)
            positions = torch.arange(n, dtype=torch.long, device=device)
            logits = None

            def forward() -> None:
                nonlocal logits
                with set_forward_context(None, vllm_config, num_tokens=n):
                    hidden = model(input_ids=ids, positions=positions)
                    logits = model.compute_logits(hidden)
                if logits is not None:
                    logits[:1, :1].cpu()  # wait for an accelerator

            seconds = median_seconds(forward, repeats=TARGET_REPEATS)
            points.append((n, max(seconds, points[-1][1]) if points else seconds))
            if logits is not None:
                seconds = median_seconds(lambda: verify_sampled(logits)[:1].cpu(), repeats=TARGET_REPEATS)
                verify.append((n, max(seconds, verify[-1][1]) if verify else seconds))
    return tuple(points), tuple(verify)


def verify_sampled(logits: torch.Tensor) -> torch.Tensor:
    """What verifying a sampled draft adds over sampling one token, per drafted row of the target's ``logits``
    ([rows, vocab_size]), as vLLM's rejection sampler does it: the target's probabilities in float32, and a
    recovered token drawn from them (a race of exponentials over the vocabulary). Returns the tokens."""
    probs = logits.float().softmax(dim=-1)  # [rows, vocab_size]
    return probs.div_(torch.rand_like(probs).log_().neg_()).argmax(dim=-1)
