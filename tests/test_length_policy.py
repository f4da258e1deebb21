"""DraftLengthPolicy on synthetic acceptance and cost streams. No model, no engine."""

from __future__ import annotations

import pytest

from vllm_usd.drafting.length_policy import (DraftLengthPolicy, FixedLength, StepCostModel,
                                             draft_cost_from_weights, measured_cost)

K = 4
CHEAP = StepCostModel(draft_cost=0.02, verify_token_cost=0.045, compute_bound_tokens=5)
COMPUTE_BOUND = StepCostModel(draft_cost=0.0, verify_token_cost=0.045, compute_bound_tokens=1)


def _step(policy: DraftLengthPolicy, accepted: dict[str, int], batch: int = 1):
    """One engine step: choose lengths, then report ``accepted[r]`` accepted drafts (capped by the length)."""
    req_ids = list(accepted)
    lengths = policy.lengths(req_ids, batch)
    drafted = [r for r, n in zip(req_ids, lengths) if n]
    policy.drafted(drafted, [n for n in lengths if n])
    policy.observe(req_ids, [[0] * (1 + min(accepted[r], n)) for r, n in zip(req_ids, lengths)])
    return dict(zip(req_ids, lengths))


def test_cost_model_shape():
    # batch 1: three more verified tokens cost ~1.13x one
    assert abs(StepCostModel(draft_cost=0.0).relative_cost(1, 3) - 1.135) < 1e-9
    # batch 8 on the defaults: compute-bound, k+1 tokens cost about k+1 plain steps
    assert StepCostModel(draft_cost=0.0).relative_cost(8, 3) > 3.5
    assert draft_cost_from_weights(100, 100) == 0.25 and draft_cost_from_weights(50, 100) == 0.15
    assert draft_cost_from_weights(0, 0) == 0.25, "sizes unknown: the drafter costs like an equal-sized one"


def test_a_measured_cost_is_read_between_and_past_its_points():
    points = ((1, 0.1), (2, 0.25), (4, 0.35), (16, 1.55))
    assert [measured_cost(points, b) for b in (1, 2, 4, 16)] == pytest.approx([0.1, 0.25, 0.35, 1.55])
    assert measured_cost(points, 3) == pytest.approx(0.3) and measured_cost(points, 10) == pytest.approx(0.95)
    assert measured_cost(points, 32) == pytest.approx(3.1), "past the largest: its cost per request"
    assert measured_cost(((4, 0.4),), 1) == 0.4, "below the smallest: the smallest's"


def test_the_drafter_is_priced_by_its_points_where_it_has_them():
    line = StepCostModel(draft_cost=0.06, draft_forward_cost=0.1, verify_token_cost=0.0, compute_bound_tokens=1e9)
    timed = StepCostModel(draft_cost=0.06, draft_forward_cost=0.1, verify_token_cost=0.0, compute_bound_tokens=1e9,
                          draft_forward_points=((1, 0.1), (4, 0.4)))
    assert line.relative_cost(1, 3) == pytest.approx(1 + 3 * 0.16)
    assert timed.relative_cost(1, 3) == pytest.approx(1 + 3 * 0.1)
    assert timed.relative_cost(8, 1) == pytest.approx(1 + 0.8), "past 4: 4's cost per request"
    assert timed.catch_up_cost(1, 8) == pytest.approx(0.8)
    # priced a third lower at batch 1, the same acceptance drafts longer
    acceptance = [0.5, 0.6, 0.7]
    assert DraftLengthPolicy(3, timed).best_length(acceptance, 1) > DraftLengthPolicy(3, line).best_length(acceptance, 1)


def test_drafts_long_when_acceptance_is_high_and_drafting_cheap():
    policy = DraftLengthPolicy(K, CHEAP)
    lengths = [_step(policy, {"a": K})["a"] for _ in range(10)]
    assert lengths[-1] == K and all(n == K for n in lengths[1:]), lengths
    assert policy.acceptance("a")[0] > 0.9


def test_drafts_nothing_when_verification_costs_k_plus_1_plain_steps():
    policy = DraftLengthPolicy(K, COMPUTE_BOUND, probe_interval=2)
    seen = [_step(policy, {"a": K, "b": K}, batch=4) for _ in range(20)]
    assert all(n == 0 for step in seen for n in step.values()), seen
    assert policy.counters.get("probes", 0) == 0, "where even perfect acceptance cannot pay, no probes"
    # the default costs at batch 8 and 32 (compute-bound on this CPU): no drafts either
    for batch in (8, 32):
        default = DraftLengthPolicy(3, StepCostModel(draft_cost=0.1))
        assert set(_step(default, {"a": 3}, batch=batch).values()) == {0}


def test_later_positions_that_rarely_pass_are_not_drafted():
    """Per-position acceptance falling like Gemma-3 <- SmolLM2 (0.53, 0.34, 0.25, 0.15 of all drafts)."""
    policy = DraftLengthPolicy(K, StepCostModel(draft_cost=0.1))
    # a repeating 20-step pattern of accepted counts with P(>= j accepted) = 0.53, 0.34, 0.25, 0.15
    pattern = [0] * 9 + [1] * 4 + [2] * 2 + [3] * 2 + [4] * 3
    lengths = [_step(policy, {"a": pattern[(i * 7) % 20]})["a"] for i in range(200)]
    late = lengths[100:]
    assert 0 < max(late) < K and min(late) >= 1, sorted(set(late))


