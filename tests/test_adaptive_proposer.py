"""UniversalProposer with the draft-length policy (usd.adaptive_length), against a fake runner. No engine."""

from __future__ import annotations

import dataclasses

import torch

from tests.fakes import FakeRunner, sampling, vllm_config
from vllm_usd import UniversalProposer
from vllm_usd.drafting import DraftLengthPolicy, FixedLength

# costs under which lengths 1..3 compete on the tiny pair at batch 3 (never compute-bound)
VARYING = {"draft_cost": 0.05, "compute_bound_tokens": 100.0}


def _pair():
    from tests.fixtures import tiny

    return tiny.build_distribution_pair()


def _proposer(**usd):
    """TLI for every request (these test the policy's lengths; test_string_drafting.py tests string rows)."""
    target, drafter = _pair()
    return UniversalProposer(vllm_config(target, {"drafter": drafter, "draft_mode": "tli", **usd}, k=3))


def _prompt(text):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_pair()[0])(text).input_ids


def _force(p, table: dict[str, int]) -> None:
    """The policy gives these lengths (and so may draft at any batch size)."""
    p.policy.lengths = lambda req_ids, batch, extra_forwards=0, kind="": [table[r] for r in req_ids]
    p.policy.may_draft = lambda batch: True


def _spy_forwards(p) -> list[list[str]]:
    calls: list[list[str]] = []
    real, real_next = p.runtime.forward, p.runtime.forward_next
    p.runtime.forward = lambda ids, keep, new: calls.append(list(ids)) or real(ids, keep, new)
    p.runtime.forward_next = lambda ids, keep, tokens: calls.append(list(ids)) or real_next(ids, keep, tokens)
    return calls


def test_policy_on_by_default_and_off_gives_fixed_k():
    assert isinstance(_proposer().policy, DraftLengthPolicy)
    assert isinstance(_proposer(adaptive_length=False).policy, FixedLength)
    assert _proposer().stats()["draft_cost"] == 0.25, "tiny pair: drafter and target are the same size"


def test_rows_get_the_policys_lengths_and_length_0_rows_cost_no_forward():
    p = _proposer()
    runner = FakeRunner()
    for r, text, params in (("a", " the keeper", sampling(0.0)), ("b", " it was", sampling(0.0)),
                            ("c", " a small house", sampling(0.9, seed=3)), ("d", " the boat", sampling(1.0))):
        runner.add(r, _prompt(text), params)
    _force(p, {"a": 3, "b": 0, "c": 1, "d": 2})
    calls = _spy_forwards(p)
    drafts = runner.step(p, {})
    assert {r: len(d) for r, d in drafts.items()} == {"a": 3, "b": 0, "c": 1, "d": 2}
    # longest first; a row leaves the drafter's batch once it has its drafts; "b" never enters it
    assert calls == [["a", "d", "c"], ["a", "d"], ["a"]]
    q = p.take_last_draft_probs()
    assert q is not None and q.shape == (4, 3, p.target_vocab_size)
    for row, req in enumerate("abcd"):
        for j, tok in enumerate(drafts[req]):
            assert abs(float(q[row, j].sum()) - 1) < 1e-4 and q[row, j, tok] > 0, (req, j)
    assert torch.equal(q[0].max(-1).values, torch.ones(3)), "greedy row: one-hot q"
    counters = p.stats()["counters"]
    assert [counters[f"length_{n}"] for n in range(4)] == [1, 1, 1, 1] and counters["drafted_rows"] == 3

    fixed = _proposer(adaptive_length=False)
    solo = FakeRunner()
    solo.add("a", runner.history["a"])
    assert drafts["a"] == solo.step(fixed, {})["a"], "a greedy row's drafts do not depend on the others' lengths"


def test_a_request_skipped_for_steps_drafts_as_if_fresh():
    """While a request gets no drafts its drafter cache falls behind: it must be caught up, not trusted."""
    p = _proposer()
    runner = FakeRunner()
    runner.add("a", _prompt(" the keeper of the light"))
    _force(p, {"a": 3})
    first = runner.step(p, {})["a"]
    other = [t for t in p.mapping.target_ids.tolist() if t not in first]
    _force(p, {"a": 0})
    assert runner.step(p, {"a": [other[0]]})["a"] == []  # first draft rejected, then skipped
    assert runner.step(p, {"a": [other[1]]})["a"] == []
    _force(p, {"a": 3})
    resumed = runner.step(p, {"a": [other[2]]})["a"]
    fresh, solo = _proposer(adaptive_length=False), FakeRunner()
    solo.add("a", runner.history["a"])
    assert resumed == solo.step(fresh, {})["a"]


def test_fixed_length_drafts_exactly_as_a_policy_that_always_says_k():
    def run(**usd):
        p = _proposer(debug_digests=True, **usd)
        if usd.get("adaptive_length", True):
            _force(p, {"g": 3, "s": 3, "t": 3})
        runner = FakeRunner()
        runner.add("g", _prompt(" the keeper"), sampling(0.0))
        runner.add("s", _prompt(" it was"), sampling(0.8, top_p=0.9))
        runner.add("t", _prompt(" a small"), sampling(1.2, top_k=5, seed=9))
        out = [runner.step(p, {})]
        for _ in range(3):
            out.append(runner.step(p, {r: d[:2] for r, d in out[-1].items()}))
        return out, p.digests

    assert run(adaptive_length=False) == run()


def _ranks(rank_count: int = 2):
    """Proposers fed the same steps, as tensor-parallel ranks are; the policy on. Returns their steps."""
    out = []
    for rank in range(rank_count):
        p = _proposer(debug_digests=True, **VARYING)
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
    per_step = {len(d) for step in steps0 for d in step.values()}
    assert len(per_step) >= 2, f"the power check needs lengths that vary: {lengths0}"


