"""The drafter's forward cost, timed once at start-up on the runtime it drafts with.

A drafter forward costs a part that its batch shares (reading the weights, launching the step,
the runtime's own bookkeeping) and a part per request in it. Both are measured here before the
engine serves, with a few throw-away requests, so that the draft-length policy prices drafts
from what this drafter costs on this device and in this weight format, not from a guess. The
target's step is measured while serving (``cost_calibration.py``), which puts the two in one
unit. Every batch size is warmed up before it is timed: a runtime's first forwards allocate.

Under tensor parallelism only the group's rank 0 times its drafter, and every rank takes that
result (the caller broadcasts it): timings differ between ranks, the lengths they choose must not.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from vllm_usd.drafter.base import DrafterRuntime
from vllm_usd.drafting.length_policy import measured_cost

TIMING_BATCHES = (1, 2, 4, 8, 16)  # batch sizes timed (as far as the runtime takes that many requests)
CONTEXT_TOKENS = 32  # each throw-away request's context before the timed forwards
TIMED_FORWARDS = 9  # one-token forwards timed per batch size, after one untimed; their median counts
_REQUEST_PREFIX = "__vllm_usd_timing__"


@dataclass(frozen=True)
class DrafterTiming:
    """Seconds a one-token drafter forward takes at each batch size.

    ``points``: (batch size, median seconds) where timed, never falling as the batch grows; the
    cost in between is read off them (``measured_cost``). ``per_forward + per_request * batch`` is the
    line through them, for logs and where no points were kept: a line can miss the small batches by
    half (a drafter that is weight-read-bound at batch 1 and compute-bound from 2 on), and batch 1 is
    where drafting pays most.
    """

    per_forward: float
    per_request: float
    points: tuple[tuple[int, float], ...] = ()

    def seconds(self, batch: int) -> float:
        if self.points:
            return measured_cost(self.points, batch)
        return self.per_forward + self.per_request * batch


def time_drafter(runtime: DrafterRuntime, token_ids: Sequence[int], *, batches: Sequence[int] = TIMING_BATCHES,
                 timed_forwards: int = TIMED_FORWARDS,
                 clock: Callable[[], float] = time.perf_counter) -> DrafterTiming | None:
    """Time one-token forwards of ``runtime`` at each batch size; None where it took no request.

    ``token_ids``: drafter ids to fill the contexts with (any real tokens: the cost does not depend
    on which). Batch sizes the runtime cannot hold (its request limit, its KV budget) are skipped.
    """
    if not token_ids:
        raise ValueError("time_drafter needs at least one drafter token id")
    context = [token_ids[i % len(token_ids)] for i in range(CONTEXT_TOKENS)]
    points: list[tuple[int, float]] = []
    for batch in sorted(set(batches)):
        seconds = _time_batch(runtime, batch, context, timed_forwards, clock)
        if seconds is None:
            break
        points.append((batch, max(seconds, points[-1][1]) if points else seconds))  # never cheaper with more
    return replace(_fit(points), points=tuple(points)) if points else None


def _time_batch(runtime: DrafterRuntime, batch: int, context: list[int], timed_forwards: int,
                clock: Callable[[], float]) -> float | None:
    """Median seconds of a one-token forward of ``batch`` requests; None if the runtime cannot hold them."""
    added: list[str] = []
    try:
        for i in range(batch):
            req_id = f"{_REQUEST_PREFIX}{batch}-{i}"
            if not runtime.add(req_id):
                return None
            added.append(req_id)
        _wait(runtime.forward(added, [0] * batch, [context] * batch))
        length, times = len(context), []
        for step in range(timed_forwards + 1):
            # on the path drafts take: ids already on the device (captured graphs, where a runtime has them)
            tokens = torch.full((batch,), context[step % len(context)], dtype=torch.long, device=runtime.device)
            start = clock()
            _wait(runtime.forward_next(added, [length] * batch, tokens))
            if step:  # the first one-token forward of a batch size is its warm-up
                times.append(clock() - start)
            length += 1
        return statistics.median(times)
    finally:
        for req_id in added:
            runtime.free(req_id)


def _wait(logits) -> None:
    """Wait for the forward to finish (an accelerator runs it asynchronously): copy one value out."""
    logits[:1, :1].cpu()


def _fit(points: list[tuple[int, float]]) -> DrafterTiming:
    """Least squares t = f0 + f1 * batch over the timed sizes, both at least 0."""
    if len(points) == 1:
        return DrafterTiming(per_forward=points[0][1], per_request=0.0)
    n = len(points)
    mb = sum(b for b, _ in points) / n
    mt = sum(t for _, t in points) / n
    sbb = sum((b - mb) ** 2 for b, _ in points)
    f1 = sum((b - mb) * (t - mt) for b, t in points) / sbb
    f0 = mt - f1 * mb
    if f1 < 0:  # no measurable cost per request: the mean is the forward's
        return DrafterTiming(per_forward=mt, per_request=0.0)
    if f0 < 0:  # steeper than proportional: all of it per request, through the origin
        return DrafterTiming(per_forward=0.0, per_request=sum(b * t for b, t in points) / sum(b * b for b, _ in points))
    return DrafterTiming(per_forward=f0, per_request=f1)
