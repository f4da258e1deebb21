"""Feeding drafters ahead on the CPUs the target leaves idle (vllm_adapter/catch_up_ahead.py): the llama.cpp
drafter of the tiny pair against a fake runner, this thread bound to one CPU as vLLM binds its worker. No engine."""

from __future__ import annotations

import contextlib
import os

import pytest

from tests.fakes import FakeRunner, sampling, vllm_config
from vllm_usd import UniversalProposer
from vllm_usd.drafting import DraftLengthController, StartupTimings

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a CPU for the target and an idle one")

# a plain step of 20 ms and a drafter reading a 32-token prompt in 32 ms on its two threads (this process
# is unbound when the proposer starts): 1 ms a token there, 2 ms in one thread, so 5 tokens are fed in half a step
TIMINGS = StartupTimings(target=((1, 0.020), (4, 0.020)), drafter=((1, 0.001),), drafter_prefill=((32, 0.032),))
PER_STEP = 5


@pytest.fixture(scope="module")
def pair_gguf(tmp_path_factory):
    from tests.fixtures import tiny
    from tests.fixtures.gguf_llama import write_llama_gguf

    target, drafter = tiny.build_distribution_pair()
    return target, drafter, write_llama_gguf(drafter, tmp_path_factory.mktemp("gguf") / "drafter-f32.gguf")


@pytest.fixture(autouse=True)
def user_cpus(monkeypatch):
    """As register() leaves it in the user's process, for vLLM's processes to inherit."""
    monkeypatch.setenv("VLLM_USD_CPUS", ",".join(map(str, sorted(os.sched_getaffinity(0)))))


def _proposer(pair_gguf, timings: StartupTimings = TIMINGS, **usd):
    target, drafter, gguf = pair_gguf
    p = UniversalProposer(vllm_config(target, {"drafter": drafter, "drafter_runtime": "llama_cpp", "drafter_gguf": gguf,
                                               "drafter_gguf_type": "file", "draft_mode": "tli", **usd}, k=3))
    if usd.get("adaptive_length", True):
        p.controller = DraftLengthController(3, timings)
    return p


def _force(p, length: int) -> None:
    p.controller.length = lambda batch, catch_up=None, greedy=0: length


@contextlib.contextmanager
def _bound_to_one_cpu():
    """As vLLM's CPU worker binds the target's threads (the drafter keeps the CPUs it started with)."""
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(saved)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def _requests(pair_gguf) -> FakeRunner:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pair_gguf[0])
    runner = FakeRunner()
    runner.add("g", tok(" the keeper of the light lived by the sea in a small house").input_ids, sampling(0.0))
    runner.add("s", tok(" it was a boat with a red sail and a long rope").input_ids, sampling(0.9, seed=5))
    return runner


def _next_tokens(p, runner: FakeRunner, step: int) -> dict[str, list[int]]:
    ids = p.mapping.target_ids.tolist()
    return {r: [ids[(7 * step + 3 * i) % len(ids)]] for i, r in enumerate(runner.input_batch.req_ids)}


def test_drafters_fed_ahead_catch_up_within_budget_and_draft_as_fresh_ones_do(pair_gguf):
    p, runner = _proposer(pair_gguf), _requests(pair_gguf)
    _force(p, 0)
    behind = []
    with _bound_to_one_cpu():
        for step in range(24):
            fed = p.counters["fed_ahead_tokens"]
            assert all(d == [] for d in runner.step(p, _next_tokens(p, runner, step)).values())
            assert p.ahead.wait() is None
            # the first step ends the prompts' prefill: they draft (and are fed) from the next
            assert (0 < p.counters["fed_ahead_tokens"] - fed <= PER_STEP) == (step > 0), "within the budget"
            lag = 0
            for r in "gs":  # a row the step's budget did not reach is left as it was (none at first)
                held = p.runtime.cached_tokens(r) if p.runtime.has(r) else []
                wanted = p.requests.get(r).translator.draft_ids if p.requests.get(r) else runner.history[r]
                assert held == wanted[:len(held)], "the drafter holds a prefix of the request's context"
                lag += len(wanted) - len(held)
            behind.append(lag)
            missed, _ = p.requests.catch_up_outlook(list("gs"), [[1], [1]], [len(runner.history[r]) for r in "gs"],
                                                    p._sampling)
            # what the controller prices: what the drafters lack, less the k + 1 a drafted step feeds anyway
            # (and nothing for rows whose prefill just ended)
            assert lag - 2 * (3 + 1) <= missed <= lag or step == 0, (step, missed, lag)
        assert behind[-1] < behind[0] and behind[-1] <= 2, behind
        _force(p, 3)
        drafts = runner.step(p, _next_tokens(p, runner, 24))
    assert p.failures.by_reason == {} and all(len(d) == 3 for d in drafts.values())

    fresh, solo = _proposer(pair_gguf, adaptive_length=False), FakeRunner()
    for r in "gs":
        solo.add(r, runner.history[r], runner.requests[r].sampling_params)
    assert drafts == solo.step(fresh, {}), "a drafter fed ahead in pieces drafts what one fed at once does"


