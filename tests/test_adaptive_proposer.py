"""UniversalProposer with the draft-length controller (usd.adaptive_length), against a fake runner. No engine."""

from __future__ import annotations

import torch

from tests.fakes import FakeRunner, sampling, vllm_config
from vllm_usd import UniversalProposer
from vllm_usd.drafting import DraftLengthController, FixedLength, StartupTimings


def _pair():
    from tests.fixtures import tiny

    return tiny.build_distribution_pair()


def _proposer(**usd):
    """TLI for every request (these test the lengths; test_string_drafting.py tests string rows)."""
    target, drafter = _pair()
    return UniversalProposer(vllm_config(target, {"drafter": drafter, "draft_mode": "tli", **usd}, k=3))


def _prompt(text):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_pair()[0])(text).input_ids


def _force(p, length: int) -> None:
    """The controller gives this length to every step."""
    p.controller.length = lambda batch, catch_up=None, greedy=0: length


def _spy_forwards(p) -> list[list[str]]:
    calls: list[list[str]] = []
    real, real_next = p.runtime.forward, p.runtime.forward_next
    p.runtime.forward = lambda ids, keep, new: calls.append(list(ids)) or real(ids, keep, new)
    p.runtime.forward_next = lambda ids, keep, tokens: calls.append(list(ids)) or real_next(ids, keep, tokens)
    return calls


def test_controller_on_by_default_and_off_gives_fixed_k():
    assert isinstance(_proposer().controller, DraftLengthController)
    assert isinstance(_proposer(adaptive_length=False).controller, FixedLength)


def test_every_row_gets_the_steps_length_and_length_0_costs_no_per_request_work():
    p = _proposer()
    runner = FakeRunner()
    for r, text, params in (("a", " the keeper", sampling(0.0)), ("b", " it was", sampling(0.0)),
                            ("c", " a small house", sampling(0.9, seed=3)), ("d", " the boat", sampling(1.0))):
        runner.add(r, _prompt(text), params)
    calls = _spy_forwards(p)
    _force(p, 0)
    assert all(d == [] for d in runner.step(p, {}).values())
    assert calls == [] and len(p.requests) == 0, "no forward and no request state at length 0"
    _force(p, 2)
    drafts = runner.step(p, {})
    assert {r: len(d) for r, d in drafts.items()} == {"a": 2, "b": 2, "c": 2, "d": 2}
    assert calls == [list("abcd"), list("abcd")], "one batched forward per position"
    q = p.take_last_draft_probs()
    assert q is not None and q.shape == (4, 3, p.target_vocab_size)
    for row, req in enumerate("abcd"):
        for j, tok in enumerate(drafts[req]):
            assert abs(float(q[row, j].sum()) - 1) < 1e-4 and q[row, j, tok] > 0, (req, j)
    counters = p.stats()["counters"]
    assert counters["length_0"] == 4 and counters["length_2"] == 4 and counters["drafted_rows"] == 4


def test_a_request_skipped_for_steps_drafts_as_if_fresh():
    """While a request gets no drafts its drafter cache falls behind: it must be caught up, not trusted."""
    p = _proposer()
    runner = FakeRunner()
    runner.add("a", _prompt(" the keeper of the light"))
    _force(p, 3)
    first = runner.step(p, {})["a"]
    other = [t for t in p.mapping.target_ids.tolist() if t not in first]
    _force(p, 0)
    assert runner.step(p, {"a": [other[0]]})["a"] == []  # first draft rejected, then skipped
    assert runner.step(p, {"a": [other[1]]})["a"] == []
    _force(p, 3)
    resumed = runner.step(p, {"a": [other[2]]})["a"]
    fresh, solo = _proposer(adaptive_length=False), FakeRunner()
    solo.add("a", runner.history["a"])
    assert resumed == solo.step(fresh, {})["a"]


def test_fixed_length_drafts_exactly_as_a_controller_that_always_says_k():
    def run(**usd):
        p = _proposer(debug_digests=True, **usd)
        if usd.get("adaptive_length", True):
            _force(p, 3)
        runner = FakeRunner()
        runner.add("g", _prompt(" the keeper"), sampling(0.0))
        runner.add("s", _prompt(" it was"), sampling(0.8, top_p=0.9))
        runner.add("t", _prompt(" a small"), sampling(1.2, top_k=5, seed=9))
        out = [runner.step(p, {})]
        for _ in range(3):
            out.append(runner.step(p, {r: d[:2] for r, d in out[-1].items()}))
        return out, p.digests

    assert run(adaptive_length=False) == run()


def _loaded(**usd):
    """A proposer after vLLM's load_model (which times the drafter and the target)."""
    p = _proposer(**usd)
    p.load_model(torch.nn.Linear(64, 64))
    return p