# -- usd.cost_calibration_steps: the policy's costs measured (the default) --------------------------
def _loaded(**usd):
    """A proposer after vLLM's load_model (which times the drafter where the costs are measured)."""
    p = _proposer(**usd)
    p.load_model(torch.nn.Linear(64, 64))
    return p


def _serve(p, steps: int, lengths: dict[str, int] | None = None) -> list[dict[str, list[int]]]:
    """``steps`` engine steps of three greedy requests; the policy's own lengths unless ``lengths``."""
    runner = FakeRunner()
    for r, text in (("a", " the keeper"), ("b", " it was"), ("c", " a small house")):
        runner.add(r, _prompt(text), sampling(0.0))
    if lengths is not None:
        _force(p, lengths)
    out = [runner.step(p, {})]
    for _ in range(steps - 1):
        out.append(runner.step(p, {r: d[:1] or runner.history[r][-1:] for r, d in out[-1].items()}))
    return out


def test_costs_are_measured_by_default_and_nothing_is_drafted_before():
    p = _loaded(probe_interval=1)
    timing = p.stats()["drafter_timing"]
    assert timing is not None and timing["per_forward"] + timing["per_request"] > 0, "the drafter was timed"
    assert p.policy.costs_pending
    configured = p.policy.costs
    steps = _serve(p, 47)
    assert all(d == [] for step in steps for d in step.values()), "no drafts while the costs are measured"
    assert not p.stats()["costs_measured"] and p.policy.costs == configured
    _serve(p, 1)
    stats = p.stats()
    assert stats["costs_measured"] and not p.policy.costs_pending and p.policy.costs != configured, stats["costs"]
    costs = stats["costs"]
    assert all(0 <= v < float("inf") for k, v in costs.items()
               if k not in ("measured_tokens", "draft_forward_points")), costs
    assert costs["draft_forward_points"] and all(0 < c < float("inf") for _, c in costs["draft_forward_points"]), costs
    assert stats["costs"]["draft_forward_cost"] + stats["costs"]["draft_cost"] > 0, "priced from the timing"


def test_configured_costs_are_not_measured():
    for usd in ({"draft_cost": 0.1}, {"cost_calibration_steps": 0}):
        p = _loaded(**usd)
        configured = p.policy.costs
        assert not p.policy.costs_pending and p.stats()["drafter_timing"] is None, usd
        _serve(p, 120, {"a": 3, "b": 1, "c": 2})
        assert not p.stats()["costs_measured"] and p.policy.costs == configured, usd


def test_every_rank_takes_rank_0s_drafter_timing_and_costs(monkeypatch):
    """Each rank fits its own timings, but uses what the broadcasts return: rank 0's."""
    from vllm_usd.drafting import StepCostModel
    from vllm_usd.drafting.drafter_timing import DrafterTiming
    from vllm_usd.vllm_adapter import compat

    timing0 = DrafterTiming(per_forward=0.5, per_request=0.25)
    rank0 = StepCostModel(draft_cost=0.5, verify_token_cost=0.01, compute_bound_tokens=1e9, draft_forward_cost=0.2)
    sent = []
    monkeypatch.setattr(compat, "computed_on_tp_rank0", lambda compute: timing0)
    monkeypatch.setattr(compat, "tp_broadcast_from_rank0",
                        lambda obj: sent.append(obj) or (rank0, frozenset({0}), frozenset({3})))
    p = _loaded(cost_calibration_steps=40)
    assert p.drafter_timing == timing0 and p._calibration.drafter == timing0
    _serve(p, 40)
    assert len(sent) == 1 and isinstance(sent[0][0], StepCostModel), "this rank's own fit went to the broadcast once"
    assert p.policy.costs == rank0 and p.stats()["costs_measured"]
    assert p.policy.slower_buckets == {0} and p.stats()["slower_buckets"] == [0], "and rank 0's measured verdicts"
    assert p.policy.unmeasured_plain_buckets == {3}
    _serve(p, 40)
    assert len(sent) == 2, "the next fit is due at twice the steps"


def test_a_batch_size_where_no_length_pays_costs_no_per_request_work():
    """Costs under which even perfect acceptance loses: no row is translated or drafted, and a later
    step where drafting pays starts the requests as new ones."""
    p = _proposer(draft_cost=50.0)
    runner = FakeRunner()
    for r, text in (("a", " the keeper"), ("b", " it was")):
        runner.add(r, _prompt(text), sampling(0.0))
    calls = _spy_forwards(p)
    for _ in range(3):
        assert all(d == [] for d in runner.step(p, {}).values())
    counters = p.stats()["counters"]
    assert calls == [] and len(p.requests) == 0, "no request state was built"
    assert counters["no_length_pays_steps"] == 3 and counters["length_0"] == 6
    p.policy.costs = dataclasses.replace(p.policy.costs, draft_cost=0.001)
    assert any(runner.step(p, {}).values()), "where drafting pays again, the requests draft"
    assert len(p.requests) == 2


def test_whole_cycles_are_recorded_as_drafted_or_not():
    from vllm_usd.drafting.step_rates import bucket

    p = _loaded(cost_calibration_steps=1000)
    _serve(p, 40, {"a": 0, "b": 0, "c": 0})
    rates = p._calibration.rates
    assert rates.rate(bucket(3), False) is not None and rates.rate(bucket(3), True) is None
    _serve(p, 40, {"a": 2, "b": 1, "c": 2})
    assert rates.rate(bucket(3), True) is not None, "steps that verified drafts count as drafted cycles"
