"""The drafter's forward, timed once at start-up on the runtime it drafts with.

A few throw-away requests, one-token forwards at each batch size, the median after a warm-up forward (a runtime's
first forwards allocate), and one request's first forward over a prompt of a few lengths (what a drafter pays to catch
up on a context it never saw, or on a few tokens): the controller (``controller.py``) prices drafts from what this
drafter costs on this device and in this weight format. Under tensor parallelism only the group's rank 0 times its
drafter, and every rank takes that result (the caller broadcasts it).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from vllm_usd.drafter.base import DrafterRuntime
from vllm_usd.drafting.timing import TIMED_CALLS, median_seconds

TIMING_BATCHES = (1, 2, 4, 8, 16)  # batch sizes timed (as far as the runtime takes that many requests)
CONTEXT_TOKENS = 32  # each throw-away request's context before the timed forwards
_REQUEST_PREFIX = "__vllm_usd_timing__"


def time_drafter(runtime: DrafterRuntime, token_ids: Sequence[int], *, batches: Sequence[int] = TIMING_BATCHES,
                 clock: Callable[[], float] | None = None) -> tuple[tuple[int, float], ...]:
    """(batch size, median seconds of a one-token forward) for each batch size the runtime holds
    (its request limit, its KV budget), never falling as the batch grows.

    ``token_ids``: drafter ids to fill the contexts with (any real tokens: the cost does not depend
    on which). The throw-away requests are added as the batch grows, each reading its context once.
    """
    if not token_ids:
        raise ValueError("time_drafter needs at least one drafter token id")
    context = [token_ids[i % len(token_ids)] for i in range(CONTEXT_TOKENS)]
    held: dict[str, int] = {}  # throw-away request -> tokens it holds
    points: list[tuple[int, float]] = []
    try:
        for batch in sorted(set(batches)):
            new = [f"{_REQUEST_PREFIX}{i}" for i in range(len(held), batch)]
            for req_id in new:
                if not runtime.add(req_id):
                    return tuple(points)
                held[req_id] = 0
            _wait(runtime.forward(new, [0] * len(new), [context] * len(new)))  # batches only grow: new is never empty
            held.update(dict.fromkeys(new, len(context)))
            seconds = _time_step(runtime, held, context, clock)
            points.append((batch, max(seconds, points[-1][1]) if points else seconds))
    finally:
        for req_id in held:
            runtime.free(req_id)
    return tuple(points)


def time_drafter_prefill(runtime: DrafterRuntime, token_ids: Sequence[int], *,
                         lengths: Sequence[int] = (2, 4, 8, CONTEXT_TOKENS, 4 * CONTEXT_TOKENS),
                         clock: Callable[[], float] | None = None, repeats: int = TIMED_CALLS) -> tuple[tuple[int, float], ...]:
    """(prompt tokens, median seconds of ``repeats`` first forwards of a new request over them) at each of
    ``lengths`` the runtime holds, never falling as the prompt grows; a fresh request each time."""
    if not token_ids:
        raise ValueError("time_drafter_prefill needs at least one drafter token id")
    points: list[tuple[int, float]] = []
    for length in sorted(set(lengths)):
        if length > runtime.max_len:
            break
        prompt = [token_ids[i % len(token_ids)] for i in range(length)]
        req_id = f"{_REQUEST_PREFIX}prefill-{length}"

        def first_forward() -> None:
            runtime.free(req_id)
            if not runtime.add(req_id):
                raise RuntimeError("the drafter holds no request for its timing")
            _wait(runtime.forward([req_id], [0], [prompt]))

        try:
            seconds = median_seconds(first_forward, clock=clock, repeats=repeats)
        finally:
            runtime.free(req_id)
        points.append((length, max(seconds, points[-1][1]) if points else seconds))
    return tuple(points)


def _time_step(runtime: DrafterRuntime, held: dict[str, int], context: list[int],
               clock: Callable[[], float] | None) -> float:
    """Median seconds of a one-token forward of every request in ``held`` (advancing what each holds)."""
    req_ids = list(held)

    def forward() -> None:
        # on the path drafts take: ids already on the device (captured graphs, where a runtime has them)
        lengths = [held[req_id] for req_id in req_ids]
        tokens = torch.tensor([context[n % len(context)] for n in lengths], dtype=torch.long, device=runtime.device)
        _wait(runtime.forward_next(req_ids, lengths, tokens))
        for req_id in req_ids:
            held[req_id] += 1

    return median_seconds(forward, clock=clock)


def _wait(logits) -> None:
    """Wait for the forward to finish (an accelerator runs it asynchronously): copy one value out."""
    logits[:1, :1].cpu()