def _serve(p, steps: int, accept: dict[str, int] | None = None) -> list[dict[str, list[int]]]:
    """``steps`` engine steps of three requests, accepting ``accept[r]`` drafts of each (default 1)."""
    runner = FakeRunner()
    for r, text, params in (("a", " the keeper", sampling(0.0)), ("b", " it was", sampling(1.0)),
                            ("c", " a small house", sampling(0.8, top_p=0.9, seed=7))):
        runner.add(r, _prompt(text), params)
    accept = accept or {}
    out = [runner.step(p, {})]
    for _ in range(steps - 1):
        out.append(runner.step(p, {r: d[:accept.get(r, 1)] or runner.history[r][-1:] for r, d in out[-1].items()}))
    return out


def test_load_model_times_the_drafter_and_it_drafts_from_the_first_step():
    """The fake target cannot run under vLLM's forward context: its timing is left out, with a warning, and
    every length starts at one cost (the controller then decides from measured cycles)."""
    p = _loaded()
    timings = p.controller.timings
    assert timings.target == () and [b for b, _ in timings.drafter][:3] == [1, 2, 4]
    assert [n for n, _ in timings.drafter_prefill] == [2, 4, 8, 32, 128], "a new request's first forward, timed"
    steps = _serve(p, 40)
    assert all(len(d) == 3 for d in steps[0].values()), "drafts from the first step: k has the most tokens"
    state = p.stats()["controller"]
    assert state["cost_scale"] and "3" in {key.split("/")[1] for key in state["cost_scale"]}, state
    assert p.stats()["controller_summary"][0].startswith("batch 2-3: "), p.stats()["controller_summary"]


def test_every_rank_takes_rank_0s_startup_timings_and_measured_costs(monkeypatch):
    from vllm_usd.vllm_adapter import compat

    rank0 = StartupTimings(target=((1, 0.1), (16, 0.1)), drafter=((1, 0.5), (4, 0.5)), drafter_prefill=((32, 0.7),),
                           verify=((1, 0.3),))
    shared = {(1, 0): (1.0, 8), (1, 1): (9.0, 8), (1, 2): (9.0, 8), (1, 3): (9.0, 8)}
    monkeypatch.setattr(compat, "computed_on_tp_rank0", lambda compute: (rank0.drafter, rank0.drafter_prefill))
    monkeypatch.setattr(compat, "tp_broadcast_from_rank0", lambda obj: (rank0.target, rank0.verify))
    monkeypatch.setattr(compat, "tp_vote", lambda flag, payload=None: (
        flag, None if payload is None else {"cells": shared, "loss": {}}))
    p = _loaded()
    assert p.controller.timings == rank0
    steps = _serve(p, 32)
    assert p.controller.shared == shared, "rank 0's table, not this rank's"
    assert all(d == [] for step in steps[8:] for d in step.values()), \
        "from the first share on, drafting is 9x dearer in rank 0's table: no drafts (exploring waits 9x longer)"


def _ranks(rank_count: int = 2):
    """Proposers fed the same steps, as tensor-parallel ranks are; the policy on. Returns their steps."""
    out = []
    for rank in range(rank_count):
        p = _proposer(debug_digests=True, confidence_stop=0.3)
        p.rank = rank
        runner = FakeRunner()
        runner.add("greedy", _prompt(" the keeper"), sampling(0.0))
        runner.add("free", _prompt(" it was"), sampling(1.0))
        runner.add("seeded", _prompt(" a small house"), sampling(0.8, top_p=0.9, seed=7))
        accept = {"greedy": 3, "free": 1, "seeded": 0}
        steps = [runner.step(p, {})]
        for _ in range(10):
            steps.append(runner.step(p, {r: d[:accept[r]] or runner.history[r][-1:] for r, d in steps[-1].items()}))
        out.append((steps, p.digests, {k: v for k, v in p.counters.items() if k.startswith("length_")}))
    return out


def test_ranks_choose_identical_lengths_drafts_and_q():
    (steps0, digests0, lengths0), (steps1, digests1, lengths1) = _ranks()
    assert steps0 == steps1 and digests0 == digests1 and lengths0 == lengths1
    per_row = {len(d) for step in steps0 for d in step.values()}
    assert len(per_row) >= 2, f"the power check needs lengths that vary (the confidence stop): {lengths0}"


