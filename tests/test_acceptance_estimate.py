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


def test_another_runtime_and_a_temperature_are_used():
    """``runtime``: the drafts come from it (a bfloat16 drafter here, not the float32 model passed);
    ``temperature`` scales p and q: the greedy figures stay, the acceptance probability moves."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_usd.drafter import load_drafter
    from vllm_usd.drafter.select import DrafterChoice, open_drafter
    from tests.fixtures import tiny

    target_dir, drafter_dir = tiny.build_distribution_pair()
    t_tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    drafter, d_tok = load_drafter(drafter_dir)
    seqs = [t_tok(" the keeper of the light walked down to the shore, and the boat was there.").input_ids]
    base = estimate_acceptance(target, t_tok, drafter, d_tok, seqs, [2])
    assert estimate_acceptance(target, t_tok, drafter, d_tok, seqs, [2], temperature=1.0) == base
    cooled = estimate_acceptance(target, t_tok, drafter, d_tok, seqs, [2], temperature=0.5)
    assert cooled.greedy_length == base.greedy_length and cooled.mean_alpha != pytest.approx(base.mean_alpha)

    calls = []
    runtime = open_drafter(drafter_dir, DrafterChoice("transformers", "bfloat16", "cpu"),
                           max_len=256, max_requests=1, kv_budget_bytes=1 << 26).runtime
    catch_up = runtime.catch_up
    runtime.catch_up = lambda *a, **kw: calls.append(1) or catch_up(*a, **kw)
    other = estimate_acceptance(target, t_tok, drafter, d_tok, seqs, [2], runtime=runtime)
    assert len(calls) == other.positions == base.positions
    assert other.mean_alpha != base.mean_alpha  # bfloat16 logits, not the float32 model's
