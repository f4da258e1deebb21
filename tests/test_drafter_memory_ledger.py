"""Issue 39: the drafter takes all its memory in load_model, before vLLM sizes its KV cache. No engine.

The proposer drafts on the CPU with the graph stand-in (``VLLM_USD_CPU_GRAPHS``: every drafter
forward a graph holds is a replay) through a fake runner, under a mixed load: prompts up to
the drafter's chunked catch-up and past it, eight rows at once, greedy, sampled, top-k, top-p
and seeded rows, requests that finish early (aborts) and requests preempted and resumed.
``MemoryLedger`` (tests/memory_ledger.py) models a caching allocator: after ``load_model``
returns, the high-water mark of the drafter side's live tensor memory must not rise by a byte.
A planted bug (a proposer that keeps each step's q) shows that the ledger sees a rise.
"""

from __future__ import annotations

import random

import pytest

from tests.fakes import FakeRunner, sampling, vllm_config
from tests.memory_ledger import MemoryLedger
from vllm_usd import UniversalProposer

MAX_NUM_SEQS = 8


@pytest.fixture(scope="module")
def pair():
    from tests.fixtures import tiny

    return tiny.build_distribution_pair()


class AllocatesLazily(UniversalProposer):
    """Planted bug: the drafter's memory is left to the first request (as before issue 39)."""

    def load_model(self, target_model) -> None:
        pass


class KeepsEveryQ(UniversalProposer):
    """Planted bug: each step's q is kept (a leak a real GPU would pay for in reserved memory)."""

    kept: list = []

    def _q_for_sampler(self, batch):
        qs = super()._q_for_sampler(batch)
        if qs is not None:
            self.kept.append([q.clone() for q in qs])
        return qs


def _serve(pair, cls, monkeypatch, steps: int = 60) -> tuple[MemoryLedger, UniversalProposer]:
    monkeypatch.setenv("VLLM_USD_CPU_GRAPHS", "1")
    target, drafter = pair
    p = cls(vllm_config(target, {"drafter": drafter, "adaptive_length": False, "draft_mode": "tli"}, k=3,
                        max_num_seqs=MAX_NUM_SEQS))
    rng = random.Random(0)
    vocab = p.target_vocab_size
    runner = FakeRunner()
    settings = [sampling(0.0), sampling(1.0), sampling(0.8, top_k=20), sampling(1.0, top_p=0.8),
                sampling(0.9, seed=7), sampling(1.2, top_k=50, top_p=0.9)]
    with MemoryLedger() as ledger:
        p.load_model(None)
        ledger.start_serving()
        made = 0
        preempted: dict[str, list[int]] = {}
        drafts: dict[str, list[int]] = {}
        for step in range(steps):
            finished, gone = set(), set()
            while len(runner.input_batch.req_ids) < MAX_NUM_SEQS:
                if preempted and rng.random() < 0.5:  # a preempted request resumes with its whole history
                    r, history = preempted.popitem()
                    runner.add(r, history, settings[int(r[1:]) % len(settings)])
                    continue
                n = rng.choice([3, 12, 40, 300, 420])  # short prompts, and past the 256-token chunk
                runner.add(f"r{made}", [rng.randrange(10, vocab) for _ in range(n)], settings[made % len(settings)])
                made += 1
            live = list(runner.input_batch.req_ids)
            if step % 7 == 3:  # an abort
                r = rng.choice(live)
                runner.remove(r)
                finished.add(r)
            elif step % 11 == 5:  # a preemption: the request leaves the batch, its history kept
                r = rng.choice(live)
                preempted[r] = list(runner.history[r])
                runner.remove(r)
                gone.add(r)
            for r in list(runner.input_batch.req_ids):
                if len(runner.history[r]) > 480:
                    runner.remove(r)
                    finished.add(r)
            # verification: a prefix of each row's drafts is accepted, then the target's own token
            new = {r: drafts.get(r, [])[:rng.randint(0, 3)] + [rng.randrange(10, vocab)]
                   for r in runner.input_batch.req_ids}
            drafts = runner.step(p, new, finished=finished, preempted=gone)
        ended = set(runner.input_batch.req_ids) | set(preempted)
        for r in list(runner.input_batch.req_ids):
            runner.remove(r)
        runner.step(p, {}, finished=ended)
    assert p.num_request_states == 0 and p.runtime.num_requests == 0
    return ledger, p


def test_no_drafter_memory_is_taken_after_load_model_under_a_mixed_load(pair, monkeypatch):
    ledger, p = _serve(pair, UniversalProposer, monkeypatch)
    forwards = p.stats()["drafter_forwards"]
    assert p.counters["drafted_rows"] > 100 and forwards["replayed"] > 50, (p.counters, forwards)
    assert forwards["eager"] == 0, forwards
    assert ledger.startup_peak > 0
    assert ledger.retained == 0, f"{ledger.retained} bytes still held once every request ended"
    assert ledger.grown == 0, (f"{ledger.grown} bytes taken after load_model (start-up's mark "
                               f"{ledger.startup_peak}):\n" + ledger.largest_rises())


def test_the_ledger_sees_memory_taken_or_kept_after_load_model(pair, monkeypatch):
    lazy, _ = _serve(pair, AllocatesLazily, monkeypatch, steps=3)
    assert lazy.grown > 0, "memory first taken while serving"
    leak, _ = _serve(pair, KeepsEveryQ, monkeypatch, steps=10)
    assert leak.retained > 0, "memory kept after every request ended"