def test_the_confidence_stop_cuts_drafts_and_leaves_q_as_it_was():
    """The same steps with the stop off and at 0.5: each row's drafts with the stop are a prefix of
    those without, and the q of every kept draft is the one it was drawn from without the stop."""
    def run(stop: float) -> list:
        p = _proposer(confidence_stop=stop)
        runner = FakeRunner()
        runner.add("g", _prompt(" the keeper"), sampling(0.0))
        runner.add("s", _prompt(" it was"), sampling(1.0, seed=5))
        runner.add("t", _prompt(" a small house"), sampling(0.8, top_p=0.9, seed=7))
        _force(p, 3)
        steps = []
        for _ in range(4):
            drafts = runner.step(p, {r: d[:1] for r, d in (steps[-1][0] if steps else {}).items()})
            steps.append((drafts, p.take_last_draft_probs().clone()))
        return steps

    full, cut = run(0.0), run(0.5)
    shortened = 0
    for (drafts, q), (cut_drafts, cut_q) in zip(full, cut):
        for row, req in enumerate(drafts):
            kept = cut_drafts[req]
            assert kept == drafts[req][:len(kept)] and kept, (req, drafts[req], kept)
            shortened += len(kept) < len(drafts[req])
            assert torch.equal(q[row, :len(kept)], cut_q[row, :len(kept)]), req
    assert shortened > 0, "power: the stop cut some drafts at 0.5"


def _count_collectives(monkeypatch) -> list[str]:
    """Every tensor-parallel collective the proposer calls from now on, by name (each does what it does
    without tensor parallelism)."""
    from vllm_usd.vllm_adapter import compat

    calls: list[str] = []
    for name in ("tp_vote", "tp_any", "tp_broadcast_from_rank0", "computed_on_tp_rank0"):
        real = getattr(compat, name)
        monkeypatch.setattr(compat, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    return calls


def test_a_step_makes_one_collective_and_it_carries_rank_0s_costs_every_share_every_steps(monkeypatch):
    """Issue 39, finding 9: under tensor parallelism a step made two collectives (the failure vote, and
    every SHARE_EVERY steps the costs' broadcast). Now one: the vote, carrying the costs where due."""
    from vllm_usd.drafting.controller import SHARE_EVERY
    from vllm_usd.vllm_adapter import compat

    monkeypatch.setattr(compat, "tp_size", lambda: 2)  # two ranks: costs travel every SHARE_EVERY steps
    p = _loaded()
    runner = FakeRunner()
    runner.add("a", _prompt(" the keeper"), sampling(0.0))
    calls = _count_collectives(monkeypatch)
    carried = []
    vote = compat.tp_vote
    monkeypatch.setattr(compat, "tp_vote", lambda flag, payload=None: carried.append(payload is not None)
                        or vote(flag, payload))
    drafts = runner.step(p, {})
    for step in range(1, 2 * SHARE_EVERY):
        assert len(calls) == step, calls
        drafts = runner.step(p, {"a": drafts["a"][:1] or [5]})
    assert calls == ["tp_vote"] * 2 * SHARE_EVERY, "one collective a step"
    assert carried == ([False] * (SHARE_EVERY - 1) + [True]) * 2, "rank 0's costs ride on every 8th"
    assert p.controller.shared, "taken from the vote"


def test_a_controller_failure_drops_the_step_and_the_vote_still_happens(monkeypatch):
    """Planted: the controller's bookkeeping raises. The step goes without drafts, the failure is counted,
    and the step's one collective is still called at every step (a rank that skipped it would hang the rest)."""
    p = _proposer()
    runner = FakeRunner()
    runner.add("a", _prompt(" the keeper"), sampling(0.0))
    calls = _count_collectives(monkeypatch)

    def broken(*args):
        raise RuntimeError("planted")

    p.controller.observe = broken
    for _ in range(3):
        assert runner.step(p, {}) == {"a": []}
    assert calls == ["tp_vote"] * 3 and p.stats()["failures"] == {"RuntimeError": 3}, (calls, p.stats()["failures"])


def test_the_startup_stand_in_for_verifying_sampled_drafts_draws_from_the_targets_probabilities():
    """``verify_sampled``, timed at start-up as what vLLM's rejection sampler adds per sampled drafted row, does
    that row's work: a token drawn from the softmax of its logits. A dominant logit is always drawn; two equal
    logits are each drawn about half of 2,000 times (|count - 1,000| < 110: 4.9 sd of a binomial, a false
    alarm about once in a million runs), and a -inf one never. Planted: an argmax of the probabilities (no
    draw) returns the first of the two every time."""
    from vllm_usd.vllm_adapter.target_timing import verify_sampled

    assert verify_sampled(torch.tensor([[0.0, 30.0, 0.0], [30.0, 0.0, 0.0]])).tolist() == [1, 0]
    draws = verify_sampled(torch.tensor([[0.0, 0.0, float("-inf")]] * 2000))
    counts = torch.bincount(draws, minlength=3).tolist()
    assert counts[2] == 0 and abs(counts[0] - 1000) < 110, counts
    planted = torch.tensor([[0.0, 0.0, float("-inf")]] * 2000).softmax(-1).argmax(-1)
    assert abs(torch.bincount(planted, minlength=3)[0].item() - 1000) >= 110, "the planted bug is caught"
