"""time_drafter: the drafter's forward cost at start-up, on a runtime with a known cost and on the
tiny drafter's real runtime. No engine."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from vllm_usd.drafter.base import DrafterRuntime
from vllm_usd.drafting.controller import interpolate
from vllm_usd.drafting.drafter_timing import CONTEXT_TOKENS, TIMING_BATCHES, time_drafter, time_drafter_prefill
from vllm_usd.drafting.timing import TIMED_CALLS


class CostedRuntime(DrafterRuntime):
    """A runtime whose one-token forward of B requests advances a clock by f0 + f1 B (a prefill by more)."""

    def __init__(self, f0: float, f1: float, max_requests: int = 64, cost=None) -> None:
        self._tokens = {}
        self.f0, self.f1, self.max_requests = f0, f1, max_requests
        self.cost = cost or (lambda batch: self.f0 + self.f1 * batch)
        self.now = 0.0
        self.num_outputs, self.max_len = 8, 1 << 20
        self.batches: list[int] = []
        self.lengths: list[int] = []  # per forward: the most new tokens a request got

    kv_bytes = 0
    param_bytes = 0

    def set_output_rows(self, rows: torch.Tensor) -> None:
        pass

    def _claim(self, req_id: str) -> bool:
        return len(self._tokens) < self.max_requests

    def _release(self, req_id: str) -> None:
        pass

    def forward(self, req_ids: Sequence[str], keep: Sequence[int], new_tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        for r, n, new in zip(req_ids, keep, new_tokens):
            assert n == len(self._tokens[r]), "the timing appends to what the runtime holds"
            self._tokens[r] = self._tokens[r] + list(new)
        first = 10.0 if len(self.batches) < 2 or self.batches[-1] != len(req_ids) else 1.0  # warm-up is slow
        self.now += first * self.cost(len(req_ids)) * max(len(new) for new in new_tokens)
        self.batches.append(len(req_ids))
        self.lengths.append(max(len(new) for new in new_tokens))
        return torch.zeros(len(req_ids), self.num_outputs)


def test_each_batch_size_is_timed_after_its_warm_up_and_the_requests_freed():
    runtime = CostedRuntime(f0=0.004, f1=0.0005)
    points = time_drafter(runtime, [5, 6, 7], clock=lambda: runtime.now)
    assert points == tuple((b, pytest.approx(0.004 + 0.0005 * b)) for b in TIMING_BATCHES), \
        "the slow warm-up forward of each batch size is not what counts"
    assert runtime.num_requests == 0, "the throw-away requests are gone"
    assert sorted(set(runtime.batches)) == sorted(TIMING_BATCHES)
    contexts = [b for b, n in zip(runtime.batches, runtime.lengths) if n == CONTEXT_TOKENS]
    assert sum(contexts) == max(TIMING_BATCHES), "each throw-away request reads its context once"


def test_a_new_requests_first_forward_is_timed_at_prompt_lengths_the_runtime_holds():
    """A prompt of n tokens costs n x (f0 + f1) here: each length timed after its slow warm-up, on a fresh
    request each time (the runtime asserts it only appends), none left behind; past max_len, not timed."""
    runtime = CostedRuntime(f0=0.004, f1=0.0005)
    points = time_drafter_prefill(runtime, [5, 6, 7], clock=lambda: runtime.now)
    assert points == tuple((n, pytest.approx(n * 0.0045)) for n in (2, 4, 8, 32, 128))
    assert runtime.num_requests == 0
    assert runtime.lengths.count(128) == 1 + TIMED_CALLS, "a warm-up, then TIMED_CALLS timed forwards"
    fewer = CostedRuntime(f0=0.004, f1=0.0005)
    assert dict(time_drafter_prefill(fewer, [5], clock=lambda: fewer.now, repeats=3)) == pytest.approx(dict(points))
    assert fewer.lengths.count(128) == 1 + 3 and fewer.num_requests == 0
    short = CostedRuntime(f0=0.004, f1=0.0005)
    short.max_len = 64
    assert [n for n, _ in time_drafter_prefill(short, [5], clock=lambda: short.now)] == [2, 4, 8, 32]


def test_batch_sizes_the_runtime_cannot_hold_are_skipped():
    runtime = CostedRuntime(f0=0.004, f1=0.0005, max_requests=4)
    points = time_drafter(runtime, [5], clock=lambda: runtime.now)
    assert max(runtime.batches) == 4 and runtime.num_requests == 0
    assert [b for b, _ in points] == [1, 2, 4]
    assert time_drafter(CostedRuntime(0.004, 0.0005, max_requests=0), [5]) == ()


def test_a_drafter_whose_cost_is_not_a_line_is_priced_at_each_timed_batch_size():
    """8 ms at batch 1, then 6 ms + 7 ms a request (llama.cpp's SmolLM2 on two cores measured 10-12 ms
    at 1 and 22-26 ms at 2): priced at what was measured, in between by interpolation, and past 16
    at 16's cost per request."""
    def cost(batch: int) -> float:
        return 0.008 if batch == 1 else 0.006 + 0.007 * batch

    runtime = CostedRuntime(0.0, 0.0, cost=cost)
    points = time_drafter(runtime, [5], clock=lambda: runtime.now)
    for batch in TIMING_BATCHES:
        assert interpolate(points, batch) == pytest.approx(cost(batch))
    assert interpolate(points, 3) == pytest.approx((cost(2) + cost(4)) / 2)
    assert interpolate(points, 32) == pytest.approx(2 * cost(16))


def test_a_timing_never_gets_cheaper_as_the_batch_grows():
    """Noise made batch 4 time faster than batch 2: the batch-4 point is raised to batch 2's."""
    runtime = CostedRuntime(0.0, 0.0, cost=lambda b: {1: 0.010, 2: 0.030, 4: 0.025}.get(b, 0.01 * b))
    points = time_drafter(runtime, [5], clock=lambda: runtime.now)
    times = [t for _, t in points]
    assert times == sorted(times) and interpolate(points, 4) == pytest.approx(0.030)


def test_the_tiny_drafters_runtime_is_timed_and_left_as_it_was():
    from tests.fixtures import tiny
    from vllm_usd.drafter.select import choose, open_drafter

    _, drafter = tiny.build_distribution_pair()
    opened = open_drafter(drafter, choose(drafter, runtime="transformers", dtype="float32", gguf=None,
                                          device=torch.device("cpu"), gguf_type="auto"),
                          max_len=256, max_requests=8, kv_budget_bytes=1 << 26)
    runtime = opened.runtime
    runtime.add("live")
    runtime.forward(["live"], [0], [[3, 4, 5]])
    points = dict(time_drafter(runtime, list(range(10, 40))))
    assert sorted(points) == [1, 2, 4] and 0 < points[1] <= points[4], "8 do not fit beside the live request"
    assert runtime.num_requests == 1 and runtime.cached_tokens("live") == [3, 4, 5]
