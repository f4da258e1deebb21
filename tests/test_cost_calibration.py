"""CostCalibration on synthetic timings from known costs. No model, no engine."""

from __future__ import annotations

import random

import pytest

from vllm_usd.drafting.cost_calibration import (KEPT_PER_SIZE, MAX_FIT_INTERVAL, MIN_SAMPLES, WARMUP_STEPS,
                                               CostCalibration)
from vllm_usd.drafting.drafter_timing import DrafterTiming
from vllm_usd.drafting.step_rates import MIN_CYCLES
from vllm_usd.drafting.length_policy import DraftLengthPolicy, StepCostModel

CONFIGURED = StepCostModel(draft_cost=0.25, verify_token_cost=0.045, compute_bound_tokens=5.0)

# the engine the timings come from: a step of N tokens takes A + B N seconds; a drafter forward of
# a batch takes F0 plus F1 per request (timed at start-up)
A, B, F0, F1 = 0.010, 0.0005, 0.003, 0.0004
DRAFTER = DrafterTiming(per_forward=F0, per_request=F1)


def _serve(cal: CostCalibration, batches=(1, 4, 8), steps: int = 300, noise: float = 0.05,
           outliers: float = 0.02, seed: int = 0, step_time=lambda n: A + B * n) -> None:
    """Steps at the given batch sizes with lengths 0..3, noisy, with a few 10x slow steps."""
    rng = random.Random(seed)
    for i in range(steps):
        cal.count_step()
        batch, length = batches[i % len(batches)], rng.randrange(4)
        tokens = batch * (1 + length)
        slow = 10.0 if rng.random() < outliers else 1.0 + rng.uniform(-noise, noise)
        cal.record_step(tokens, step_time(tokens) * slow)


def test_the_fit_recovers_the_target_and_prices_the_drafter_in_its_unit():
    cal = CostCalibration(CONFIGURED, steps=300, drafter=DRAFTER)
    _serve(cal)
    model = cal.fit()
    unit = A + B  # a one-token step
    assert model.verify_token_cost == pytest.approx(B / unit, rel=0.15)
    assert model.draft_forward_cost == pytest.approx(F0 / unit, rel=0.1)
    assert model.draft_cost == pytest.approx(F1 / unit, rel=0.1)
    # the measured step: relative costs as the timed engine's own
    for batch, length in ((1, 3), (8, 2)):
        truth = (A + B * batch * (1 + length) + length * (F0 + F1 * batch)) / (A + B * batch)
        assert model.relative_cost(batch, length) == pytest.approx(truth, rel=0.05)


def test_a_drafter_timed_per_batch_size_is_priced_at_those_sizes_in_the_fits_unit():
    """A drafter cheaper at batch 1 than the line through its timings: the fit keeps each timed size."""
    timed = DrafterTiming(per_forward=F0, per_request=F1, points=((1, 0.002), (4, 0.0046), (16, 0.0094)))
    cal = CostCalibration(CONFIGURED, steps=300, drafter=timed)
    _serve(cal)
    model = cal.fit()
    unit = A + B
    assert [b for b, _ in model.draft_forward_points] == [1, 4, 16]
    assert [c * unit for _, c in model.draft_forward_points] == pytest.approx([0.002, 0.0046, 0.0094], rel=0.15)
    truth = (A + B * 4 + 3 * 0.002) / (A + B)
    assert model.relative_cost(1, 3) == pytest.approx(truth, rel=0.05)


def test_warmup_steps_and_too_few_timings_give_no_fit():
    cal = CostCalibration(CONFIGURED, steps=100, drafter=DRAFTER)
    for _ in range(WARMUP_STEPS):
        cal.count_step()
        cal.record_step(4, 1.0)
    assert cal.fit() is None, "warm-up steps are not timings"
    for _ in range(MIN_SAMPLES - 1):
        cal.count_step()
        cal.record_step(4, 1.0)
    assert cal.fit() is None
    cal.count_step()
    cal.record_step(4, 1.0)
    assert cal.fit() is not None


def test_one_step_size_keeps_the_configured_shape_and_prices_the_drafter_in_its_unit():
    cal = CostCalibration(CONFIGURED, steps=100, drafter=DRAFTER)
    for _ in range(WARMUP_STEPS + 40):
        cal.count_step()
        cal.record_step(2, 0.020)  # batch 1, always one draft: the only N is 2
    model = cal.fit()
    unit = 0.020 / CONFIGURED.target_step(2)
    assert (model.verify_token_cost, model.compute_bound_tokens) == (CONFIGURED.verify_token_cost,
                                                                       CONFIGURED.compute_bound_tokens)
    assert model.draft_forward_cost == pytest.approx(F0 / unit, rel=1e-4)
    assert model.draft_cost == pytest.approx(F1 / unit, rel=1e-4)


