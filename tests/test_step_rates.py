"""StepRates and the policy's use of it: drafting that measured slower stops. No model, no engine."""

from __future__ import annotations

from vllm_usd.drafting.length_policy import RETEST_INTERVAL, RETEST_STEPS, DraftLengthPolicy, StepCostModel
from vllm_usd.drafting.step_rates import KEPT_CYCLES, MIN_CYCLES, StepRates, bucket


def test_buckets_are_powers_of_two():
    assert [bucket(b) for b in (0, 1, 2, 3, 4, 7, 8, 15, 16, 32, 255, 256)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 7, 8]


def test_a_verdict_needs_enough_cycles_of_both_kinds():
    rates = StepRates()
    for _ in range(MIN_CYCLES - 1):
        rates.record(1, True, 1, 1.0)
        rates.record(1, False, 1, 0.5)
    assert rates.slower_buckets() == frozenset()
    rates.record(1, True, 1, 1.0)
    assert rates.slower_buckets() == frozenset()
    rates.record(1, False, 1, 0.5)
    assert rates.slower_buckets() == {0}


def test_only_buckets_where_drafted_cycles_emit_fewer_tokens_per_second_are_slower():
    rates = StepRates()
    for _ in range(MIN_CYCLES):
        rates.record(1, True, 3, 0.020)  # 150 tok/s with drafts at batch 1 ...
        rates.record(1, False, 1, 0.010)  # ... against 100 without: drafting pays
        rates.record(8, True, 12, 0.080)  # 150 tok/s with drafts at batch 8 ...
        rates.record(8, False, 8, 0.040)  # ... against 200: it does not
    assert rates.slower_buckets() == {bucket(8)}


def test_the_latest_cycles_decide():
    rates = StepRates()
    for _ in range(KEPT_CYCLES):
        rates.record(1, True, 1, 1.0)
        rates.record(1, False, 1, 0.5)
    assert rates.slower_buckets() == {0}
    for _ in range(KEPT_CYCLES):
        rates.record(1, True, 3, 1.0)
    assert rates.slower_buckets() == frozenset(), "drafting got better: the old cycles are gone"


def test_the_policy_drafts_in_a_slower_bucket_only_in_retest_windows():
    cheap = StepCostModel(draft_cost=0.02, verify_token_cost=0.045, compute_bound_tokens=100)
    policy = DraftLengthPolicy(3, cheap, probe_interval=1)
    policy.slower_buckets = frozenset({bucket(1)})
    drafted = []
    for step in range(1, 3 * RETEST_INTERVAL + 1):
        policy.observe(["a"], [[0]])
        drafted.append(policy.lengths(["a"], 1)[0] > 0)
        assert policy.may_draft(8), "another batch size is not held back"
    windows = [i for i, d in enumerate(drafted) if d]
    assert len(windows) == 3 * RETEST_STEPS, windows
    assert all(((i + 1) % RETEST_INTERVAL) < RETEST_STEPS for i in windows), "consecutive steps at each interval"


def test_a_drafting_bucket_without_plain_cycles_is_named_and_goes_without_drafts_in_the_window():
    rates = StepRates()
    for _ in range(MIN_CYCLES):
        rates.record(8, True, 16, 0.1)
        rates.record(1, True, 2, 0.1)
        rates.record(1, False, 1, 0.1)
    assert rates.unmeasured_plain_buckets() == {bucket(8)}
    cheap = StepCostModel(draft_cost=0.02, verify_token_cost=0.045, compute_bound_tokens=100)
    policy = DraftLengthPolicy(3, cheap)
    policy.unmeasured_plain_buckets = rates.unmeasured_plain_buckets()
    drafts_at_8 = []
    for _ in range(2 * RETEST_INTERVAL):
        policy.observe([], [])
        drafts_at_8.append(policy.may_draft(8))
        assert policy.may_draft(1)
    assert drafts_at_8.count(False) == 2 * RETEST_STEPS, "one window without drafts per interval"


def test_a_few_cycles_with_a_one_off_cost_do_not_decide():
    """Drafting that pays (2 tokens in 0.15 s against 1 in 0.1 s), with every 12th drafted cycle also
    feeding a new prompt to the drafter (2 s): the median still says drafting pays."""
    rates = StepRates()
    for i in range(KEPT_CYCLES):
        rates.record(1, True, 2, 2.0 if i % 12 == 0 else 0.15)
        rates.record(1, False, 1, 0.1)
    assert rates.slower_buckets() == frozenset()


def test_the_rate_is_tokens_over_seconds_not_a_median_of_cycles():
    """Drafts all rejected in most cycles (1 token in 0.15 s) but four tokens in the rest: 2.2 tokens
    per 0.15 s on the whole, faster than 1 token per 0.1 s, though the median cycle is slower."""
    rates = StepRates()
    for i in range(KEPT_CYCLES):
        rates.record(1, True, 4 if i % 5 < 2 else 1, 0.15)
        rates.record(1, False, 1, 0.1)
    assert rates.rate(0, True) > rates.rate(0, False) and rates.slower_buckets() == frozenset()
