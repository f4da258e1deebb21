"""UniversalProposer against a fake runner: batching, q hand-off, lifecycle, failures. No engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.fakes import FakeRunner, sampling, vllm_config
from tests.faults import RankRngProposer
from vllm_usd import UniversalProposer
from vllm_usd.vllm_adapter import compat


@pytest.fixture(scope="module")
def pair():
    from tests.fixtures import tiny

    return tiny.build_distribution_pair()


def _proposer(pair, k=3, cls=UniversalProposer, **usd):
    """Fixed k unless a test asks for the draft-length policy (test_adaptive_length.py tests it)."""
    target, drafter = pair
    usd.setdefault("adaptive_length", False)
    usd.setdefault("draft_mode", "tli")  # these test the TLI machinery; test_string_drafting.py the other mode
    return cls(vllm_config(target, {"drafter": drafter, **usd}, k=k))


def _prompt(pair, text):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pair[0])(text).input_ids


def test_greedy_batch_drafts_k_shared_tokens_and_no_q(pair):
    p = _proposer(pair)
    runner = FakeRunner()
    runner.add("a", _prompt(pair, " the keeper of the"))
    runner.add("b", _prompt(pair, " a small house"))
    drafts = runner.step(p, {})
    shared = set(p.mapping.target_ids.tolist())
    for d in drafts.values():
        assert len(d) == 3 and set(d) <= shared
    assert p.take_last_draft_probs() is None, "all-greedy batches hand no q"
    assert p.num_request_states == 2 and p.runtime.num_requests == 2


def test_the_catch_up_outlook_counts_what_the_drafter_would_catch_up_on_and_the_tokens_left(pair):
    """Beyond the k + 1 tokens a drafting row gains a step: a new request's whole prompt, none right after a
    drafted step, then what the request gained while it drafted nothing (the controller weighs it against
    what drafting would save over the tokens left to max_tokens, 40 here)."""
    p = _proposer(pair)  # k = 3
    runner = FakeRunner()
    prompt = _prompt(pair, " the keeper of the small house by the river")
    runner.add("a", prompt, sampling(max_tokens=40))

    def outlook() -> tuple[int, float]:
        ids = runner.input_batch.req_ids
        return p.requests.catch_up_outlook(ids, [runner.history[r][-1:] for r in ids],
                                           np.array([len(runner.history[r]) for r in ids]),
                                           lambda req_id: compat.request_sampling(runner, req_id))

    assert outlook() == (len(prompt) - 4, 40) and len(prompt) > 4
    runner.step(p, {})
    assert outlook() == (0, 40)
    runner.history["a"].extend(prompt[:10])
    assert outlook() == (10 - 4, 30)


def test_a_request_drafts_from_the_step_after_the_one_its_prefill_ended_in(pair):
    """vLLM first calls propose for a request with its prompt and its first token. Requests sent together reach
    the engine one by one, so that step may hold the first of them alone: its drafter would catch up on its
    prompt for a batch about to grow. With adaptive_length (the controller prices catch-ups; at a fixed k every
    step drafts) it drafts from its next step; a request already drafting drafts on."""
    p = _proposer(pair, adaptive_length=True)  # without start-up timings: every length costs alike, k is best
    runner = FakeRunner()
    runner.add("a", _prompt(pair, " the keeper of the"))  # already decoding: its history is its context
    drafts = runner.step(p, {})
    assert len(drafts["a"]) == 3

    def outlook() -> tuple[int, float]:
        ids = runner.input_batch.req_ids
        return p.requests.catch_up_outlook(ids, [runner.history[r][-1:] for r in ids],
                                           np.array([len(runner.history[r]) for r in ids]),
                                           lambda req_id: compat.request_sampling(runner, req_id))

    prompt = _prompt(pair, " a small house by the river and the light")
    runner.add("b", prompt)  # its prefill ends this step, with its first token
    first, second = (int(t) for t in p.mapping.target_ids[5:7])
    runner.history["b"].append(first)
    runner.history["a"].extend(drafts["a"][:1])
    assert outlook() == (0, 1000 - 1), "b is left out of the catch-up while its prefill just ended"
    drafts = runner.step(p, {})
    assert len(drafts["a"]) == 3 and drafts["b"] == [] and p.requests.get("b") is None
    runner.history["b"].append(second)
    runner.history["a"].extend(drafts["a"][:1])
    assert outlook() == (len(prompt) + 2 - 4, (1000 - 2 + 1000 - 2) / 2)
    drafts = runner.step(p, {})
    assert len(drafts["a"]) == 3 and len(drafts["b"]) == 3
    fixed, alone = _proposer(pair), FakeRunner()  # adaptive_length false
    alone.add("b", prompt)
    alone.history["b"].append(first)
    assert len(alone.step(fixed, {})["b"]) == 3, "at a fixed k a request drafts from its first output token"


def test_sampled_rows_get_q_aligned_with_the_batch(pair):
    p = _proposer(pair)
    runner = FakeRunner()
    runner.add("g", _prompt(pair, " the keeper"), sampling(0.0))
    runner.add("s", _prompt(pair, " the keeper"), sampling(0.8, top_p=0.9))
    runner.add("t", _prompt(pair, " it was"), sampling(1.2, top_k=5))
    drafts = runner.step(p, {})
    q = p.take_last_draft_probs()
    assert q is not None and q.shape == (3, 3, p.target_vocab_size) and q.dtype == torch.float32
    for row, req in enumerate(["g", "s", "t"]):
        for j, tok in enumerate(drafts[req]):
            assert abs(float(q[row, j].sum()) - 1) < 1e-4
            assert q[row, j, tok] > 0, "q(draft) must be positive"
    assert torch.equal(q[0, :, :].max(-1).values, torch.ones(3)), "greedy row in a mixed batch: one-hot q"
    assert int((q[2, 0] > 0).sum()) <= 5, "top-k=5 leaves at most 5 tokens"
    assert p.take_last_draft_probs() is None, "q is handed over once"


def test_accepted_drafts_reuse_the_drafter_kv(pair):
    p = _proposer(pair)
    runner = FakeRunner()
    runner.add("a", _prompt(pair, " the keeper of the light"))
    drafts = runner.step(p, {})
    committed = len(p.requests.get("a").translator.draft_ids)
    calls = []
    real = p.runtime.forward
    p.runtime.forward = lambda ids, keep, new: calls.append((list(keep), [list(t) for t in new])) or real(ids, keep, new)
    bonus = next(t for t in p.mapping.target_ids.tolist() if t != drafts["a"][2])
    runner.step(p, {"a": drafts["a"][:2] + [bonus]})  # two drafts accepted, then the bonus token
    keep, new = calls[0]
    # KV of the two accepted drafts is kept; only the bonus token is run
    assert keep == [committed + 2] and new == [[int(p.mapping.target_to_draft[bonus])]]


def test_finished_and_preempted_requests_are_freed_and_rebuilt(pair):
    p = _proposer(pair)
    runner = FakeRunner()
    for r, text in (("a", " the keeper"), ("b", " a small"), ("c", " it was")):
        runner.add(r, _prompt(pair, text))
    first = runner.step(p, {})
    assert p.num_request_states == 3
    runner.remove("a")
    runner.step(p, {"b": first["b"][:1], "c": first["c"][:1]}, finished={"a"})
    assert p.num_request_states == 2 and not p.runtime.has("a")
    # "b" is preempted (leaves the batch), then resumes from its full history
    runner.input_batch.req_ids.remove("b")
    runner.step(p, {"c": [first["c"][1]]}, preempted={"b"})
    assert p.num_request_states == 1 and not p.runtime.has("b")
    runner.input_batch.req_ids.append("b")
    resumed = runner.step(p, {"c": [first["c"][2]]})
    fresh = _proposer(pair)
    solo = FakeRunner()
    solo.add("b", runner.history["b"])
    assert resumed["b"] == solo.step(fresh, {})["b"], "a resumed request drafts as if new"
    assert p.num_request_states == 2


def test_prefill_rows_and_drafter_context_limit(pair):
    p = _proposer(pair, drafter_max_model_len=24)
    runner = FakeRunner()
    runner.add("short", _prompt(pair, " the"))
    runner.add("long", _prompt(pair, " the keeper of the light walked down to the shore and the boat"))
    runner.add("chunk", _prompt(pair, " a"))
    drafts = runner.step(p, {}, prefill={"chunk"})
    assert drafts["short"] and drafts["long"] == [] and drafts["chunk"] == []
    assert not p.runtime.has("long") and p.counters["skipped_context_full"] == 1
    drafts = runner.step(p, {"short": drafts["short"][:1], "long": [5]})
    assert drafts["long"] == [] and p.counters["skipped_context_full"] == 1, "not re-translated every step"
    runner.remove("long")
    runner.step(p, {"short": [5]}, finished={"long"})
    runner.add("long", _prompt(pair, " the"))  # the id again, a new request: not held to the old one's limit
    assert runner.step(p, {"short": [5]})["long"]


def test_a_step_with_more_rows_than_drafter_max_num_seqs_drafts_nothing(pair):
    """Issue 39, finding 4: usd.drafter_max_num_seqs bounds the q buffer and the drafter's requests; a step
    with more rows drafts nothing (and fails nothing), and drafting resumes once the rows fit."""
    p = _proposer(pair, drafter_max_num_seqs=2, draft_mode="tli")
    assert p._q_buffer.max_rows == 2 and p.runtime._max_requests == 2
    runner = FakeRunner()
    for r in "abc":
        runner.add(r, _prompt(pair, " the keeper"))
    drafts = runner.step(p, {})
    assert not any(drafts.values()) and p.counters["length_0"] == 3 and not p.failures.by_reason
    runner.remove("a")
    drafts = runner.step(p, {}, finished={"a"})
    assert all(drafts[r] for r in "bc"), "two rows fit: both draft"


def test_drafter_max_num_seqs_defaults_to_vllms_bounded(pair):
    from vllm_usd.config import DEFAULT_DRAFTER_MAX_NUM_SEQS

    target, drafter = pair
    for seqs, rows in ((8, 8), (1024, DEFAULT_DRAFTER_MAX_NUM_SEQS)):
        p = UniversalProposer(vllm_config(target, {"drafter": drafter}, max_num_seqs=seqs))
        assert p._q_buffer.max_rows == p.runtime._max_requests == rows


def test_a_finish_the_proposer_never_saw_does_not_keep_the_drafter_slot(pair):
    """vLLM runs a step with no scheduled tokens between two ``generate`` calls: it carries the last
    request's finish and calls no propose. With one drafter slot, the next request must still get
    it: every request the runner no longer holds is dropped, even when the next one takes its place."""
    p = _proposer(pair, drafter_max_num_seqs=1)
    runner = FakeRunner()
    runner.add("a", _prompt(pair, " the keeper"))
    assert runner.step(p, {})["a"]
    runner.remove("a")  # finished, and the step that said so never reached propose
    runner.add("b", _prompt(pair, " it was"))
    assert runner.step(p, {})["b"], "the finished request's slot went to the new one"
    assert not p.runtime.has("a") and p.counters["skipped_no_memory"] == 0


def test_a_failing_step_returns_no_drafts_and_recovers(pair, monkeypatch):
    p = _proposer(pair)
    runner = FakeRunner()
    runner.add("a", _prompt(pair, " the keeper"))
    runner.add("b", _prompt(pair, " it was"), sampling(0.9))

    def boom(*args, **kwargs):
        raise RuntimeError("drafter exploded")

    monkeypatch.setattr(p.runtime, "forward", boom)
    drafts = runner.step(p, {})
    assert drafts == {"a": [], "b": []} and p.take_last_draft_probs() is None
    assert p.counters["failed_steps"] == 1 and p.num_request_states == 0
    monkeypatch.undo()
    drafts = runner.step(p, {"a": [5], "b": [6]})
    assert drafts["a"] and drafts["b"]


def test_seeded_requests_draft_reproducibly(pair):
    out = []
    for _ in range(2):
        p = _proposer(pair)
        runner = FakeRunner()
        runner.add("x", _prompt(pair, " the keeper"), sampling(1.0, seed=42))
        runner.add("y", _prompt(pair, " it was"), sampling(1.0))
        out.append(runner.step(p, {})["x"])
    assert out[0] == out[1]


def test_no_drafts_once_max_tokens_is_reached(pair):
    p = _proposer(pair)
    runner = FakeRunner()
    runner.add("short", _prompt(pair, " the keeper"), sampling(0.0, max_tokens=2))
    runner.add("long", _prompt(pair, " it was"), sampling(0.0, max_tokens=50))
    drafts = runner.step(p, {"short": [5], "long": [6]})  # first output token
    assert drafts["short"] and drafts["long"]
    drafts = runner.step(p, {"short": [7], "long": [8]})  # "short" now has its 2 tokens: it ends
    assert drafts["short"] == [] and drafts["long"]
    assert not p.runtime.has("short") and p.num_request_states == 1


def _two_ranks(pair, cls) -> list[list[str]]:
    """Two proposers fed the same steps, as two tensor-parallel ranks are. Returns their digests."""
    digests = []
    for rank in (0, 1):
        p = _proposer(pair, cls=cls, debug_digests=True)
        p.rank = rank
        runner = FakeRunner()
        runner.add("greedy", _prompt(pair, " the keeper"), sampling(0.0))
        runner.add("free", _prompt(pair, " it was"), sampling(1.0))
        runner.add("seeded", _prompt(pair, " a small house"), sampling(0.8, top_p=0.9, seed=7))
        drafts = runner.step(p, {})
        for _ in range(3):  # accept the first draft of each row, then draft again
            drafts = runner.step(p, {r: d[:1] for r, d in drafts.items()})
        digests.append(p.digests)
    return digests


def test_ranks_draw_identical_drafts_and_q(pair):
    """No global or rank-local RNG: what a rank drafts depends only on what all ranks see."""
    rank0, rank1 = _two_ranks(pair, UniversalProposer)
    assert len(rank0) == 4 and rank0 == rank1


def test_digests_catch_rank_local_randomness(pair):
    """Planted bug (tests.faults.RankRngProposer): rank-dependent drafting randomness. The digests must differ."""
    rank0, rank1 = _two_ranks(pair, RankRngProposer)
    assert len(rank0) == 4 and rank0 != rank1


def test_unseeded_drafts_do_not_depend_on_earlier_steps(pair):
    """Drafting seeds come from (request, position), not from a generator's running state."""
    out = []
    for warmup in (False, True, False):
        p = _proposer(pair, seed=0 if len(out) < 2 else 1)
        runner = FakeRunner()
        if warmup:  # another request drafted first: a stateful RNG would have moved on
            runner.add("other", _prompt(pair, " the keeper"), sampling(1.0))
            runner.step(p, {})
            runner.remove("other")
        runner.add("free", _prompt(pair, " it was"), sampling(1.0))
        runner.add("free2", _prompt(pair, " a small house"), sampling(1.0))
        drafts = runner.step(p, {}, finished={"other"} if warmup else ())
        out.append((drafts["free"], drafts["free2"]))
    assert out[0] == out[1]
    assert out[2] != out[0], "power check: another usd.seed must draw other drafts"