def test_fits_are_due_after_the_steps_then_after_twice_as_many_each_time_up_to_an_interval():
    cal = CostCalibration(CONFIGURED, steps=3)
    due = [step for step in range(1, 50) if cal.count_step()]
    assert due == [3, 6, 12, 24, 48]
    cal = CostCalibration(CONFIGURED, steps=2 * MAX_FIT_INTERVAL)
    due = [step for step in range(1, 6 * MAX_FIT_INTERVAL) if cal.count_step()]
    assert due == [2 * MAX_FIT_INTERVAL, 3 * MAX_FIT_INTERVAL, 4 * MAX_FIT_INTERVAL, 5 * MAX_FIT_INTERVAL]


def test_whole_cycles_after_the_warmup_feed_the_step_rates():
    cal = CostCalibration(CONFIGURED, steps=100)
    for i in range(WARMUP_STEPS + 4 * MIN_CYCLES):
        cal.count_step()
        cal.record_cycle(4, i % 2 == 0, 4 if i % 2 else 6, 0.01 if i % 2 else 0.02)  # drafted: 300 tok/s, plain 400
    assert cal.rates.rate(2, True) == pytest.approx(300) and cal.rates.rate(2, False) == pytest.approx(400)
    assert cal.rates.slower_buckets() == {2}


def test_later_fits_follow_the_engine_and_keep_bounded_timings():
    """The engine's steps get twice as slow after a while (another tenant, say): a later fit uses the
    latest timings per size, and no more than KEPT_PER_SIZE of them."""
    cal = CostCalibration(CONFIGURED, steps=100, drafter=DRAFTER)
    _serve(cal, steps=400, outliers=0.0)
    before = cal.fit()
    _serve(cal, steps=400, outliers=0.0, seed=1, step_time=lambda n: 2 * (A + B * n))
    after = cal.fit()
    assert after.draft_forward_cost == pytest.approx(before.draft_forward_cost / 2, rel=0.1)
    assert all(len(v) <= KEPT_PER_SIZE for v in cal._step_times.values())


def test_the_policy_on_measured_costs_drafts_only_where_drafting_pays():
    """The same acceptance (0.7 per position) under two drafters: one whose forward costs as much as
    the target's step (never pays) and one that costs 2% of it (pays at batch 1)."""
    def measured(forward: float) -> StepCostModel:
        cal = CostCalibration(CONFIGURED, steps=300, drafter=DrafterTiming(per_forward=forward, per_request=1e-4))
        _serve(cal, batches=(1, 4), outliers=0.0, step_time=lambda n: 0.010 + 0.0002 * n)
        return cal.fit()

    acceptance = [0.7, 0.7, 0.7]
    assert DraftLengthPolicy(3, measured(0.010)).best_length(acceptance, batch=1) == 0
    assert DraftLengthPolicy(3, measured(0.0002)).best_length(acceptance, batch=1) == 3


def test_without_a_drafter_timing_only_the_target_is_measured():
    cal = CostCalibration(CONFIGURED, steps=300)
    _serve(cal, outliers=0.0)
    model = cal.fit()
    assert model.verify_token_cost == pytest.approx(B / (A + B), rel=0.15)
    assert (model.draft_cost, model.draft_forward_cost) == (CONFIGURED.draft_cost, CONFIGURED.draft_forward_cost)


def test_a_target_that_turns_compute_bound_is_fitted_in_both_regimes():
    """t(N) = max(10 ms + 0.4 ms N, 1.6 ms N): flat-ish to N = 8, then proportional. A single line
    through all sizes would overprice verifying at batch 1 (and underprice it at 32)."""
    def step(n):
        return max(0.010 + 0.0004 * n, 0.0016 * n)

    cal = CostCalibration(CONFIGURED, steps=400, drafter=DRAFTER)
    _serve(cal, batches=(1, 4, 8, 16), steps=400, noise=0.03, outliers=0.0, seed=3, step_time=step)
    model = cal.fit()
    for batch, length in ((1, 1), (1, 3), (4, 2), (8, 1), (16, 3)):
        truth = (step(batch * (1 + length)) + length * (F0 + F1 * batch)) / step(batch)
        assert model.relative_cost(batch, length) == pytest.approx(truth, rel=0.05), (batch, length, model)
    assert 4 < model.compute_bound_tokens < 10, model


def test_past_the_largest_step_timed_each_token_costs_the_average_of_that_step():
    """Timed at batch 1 only (steps of 1 to 4 tokens, nearly flat): a batch of 8 must not look as if
    verifying its drafts came free, as a flat line carried past 4 tokens would say."""
    cal = CostCalibration(CONFIGURED, steps=300, drafter=DRAFTER)
    _serve(cal, batches=(1,), outliers=0.0)
    model = cal.fit()
    assert model.measured_tokens == 4
    assert model.target_step(16) == pytest.approx(2 * model.target_step(8))
    assert model.target_step(8) == pytest.approx(2 * model.target_step(4))
    assert DraftLengthPolicy(3, model).best_length([1.0, 1.0, 1.0], batch=8) == 0
    assert DraftLengthPolicy(3, model).best_length([0.9, 0.9, 0.9], batch=1) > 0
