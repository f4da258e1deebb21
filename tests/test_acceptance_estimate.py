"""Offline acceptance estimate (vllm-usd analyze --models). No engine."""

from __future__ import annotations

import pytest

from vllm_usd.analysis.acceptance import _expected_sampled, _simulate_greedy, estimate_acceptance


def test_greedy_simulation_counts_engine_steps():
    # matches: T T F T T T T F ; k=2: step1 accepts 2 (+1 bonus) -> pos 3; step2: 2 (+1) -> pos 6;
    # step3: T then F -> 1 (+1) -> pos 8: 3 steps, 8 tokens
    assert _simulate_greedy([True, True, False, True, True, True, True, False], 2) == (8, 3)
    assert _simulate_greedy([False] * 5, 4) == (5, 5)
    assert _simulate_greedy([True] * 8, 3) == (8, 2)


def test_sampled_expectation():
    assert _expected_sampled([1.0] * 10, 3) == pytest.approx((4 * 8 + 3 + 2) / 10)
    assert _expected_sampled([0.0] * 4, 5) == 1.0
    assert _expected_sampled([0.5], 1) == 1.5


def test_distribution_pair_estimate_is_high_and_k_grows_it():
    """The distribution pair's drafter is the target's own network: most drafts match."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_usd.drafter import load_drafter
    from tests.fixtures import tiny

    target_dir, drafter_dir = tiny.build_distribution_pair()
    t_tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    drafter, d_tok = load_drafter(drafter_dir)
    text = " the keeper of the light walked down to the shore, and the boat was there."
    est = estimate_acceptance(target, t_tok, drafter, d_tok, [t_tok(text).input_ids], [2])
    assert est.positions > 10
    assert est.greedy_match_rate > 0.5 and 0.5 < est.mean_alpha <= 1.0
    assert est.greedy_length[1] <= est.greedy_length[3] <= 4.0
    assert 1.0 <= est.sampled_length[1] <= est.sampled_length[4]
    assert est.recommend_k(cost_ratio=0.01) >= est.recommend_k(cost_ratio=1.0)
