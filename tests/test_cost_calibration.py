"""CostCalibration on synthetic timings from known costs. No model, no engine."""

from __future__ import annotations

import random

import pytest

from vllm_usd.drafting.cost_calibration import MIN_SAMPLES, WARMUP_STEPS, CostCalibration
from vllm_usd.drafting.length_policy import DraftLengthPolicy, StepCostModel

CONFIGURED = StepCostModel(draft_cost=0.25, verify_token_cost=0.045, compute_bound_tokens=5.0)

# the engine the timings come from: a step of N tokens takes A + B N seconds, drafting takes
# F0 per draft position (one drafter forward) plus F1 per drafted token
A, B, F0, F1 = 0.010, 0.0005, 0.003, 0.0004


def _serve(cal: CostCalibration, batches=(1, 4, 8), steps: int = 300, noise: float = 0.05,
           outliers: float = 0.02, seed: int = 0) -> None:
    """Steps at the given batch sizes with lengths 0..3, noisy, with a few 10x slow steps."""
    rng = random.Random(seed)
    for i in range(steps):
        cal.count_step()
        batch, length = batches[i % len(batches)], rng.randrange(4)
        tokens = batch * (1 + length)

        def jitter(t):
            return t * (10.0 if rng.random() < outliers else 1.0 + rng.uniform(-noise, noise))

        cal.record_step(tokens, jitter(A + B * tokens))
        if length:
            cal.record_drafting(length, batch * length, jitter(F0 * length + F1 * batch * length))


def test_the_fit_recovers_the_costs_of_the_engine_it_timed():
    cal = CostCalibration(CONFIGURED, steps=300)
    _serve(cal)
    model = cal.fit()
    unit = A + B  # a one-token step
    assert model.verify_token_cost == pytest.approx(B / unit, rel=0.15)
    assert model.draft_forward_cost == pytest.approx(F0 / unit, rel=0.15)
    assert model.draft_cost == pytest.approx(F1 / unit, rel=0.15)
    # the measured step: relative costs as the timed engine's own
    for batch, length in ((1, 3), (8, 2)):
        truth = (A + B * batch * (1 + length) + length * (F0 + F1 * batch)) / (A + B * batch)
        assert model.relative_cost(batch, length) == pytest.approx(truth, rel=0.05)


def test_warmup_steps_and_too_few_timings_give_no_fit():
    cal = CostCalibration(CONFIGURED, steps=100)
    for _ in range(WARMUP_STEPS):
        cal.count_step()
        cal.record_step(4, 1.0)
        cal.record_drafting(1, 1, 1.0)
    assert cal.fit() is None, "warm-up steps are not timings"
    for _ in range(MIN_SAMPLES - 1):
        cal.count_step()
        cal.record_step(4, 1.0)
        cal.record_drafting(1, 1, 1.0)
    assert cal.fit() is None
    cal.count_step()
    cal.record_step(4, 1.0)
    cal.record_drafting(1, 1, 1.0)
    assert cal.fit() is not None


def test_one_step_size_keeps_the_configured_shape_and_measures_the_drafter_in_its_unit():
    cal = CostCalibration(CONFIGURED, steps=100)
    for _ in range(WARMUP_STEPS + 40):
        cal.count_step()
        cal.record_step(2, 0.020)  # batch 1, always one draft: the only N is 2
        cal.record_drafting(1, 1, 0.010)
    model = cal.fit()
    unit = 0.020 / CONFIGURED.target_step(2)
    assert (model.verify_token_cost, model.compute_bound_tokens) == (CONFIGURED.verify_token_cost,
                                                                       CONFIGURED.compute_bound_tokens)
    # one batch shape: the whole drafting cost is charged per token (the larger cost at bigger batches)
    assert model.draft_forward_cost == 0.0 and model.draft_cost == pytest.approx(0.010 / unit, rel=1e-6)


def test_a_counted_step_says_when_the_fit_is_due():
    cal = CostCalibration(CONFIGURED, steps=3)
    assert [cal.count_step() for _ in range(5)] == [False, False, True, False, False]


def test_the_policy_on_measured_costs_drafts_only_where_drafting_pays():
    """The same acceptance (0.7 per position) under two measured engines: a drafter forward that costs
    as much as the target's step (never pays) and one that costs 2% of it (pays at batch 1)."""
    def measured(f0: float) -> StepCostModel:
        cal = CostCalibration(CONFIGURED, steps=300)
        rng = random.Random(1)
        for i in range(300):
            cal.count_step()
            batch, length = (1, 4)[i % 2], rng.randrange(4)
            tokens = batch * (1 + length)
            cal.record_step(tokens, 0.010 + 0.0002 * tokens)
            if length:
                cal.record_drafting(length, batch * length, f0 * length + 0.0001 * batch * length)
        return cal.fit()

    acceptance = [0.7, 0.7, 0.7]
    assert DraftLengthPolicy(3, measured(0.010)).best_length(acceptance, batch=1) == 0
    assert DraftLengthPolicy(3, measured(0.0002)).best_length(acceptance, batch=1) == 3


def test_without_drafting_timings_only_the_target_is_measured():
    cal = CostCalibration(CONFIGURED, steps=300)
    rng = random.Random(2)
    for i in range(WARMUP_STEPS + 60):
        cal.count_step()
        tokens = (1, 4, 8)[i % 3]
        cal.record_step(tokens, (A + B * tokens) * (1 + rng.uniform(-0.05, 0.05)))
    model = cal.fit()
    assert not cal.drafting_measured
    assert model.verify_token_cost == pytest.approx(B / (A + B), rel=0.15)
    assert (model.draft_cost, model.draft_forward_cost) == (CONFIGURED.draft_cost, CONFIGURED.draft_forward_cost)


def test_a_target_that_turns_compute_bound_is_fitted_in_both_regimes():
    """t(N) = max(10 ms + 0.4 ms N, 1.6 ms N): flat-ish to N = 8, then proportional. A single line
    through all sizes would overprice verifying at batch 1 (and underprice it at 32)."""
    def step(n):
        return max(0.010 + 0.0004 * n, 0.0016 * n)

    cal = CostCalibration(CONFIGURED, steps=400)
    rng = random.Random(3)
    for i in range(400):
        cal.count_step()
        batch, length = (1, 4, 8, 16)[i % 4], rng.randrange(4)
        cal.record_step(batch * (1 + length), step(batch * (1 + length)) * (1 + rng.uniform(-0.03, 0.03)))
        if length:
            cal.record_drafting(length, batch * length, F0 * length + F1 * batch * length)
    model = cal.fit()
    for batch, length in ((1, 1), (1, 3), (4, 2), (8, 1), (16, 3)):
        truth = (step(batch * (1 + length)) + length * (F0 + F1 * batch)) / step(batch)
        assert model.relative_cost(batch, length) == pytest.approx(truth, rel=0.05), (batch, length, model)
    assert 4 < model.compute_bound_tokens < 10, model