@pytest.mark.parametrize("case", ["target_on_every_cpu", "drafting_cannot_pay"])
def test_nothing_is_fed_ahead_without_an_idle_cpu_or_where_drafting_cannot_pay(pair_gguf, case):
    slow_drafter = StartupTimings(target=TIMINGS.target, drafter=((1, 1.0),), drafter_prefill=TIMINGS.drafter_prefill)
    p = _proposer(pair_gguf, slow_drafter if case == "drafting_cannot_pay" else TIMINGS)
    runner = _requests(pair_gguf)
    _force(p, 0)
    with contextlib.nullcontext() if case == "target_on_every_cpu" else _bound_to_one_cpu():
        for step in range(3):
            runner.step(p, _next_tokens(p, runner, step))
    assert p.counters["fed_ahead_tokens"] == 0 and p.runtime.num_requests == 0 and len(p.requests) == 0


def test_a_failure_while_feeding_ahead_is_counted_and_feeding_stays_off(pair_gguf, monkeypatch):
    p, runner = _proposer(pair_gguf), _requests(pair_gguf)
    _force(p, 0)

    def broken(*args):
        raise RuntimeError("planted: llama.cpp failed on the idle CPU")

    monkeypatch.setattr(p.runtime, "catch_up_on", broken)
    with _bound_to_one_cpu():
        runner.step(p, _next_tokens(p, runner, 0))  # ends the prompts' prefill
        runner.step(p, _next_tokens(p, runner, 1))
        assert p.counters["fed_ahead_tokens"] > 0 and p.failures.by_reason == {}
        runner.step(p, _next_tokens(p, runner, 2))  # waits for the feed: it failed
        assert p.failures.by_reason == {"RuntimeError": 1} and p.counters["failed_steps"] == 1
        assert len(p.requests) == 0 and p.runtime.num_requests == 0, "the failed feed's requests start afresh"
        fed = p.counters["fed_ahead_tokens"]
        runner.step(p, _next_tokens(p, runner, 3))
        assert p.counters["fed_ahead_tokens"] == fed and p.failures.by_reason == {"RuntimeError": 1}, "it stays off"
        _force(p, 3)
        drafts = runner.step(p, _next_tokens(p, runner, 4))
    fresh, solo = _proposer(pair_gguf, adaptive_length=False), FakeRunner()
    for r in "gs":
        solo.add(r, runner.history[r], runner.requests[r].sampling_params)
    assert drafts == solo.step(fresh, {}) and all(len(d) == 3 for d in drafts.values())


def test_a_step_about_to_draft_waits_while_its_drafters_are_fed_ahead(pair_gguf):
    """Rows lacking more than one step's feed draft nothing (the controller said 3): the next steps feed them off
    the target's CPUs, where drafting now would first read their prompts on the target's. Then they draft."""
    p, runner = _proposer(pair_gguf), _requests(pair_gguf)
    _force(p, 3)
    waited, drafted_at = 0, None
    with _bound_to_one_cpu():
        for step in range(30):
            drafts = runner.step(p, _next_tokens(p, runner, step) if step == 0 else
                                 {r: (d[:1] or _next_tokens(p, runner, step)[r]) for r, d in drafts.items()})
            if any(drafts.values()):
                drafted_at = step
                break
            waited += step > 0 and p.counters["fed_ahead_tokens"] > 0
    assert drafted_at is not None and waited >= 3, (drafted_at, waited, dict(p.counters))
    lacking = sum(len(p.requests.get(r).translator.draft_ids) - len(p.runtime.cached_tokens(r)) for r in "gs")
    assert lacking <= 0 and all(len(d) == 3 for d in drafts.values()), (lacking, drafts)