def test_recovers_when_acceptance_comes_back():
    policy = DraftLengthPolicy(K, CHEAP, probe_interval=4)
    for _ in range(5):
        _step(policy, {"a": K})
    assert _step(policy, {"a": K})["a"] == K
    bad = [_step(policy, {"a": 0})["a"] for _ in range(40)]
    assert bad[-12:].count(0) >= 8, f"no acceptance: the request mostly stops drafting ({bad})"
    assert 1 in bad[-12:], "but it is probed with one draft now and then"
    probes = policy.counters["probes"]
    good = [_step(policy, {"a": K})["a"] for _ in range(40)]
    assert good[-1] == K, good
    first_back = next(i for i, n in enumerate(good) if n > 1)
    assert first_back <= 12, good
    assert policy.counters["probes"] > probes


def test_probes_are_deterministic_and_fall_on_the_same_steps_for_every_request():
    """Requests left at 0 probe together, every probe_interval steps, so that they share one drafter
    forward (a probe of its own each would cost a forward nearly every step at batch 8)."""
    def run():
        policy = DraftLengthPolicy(K, CHEAP, probe_interval=4)
        reqs = {f"r{i}": 0 for i in range(4)}
        return [_step(policy, reqs) for _ in range(24)]

    first, second = run(), run()
    assert first == second
    late = first[12:]
    probe_steps = [i for i, step in enumerate(late) if any(step.values())]
    assert probe_steps and all(all(n == 1 for n in late[i].values()) for i in probe_steps), late
    assert [b - a for a, b in zip(probe_steps, probe_steps[1:])] == [4] * (len(probe_steps) - 1), probe_steps


def test_a_policy_waiting_for_its_costs_drafts_nothing():
    policy = DraftLengthPolicy(K, CHEAP, probe_interval=1, costs_pending=True)
    assert [_step(policy, {"a": K}) for _ in range(10)] == [{"a": 0}] * 10 and not policy.may_draft(1)
    policy.costs, policy.costs_pending = CHEAP, False
    assert policy.may_draft(1) and _step(policy, {"a": K})["a"] > 0


def test_new_costs_are_worked_out_again_for_every_batch_size():
    policy = DraftLengthPolicy(K, CHEAP)
    assert policy.may_draft(1)
    policy.costs = COMPUTE_BOUND
    assert not policy.may_draft(1) and _step(policy, {"a": K})["a"] == 0


def test_new_requests_start_from_the_pooled_estimate():
    policy = DraftLengthPolicy(K, StepCostModel(draft_cost=0.1))
    assert _step(policy, {"first": K})["first"] > 0, "before any data the prior drafts"
    for i in range(60):
        _step(policy, {f"old{i}": 0})
    assert policy.lengths(["new"], 1) == [0], "a pair that never accepts: new requests start without drafts"


def test_each_kind_of_draft_has_its_own_pooled_estimate():
    """Sampled TLI drafts that are never accepted must not talk a new greedy string request out of
    drafting: its pooled estimate is the string drafts' (here all accepted), not the pair's."""
    policy = DraftLengthPolicy(K, StepCostModel(draft_cost=0.1))
    for i in range(60):
        for kind, accepted in (("tli", 0), ("string", K)):
            req_id = f"{kind}{i}"
            n = policy.lengths([req_id], 1, kind=kind)[0]
            if n:
                policy.drafted([req_id], [n])
            policy.observe([req_id], [[0] * (1 + min(accepted, n))])
    policy.observe([], [])  # off the probe step
    assert policy.lengths(["new_tli", "new_tli2"], 1, kind="tli") == [0, 0]
    assert policy.lengths(["new_string"], 1, kind="string") == [K]
    assert policy.acceptance("new_string")[0] > 0.9 > 0.2 > policy.acceptance("new_tli")[0]
    pooled = policy.pooled_acceptance()
    assert sorted(pooled) == ["string", "tli"] and pooled["string"][0] > 0.9 > 0.2 > pooled["tli"][0]


def test_requests_without_evidence_keep_their_estimate():
    policy = DraftLengthPolicy(K, CHEAP)
    for _ in range(5):
        _step(policy, {"a": K})
    before = policy.acceptance("a")
    policy.drafted(["a"], [K])
    policy.observe(["a"], [[]])  # a discarded step: nothing emitted
    policy.observe(["a"], [[0]])  # and the next one has nothing pending: no evidence either
    assert policy.acceptance("a") == before
    policy.forget_all_but({"b"})  # a new request in its place: as many live requests as records, "a" must go
    assert policy.acceptance("a") != before, "a forgotten request starts again from the pooled estimate"


def test_fixed_length_is_k():
    fixed = FixedLength(3)
    fixed.observe(["a"], [[1]])
    assert fixed.lengths(["a", "b"], 64) == [3, 3]


def test_a_forward_past_the_draft_is_priced():
    """String rows write one drafter token past their last proposed one: with a drafter forward at 0.4
    of a target step and 0.5 acceptance, one draft pays in one forward (1.5 / 1.445) but not in two."""
    policy = DraftLengthPolicy(1, StepCostModel(draft_cost=0.4))
    assert policy.best_length([0.5], batch=1) == 1
    assert policy.best_length([0.5], batch=1, extra_forwards=1) == 0


def test_probes_pay_for_feeding_the_drafter_what_it_missed():
    """At batch 8 a perfect draft of 3 would still pay here, but a probe (one draft each, after 8 missed
    tokens fed to 8 drafters) would not: no probes there. At batch 1 it would: probes."""
    costs = StepCostModel(draft_cost=0.1, verify_token_cost=0.045, compute_bound_tokens=100)
    policy = DraftLengthPolicy(3, costs, probe_interval=8)
    assert policy.may_draft(8) and policy.may_draft(1)
    hopeless = {f"r{i}": 0 for i in range(8)}
    for _ in range(40):
        _step(policy, hopeless, batch=8)
    assert policy.counters.get("probes", 0) == 0
    for _ in range(40):
        _step(policy, {"a": 0}, batch=1)
    assert policy.counters.get("probes", 0) >= 4
