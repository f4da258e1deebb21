"""The draft-length controller (vllm_usd/drafting/controller.py), alone: what it counts, what it
chooses, what exploring costs, and that ranks choose alike. Expected choices are worked out here
from the stated rule (most expected tokens per second), not read from the code."""

from __future__ import annotations

import math
import random

import pytest

from vllm_usd.drafting.controller import (ACCEPTANCE_MEMORY, EXPLORE_EVERY, LOSS_BUDGET, SHARE_EVERY, _Acceptance,
                                          DraftLengthController,
                                          StartupTimings, bucket)

# target: 100 ms up to 4 tokens, 200 ms at 8 and more per token past it; drafter 10 ms at batch 1
TIMINGS = StartupTimings(target=((1, 0.100), (4, 0.100), (8, 0.200)), drafter=((1, 0.010), (2, 0.020)))



def _share(controller, send=lambda local: local) -> None:
    """What the proposer does once a step: send the controller's measured costs where due (``send``: the
    step's collective, rank 0's table back), and take what comes back."""
    local = controller.share_due()
    if local is not None:
        controller.take_shared(send(local))

def _accepting(rounds: int, k: int = 3, timings: StartupTimings = TIMINGS, greedy: bool = False) -> DraftLengthController:
    """A controller that saw ``rounds`` x 125 rows (sampled ones, or ``greedy``) of 3 verified drafts, 1 in 5
    rejected at each position: 25 rejected at the first, 20 of the 100 left at the second, 16 of 80 at the
    third, all in one step."""
    c = DraftLengthController(k, timings)
    outcomes = [accepted for accepted, rows in ((0, 25), (1, 20), (2, 16), (3, 64)) for _ in range(rows)]
    for r in range(rounds):
        random.Random(r).shuffle(outcomes)
        c.observe([3] * len(outcomes), [[0] * (accepted + 1) for accepted in outcomes], [greedy] * len(outcomes))
    return c


def _choose(c: DraftLengthController, batch: int, steps: int = 1) -> list[int]:
    return [c.length(batch) for _ in range(steps)]


def test_acceptance_counts_the_drafts_vllm_scheduled_not_those_handed_over():
    c = DraftLengthController(3)
    assert c.acceptance(False) == c.acceptance(True) == [0.5] * 3, "the prior: 1 accepted of 2 offered"
    c.observe([1, 0], [[7, 8], [9]], [False, False])  # row 0: 3 handed over, vLLM verified 1 (accepted); row 1: none
    assert c.acceptance(False) == [2 / 3, 0.5, 0.5], "positions 2 and 3 were never verified"
    c.observe([3], [[7]], [False])  # 3 verified, the first rejected
    assert c.acceptance(False) == [2 / 4, 0.5, 0.5], "1 of 2 measured, with the prior's 1 of 2"
    assert c._acceptance[False].offered == [4.0, 2.0, 2.0], "no step passed: nothing faded"
    assert c.acceptance(True) == [0.5] * 3, "greedy rows are counted apart"


def test_greedy_and_sampled_rows_are_counted_apart_and_a_batch_is_priced_by_its_mix():
    """Greedy rows accept 4 drafts in 5 (what _accepting sets up), sampled rows none of 200: batch 1
    drafts 3 for a greedy row and nothing for a sampled one; a batch of 2 of each expects the mean."""
    c = _accepting(4, greedy=True)
    c.observe([1] * 200, [[0]] * 200, [False] * 200)
    assert c.acceptance(True)[0] == pytest.approx(0.8, abs=0.01) and c.acceptance(False)[0] < 0.01
    assert c.length(1, greedy=1) == 3 and c.length(1, greedy=0) == 0
    assert c.expected_tokens(3, 0.5) == pytest.approx((c.expected_tokens(3, 1.0) + c.expected_tokens(3, 0.0)) / 2)


def test_acceptance_forgets_old_drafts_and_after_steps_without_drafts_the_next_draft_weighs_a_third():
    """The counts fade with the steps served: recent drafts dominate; after ``ACCEPTANCE_MEMORY`` x 6 steps
    without a draft the estimate is unchanged but weighs as 2 drafts (256 x e^-6 < 2), so one accepted draft moves it a
    third of the way to 1 (where the old counts would have kept it within 0.01)."""
    c = DraftLengthController(1, share_every=1)
    for _ in range(4 * ACCEPTANCE_MEMORY):
        c.observe([1], [[1, 2]], [False])
        _share(c)
    assert c.acceptance(False)[0] > 0.99
    for _ in range(2 * ACCEPTANCE_MEMORY):
        c.observe([1], [[1]], [False])
        _share(c)
    assert c.acceptance(False)[0] < 0.2, "the recent rejections dominate"
    low = c.acceptance(False)[0]
    for _ in range(6 * ACCEPTANCE_MEMORY):
        _share(c)
    assert c.acceptance(False)[0] == pytest.approx(low), "no drafts: nothing learned"
    c.observe([1], [[1, 2]], [False])
    assert c.acceptance(False)[0] == pytest.approx(low + (1 - low) / 3)


def test_the_length_with_most_expected_tokens_per_second_is_chosen():
    c = _accepting(4)
    a = c.acceptance(False)
    assert a == pytest.approx([0.8] * 3, abs=0.03), "what _accepting set up"

    def tokens(n: int) -> float:
        return 1 + sum(a[0] * a[1] if i == 2 else a[0] * a[1] * a[2] if i == 3 else a[0] for i in range(1, n + 1))

    # batch 1, by hand: up to 4 tokens verified cost 0.100 s, plus 10 ms a drafted position
    rates = [tokens(n) / (0.100 + 0.010 * n) for n in range(4)]
    assert _choose(c, 1) == [rates.index(max(rates))] == [3]
    # batch 4: 4 tokens at L=0 (100 ms), 8 at L=1 (200 ms), 12 at L=2 (300 ms): drafting never pays
    assert _choose(c, 4) == [0]
    slow = _accepting(4, timings=StartupTimings(target=TIMINGS.target, drafter=((1, 0.060),)))
    by_hand = [tokens(n) / (0.100 + 0.060 * n) for n in range(4)]
    assert _choose(slow, 1) == [by_hand.index(max(by_hand))] == [1], "a slow drafter: a short draft"


def test_measured_cycles_correct_the_estimate_and_unmeasured_lengths_take_their_buckets_scale():
    c = _accepting(4)
    for _ in range(8):
        c.record_cycle(1, 3, 3 * TIMINGS.estimate(1, 3))  # drafting 3 measured 3x the estimate
    for _ in range(SHARE_EVERY):
        _share(c)
    assert c.cost(1, 3) == pytest.approx(3 * TIMINGS.estimate(1, 3))
    assert c.cost(1, 0) == pytest.approx(3 * TIMINGS.estimate(1, 0)), "the bucket's scale, where not measured"
    assert c.length(1) == 3, "every length is 3x: the order is unchanged"
    for _ in range(8):
        c.record_cycle(1, 0, TIMINGS.estimate(1, 0))  # plain steps measured as estimated
    for _ in range(SHARE_EVERY):
        _share(c)
    scale = {0: 1.0, 1: 2.0, 2: 2.0, 3: 3.0}  # lengths 1 and 2: the median of their bucket's (1 and 3)
    for n in range(4):
        assert c.cost(1, n) == pytest.approx(scale[n] * TIMINGS.estimate(1, n)), n
    a = c.acceptance(False)
    expected = [(1 + sum(a[0] if i == 1 else a[0] * a[1] if i == 2 else a[0] * a[1] * a[2]
                         for i in range(1, n + 1))) / (scale[n] * TIMINGS.estimate(1, n)) for n in range(4)]
    assert c.length(1) == max(range(4), key=lambda n: expected[n]) != 3, expected


def test_exploring_takes_at_most_about_one_explore_every_of_the_time_least_recently_measured_first():
    c = _accepting(4)
    for _ in range(8):
        c.record_cycle(1, 3, TIMINGS.estimate(1, 3))
    for _ in range(SHARE_EVERY):
        _share(c)
    steps, chosen = 40 * EXPLORE_EVERY, []
    for _ in range(steps):  # as served: each step's cycle is measured, and shared every SHARE_EVERY
        chosen.append(c.length(1))
        c.record_cycle(1, chosen[-1], TIMINGS.estimate(1, chosen[-1]))
        _share(c)
    others = [n for n in chosen if n != 3]
    # every length would beat plain were its drafts accepted (length 1: 2 tokens in 0.11 s against 1 in 0.1 s)
    assert others[:6] == [0, 1, 2, 0, 1, 2], "never-tried lengths first (the shorter first), then the stalest"
    # the lengths tried cost 0.77-0.92x the best's here: each is tried after EXPLORE_EVERY x that many steps
    cheapest = min(TIMINGS.estimate(1, n) / TIMINGS.estimate(1, 3) for n in range(3))
    assert steps / (EXPLORE_EVERY * 0.95) <= len(others) <= steps / (EXPLORE_EVERY * cheapest) + 1, len(others)


def test_a_length_that_could_not_pay_is_never_explored_and_a_dearer_one_that_could_more_rarely():
    """Batch 4: one draft costs 2.4x a plain step at the start-up estimate (8 tokens verified in 0.2 s, the drafter
    at 4 in 0.04 s), so even accepted (2 tokens a row) it loses to 1 token in 0.1 s: never tried. Batch 1 with a 60 ms drafter and
    no draft of 200 accepted: plain is best, and lengths 1-3 (1.6-2.8x a plain step) would pay only were their drafts
    accepted: none is tried until those 200 rejections have faded to the weight of 4 (about 1,000 steps), then each
    at most once in EXPLORE_EVERY x its cost ratio steps, not once in EXPLORE_EVERY, and for two steps (the first
    after a plain step is not measured), as far as the loss budget allows."""
    c = _accepting(4)
    chosen = []
    for _ in range(10 * EXPLORE_EVERY):  # as served: measured cycles (the loss budget grows with them), shared
        chosen.append(c.length(4))
        c.record_cycle(4, chosen[-1], TIMINGS.estimate(4, chosen[-1]), c.expected_tokens(chosen[-1]))
        _share(c)
    assert chosen == [0] * len(chosen)
    assert _choose(c, 8, 1) == [0] and bucket(8) != bucket(4), "buckets count their own steps"
    mismeasured = _accepting(4)  # batch 1: every drafted length measured at 5x (catch-ups, say): plain is best
    for n in (1, 2, 3, 0):
        for _ in range(8):
            mismeasured.record_cycle(1, n, (5 if n else 1) * TIMINGS.estimate(1, n))
    for _ in range(SHARE_EVERY):
        _share(mismeasured)
    tried = []
    for _ in range(20 * EXPLORE_EVERY):  # served at the true costs
        tried.append(mismeasured.length(1))
        mismeasured.record_cycle(1, tried[-1], TIMINGS.estimate(1, tried[-1]), 1.0)
        _share(mismeasured)
    assert tried[0] == 0 and {1, 2, 3} <= set(tried), "measured again: they could pay at their start-up estimate"
    slow_timings = StartupTimings(target=TIMINGS.target, drafter=((1, 0.060),))
    slow = DraftLengthController(3, slow_timings, share_every=1)
    slow.observe([3] * 200, [[0]] * 200, [False] * 200)
    chosen = []
    faded = math.ceil(math.log(202 / 4) / -math.log(1 - 1 / ACCEPTANCE_MEMORY))  # 202 offered at the first position
    for _ in range(faded + 20 * EXPLORE_EVERY):
        chosen.append(slow.length(1))
        slow.record_cycle(1, chosen[-1], slow_timings.estimate(1, chosen[-1]), 1.0)
        _share(slow)
    ratios = [slow_timings.estimate(1, n) / slow_timings.estimate(1, 0) for n in (1, 2, 3)]
    assert not any(chosen[:faded - 1]), chosen.index(next(n for n in chosen if n))
    chosen = chosen[faded - 1:]
    explored = [n for n in chosen if n]
    assert ratios == pytest.approx([1.6, 2.2, 2.8]) and set(explored) == {1, 2, 3}, explored
    starts = [i for i in range(1, len(chosen) - 2) if chosen[i] and not chosen[i - 1]]
    assert all(chosen[i + 1] == chosen[i] and not chosen[i + 2] for i in starts), "each explored twice in a row"
    assert {n for _, n in slow.shared} == {0, 1, 2, 3}, "and so measured (a single exploring step never was)"
    assert len(starts) <= 20 / min(ratios) + 1 and slow.state()["loss_share"]["1"] <= LOSS_BUDGET, explored


def test_an_explored_length_runs_again_only_for_the_same_rows_on_the_next_step():
    """The second step of an exploration is measured only if it is a drafted step like the first: the next
    step, its rows caught up. Where the request changed (its drafter lacks a prompt: 40 tokens missed), or a
    step without decoding rows (a prefill) came between, it is served plain: that catch-up was never priced."""
    slow_timings = StartupTimings(target=TIMINGS.target, drafter=((1, 0.060),))
    for missed, prefill_between in ((0, False), (40, False), (0, True)):
        c = DraftLengthController(3, slow_timings, share_every=1)
        c.observe([3] * 2, [[0]] * 2, [False] * 2)  # 1 in 4 accepted: plain is best, lengths 1-3 explored
        chosen: list[int] = []
        while not any(chosen) and len(chosen) < 20 * EXPLORE_EVERY:
            chosen.append(c.length(1))
            c.record_cycle(1, chosen[-1], slow_timings.estimate(1, chosen[-1]), 1.0)
            _share(c)
        assert chosen[-1], "explored"
        if prefill_between:
            _share(c)  # a step: the proposer shares every step, decoding or not
        again = c.length(1, lambda: (missed, 100.0))
        assert again == (chosen[-1] if not missed and not prefill_between else 0), (missed, prefill_between)


def test_every_rank_chooses_with_rank_0s_costs():
    """Rank 1's clock measured drafting 10x slower; the share hands every rank rank 0's table."""
    rank0, rank1 = _accepting(4), _accepting(4)
    sent: list[object] = []
    for step in range(4 * SHARE_EVERY):
        rank0.record_cycle(1, 3, TIMINGS.estimate(1, 3))
        rank1.record_cycle(1, 3, 10 * TIMINGS.estimate(1, 3))
        _share(rank0, lambda local: sent.append(local) or local)
        _share(rank1, lambda local: sent[-1])
    assert len(sent) == 4
    assert _choose(rank0, 1, 40) == _choose(rank1, 1, 40)
    own = _accepting(4)
    for _ in range(SHARE_EVERY):
        own.record_cycle(1, 3, 10 * TIMINGS.estimate(1, 3))
        _share(own)
    assert own.length(1) != rank1.length(1) or own.cost(1, 3) != rank1.cost(1, 3), \
        "power: rank 1's own table would have priced drafting differently"


def test_without_startup_timings_every_length_starts_at_one_cost_and_measurement_decides():
    c = _accepting(4, timings=StartupTimings())
    assert c.length(1) == 3, "the same cost everywhere: the most expected tokens"
    for n, seconds in ((3, 0.5), (0, 0.1)):
        for _ in range(4):
            c.record_cycle(1, n, seconds)
    for _ in range(SHARE_EVERY):
        _share(c)
    assert c.length(1) == 0, "measured: 2.95 tokens in 0.5 s lose to 1 token in 0.1 s"


def test_a_catch_up_is_priced_as_a_prompt_where_the_drafters_first_forward_was_timed():
    """100 missed tokens: between the 32- and 128-token prompt timings; without them, as a one-token step
    of 100 rows (the batch-8 step's 0.08 s scaled to 100: 1 s)."""
    drafter = ((1, 0.010), (8, 0.080))
    timed = StartupTimings(target=TIMINGS.target, drafter=drafter, drafter_prefill=((32, 0.020), (128, 0.050)))
    assert timed.catch_up(100) == pytest.approx(0.020 + 0.030 * (100 - 32) / 96)
    assert StartupTimings(target=TIMINGS.target, drafter=drafter).catch_up(100) == pytest.approx(1.0)
    assert timed.catch_up(0) == 0.0 and StartupTimings(drafter=drafter).catch_up(100) == 0.0


def test_verifying_sampled_drafts_is_priced_for_sampled_rows_only():
    """What verifying a sampled draft adds (timed at start-up; 50 ms a drafted row here) is priced at the step's
    share of sampled rows. At the prior (1 of 2 accepted at each position) a sampled row drafting L costs
    0.1 + 0.01 L + 0.05 L s for 1.5, 1.75 or 1.875 tokens, which never beats 1 token in 0.1 s; a greedy row
    drafts 2 (1.75 tokens in 0.12 s, against 1.5 in 0.11 and 1.875 in 0.13), as a sampled one did unpriced."""
    timed = StartupTimings(target=TIMINGS.target, drafter=TIMINGS.drafter, verify=((1, 0.050), (3, 0.150)))
    assert timed.estimate(1, 3) == pytest.approx(0.100 + 0.030 + 0.150)
    assert timed.estimate(1, 3, sampled=0.0) == pytest.approx(0.130) == pytest.approx(TIMINGS.estimate(1, 3))
    assert timed.estimate(1, 2, sampled=0.5) == pytest.approx(0.100 + 0.020 + 0.5 * 0.100)
    assert timed.estimate(1, 0) == pytest.approx(0.100), "a step without drafts verifies none"
    assert DraftLengthController(3, timed).length(1, greedy=0) == 0
    assert DraftLengthController(3, timed).length(1, greedy=1) == 2
    assert DraftLengthController(3, TIMINGS).length(1, greedy=0) == 2
    measured = DraftLengthController(3, timed)
    measured.length(1, greedy=0)
    for _ in range(4):  # sampled cycles measured as estimated with their verification: scale 1
        measured.record_cycle(1, 3, timed.estimate(1, 3))
    for _ in range(SHARE_EVERY):
        _share(measured)
    assert measured.shared[(0, 3)][0] == pytest.approx(1.0)


def test_the_outlook_and_summary_say_why_at_each_batch_size():
    c = _accepting(4)
    assert c.outlook([1, 2, 4, 8]).startswith("drafting pays at batch 1: yes, 3 drafts ")
    # batch 4, one draft: 8 tokens (0.2 s) + the drafter at 4 (0.04 s) for 1.8 tokens a row, against 1 in 0.1 s
    assert "4-7: no (1 drafts 0.75x)" in c.outlook([4]), c.outlook([4])
    c.length(1), c.length(4)
    lines = c.summary()
    assert len(lines) == 2 and lines[0].startswith("batch 1: length 3 last; best 3") and \
        lines[1].startswith("batch 4-7: length 0 last; best 0")
    assert all("start-up estimate" in line for line in lines)


# the simulated pair's start-up timings: the drafter's one-token step 10 ms at batch 1, 40 ms at 16; its first
# forward over a prompt 2 ms a token
SIM_TIMINGS = StartupTimings(target=TIMINGS.target, drafter=((1, 0.010), (16, 0.040)),
                             drafter_prefill=((32, 0.064), (128, 0.256)))


def test_a_request_drafts_only_where_what_it_has_left_pays_the_drafters_catch_up_back():
    """Batch 1, 4 drafts in 5 accepted at each position: 3 drafts give 2.95 tokens in 0.13 s against 1 in
    0.1 s, 0.056 s saved a token. The drafter lacks 100 tokens, 0.2 s to catch up at 2 ms a token
    (SIM_TIMINGS): drafting pays it back with 4 tokens left (0.22 s saved) and not with 3 (0.17 s)."""
    c = _accepting(4, timings=SIM_TIMINGS)
    assert [c.length(1, lambda: (100, left)) for left in (100.0, 4.0, 3.0)] == [3, 3, 0]
    assert c.length(1, lambda: (0, 1.0)) == 3, "nothing to catch up on: drafting pays from the first token"


def _serve_simulated(c: DraftLengthController, steps: int, acceptance, cycle_seconds, prompt: int = 100,
                     request_tokens: int = 32, seed: int = 0) -> list[tuple[int, float, float]]:
    """Serve ``steps`` steps of a simulated pair at batch 1: requests of a ``prompt``-token prompt and
    ``request_tokens`` tokens out, one after another; each drafted position is accepted with probability
    ``acceptance(step)`` (until the first rejection); a cycle at length L takes ``cycle_seconds(L, missed)``,
    ``missed`` the tokens of the request's context its drafter lacks (its whole context until it first
    drafts). Returns (length, seconds, tokens emitted) per step."""
    rng = random.Random(seed)
    out, context, known = [], prompt, 0  # the request's tokens so far; those its drafter has
    length = c.length(1, lambda: (context - known, prompt + request_tokens - context))
    for step in range(steps):
        accepted = 0
        while accepted < length and rng.random() < acceptance(step):
            accepted += 1
        seconds = cycle_seconds(length, context - known)
        out.append((length, seconds, accepted + 1))
        if length:
            known = context + accepted
        context += accepted + 1
        if context - prompt >= request_tokens:  # the next request
            context, known = prompt, 0
        c.record_cycle(1, length, seconds, accepted + 1)
        c.observe([length], [[0] * (accepted + 1)], [False])
        _share(c)
        length = c.length(1, lambda: (context - known, prompt + request_tokens - context))
    return out


def _speed(served: list[tuple[int, float, float]]) -> float:
    """Tokens per second per row."""
    return sum(t for _, _, t in served) / sum(s for _, s, _ in served)


def _never_pays(length: int, missed: int) -> float:
    """A drafter 3x slower than its start-up timing, whose drafts are never accepted, and whose catch-up
    costs 4 ms a token."""
    return 0.100 + 0.030 * length + (0.004 * missed if length else 0.0)


def test_where_drafting_never_pays_learning_costs_at_most_the_loss_budget_and_the_prior():
    """Issue 40: the worst case. The prior (half the drafts accepted) and the start-up timing both say that
    3 drafts pay 1.4x; in truth no draft is ever accepted, and every exploring step pays the drafter's
    catch-up on what it missed. Over 3,000 steps the controller must lose at most LOSS_BUDGET of the
    target alone's speed to exploring, plus what the prior costs (drafting until the first rejections
    show it: about 30 steps, with the first request's catch-up, 0.4% of the run's 300 s here) and a share
    period's cycles. Without the budget (planted: never spent), the same controller loses over 3% here."""
    plain = 1 / _never_pays(0, 0)
    served = _serve_simulated(DraftLengthController(3, SIM_TIMINGS), 3000, lambda step: 0.0, _never_pays)
    drafted = sum(1 for n, _, _ in served if n)
    assert drafted >= 10, "it learned: it drafted, then explored"
    assert _speed(served) / plain >= 1 - LOSS_BUDGET - 0.005, (_speed(served) / plain, drafted)
    unbounded = DraftLengthController(3, SIM_TIMINGS)
    unbounded._spent = lambda b: -math.inf
    assert _speed(_serve_simulated(unbounded, 3000, lambda step: 0.0, _never_pays)) / plain < 0.97


def test_acceptance_that_starts_low_and_rises_is_learned_within_a_few_hundred_steps():
    """Issue 40: 1 draft in 20 accepted for the first 1,500 steps, then 9 in 10 (the prompts changed).
    While low, the loss stays within the budget; once high, drafting resumes and pays: over steps
    2,000-3,000, at least 2x the target alone's speed (3 drafts at 0.9: 3.4 tokens in 0.13 s, 2.6x)."""
    def cycle(length: int, missed: int) -> float:
        return 0.100 + 0.010 * length + (0.002 * missed if length else 0.0)  # catch-up: 2 ms a token

    plain = 1 / cycle(0, 0)
    served = _serve_simulated(DraftLengthController(3, SIM_TIMINGS), 3000, lambda step: 0.05 if step < 1500 else 0.9,
                              cycle)
    assert _speed(served[:1500]) / plain >= 1 - LOSS_BUDGET - 0.005, _speed(served[:1500]) / plain
    assert _speed(served[2000:]) / plain >= 2.0, _speed(served[2000:]) / plain
    resumed = next(i for i in range(1500, 2900) if sum(n == 3 for n, _, _ in served[i:i + 100]) >= 90)
    print(f"3 drafts in 9 steps of 10 (exploring aside) from step {resumed}")
    assert resumed < 1800, resumed


def test_a_length_that_needs_more_acceptance_than_measured_waits_until_that_measure_fades():
    """Issue 40, batch 8 on a 2-core CPU: there a length pays only with nearly every draft accepted (length 3 at
    0.7 s against 0.2 s plain: 3.5 tokens a cycle), at batch 1 with far fewer (length 2: 1.49). Batch 1 drafts
    and measures 6 drafts in 10 accepted: batch 8 then explores nothing (each exploring step there would feed 8
    drafter contexts). Before, every length that would pay were every draft accepted was explored there (planted:
    ``hope`` ignored). Once batch 1 measures 97 in 100, batch 8 explores, and drafts."""
    timings = StartupTimings(target=((1, 0.1), (8, 0.2), (32, 0.4)), drafter=((1, 0.01), (8, 0.1)))
    assert [round(timings.estimate(8, n) / timings.estimate(8, 0), 2) for n in (1, 2, 3)] == [1.83, 2.67, 3.5]

    def serve(c: DraftLengthController, steps: int, acceptance: float, rng: random.Random) -> list[int]:
        """Alternate steps of batch 1 and batch 8 rows that accept each draft at ``acceptance``; batch 8's lengths."""
        chosen = []
        for _ in range(steps):
            for batch in (1, 8):
                n = c.length(batch)
                emitted = [1 + next((j for j in range(n) if rng.random() >= acceptance), n) for _ in range(batch)]
                c.observe([n] * batch, [[0] * t for t in emitted], [False] * batch)
                c.record_cycle(batch, n, timings.estimate(batch, n), sum(emitted) / batch)
                _share(c)
                chosen += [n] if batch == 8 else []
        return chosen

    c, rng = DraftLengthController(3, timings), random.Random(0)
    assert set(serve(c, 20 * EXPLORE_EVERY, 0.6, rng)) == {0} and c.lengths()["1"] == 2
    assert c.expected_tokens(3, hope=True) < 3.5 < 4
    planted = DraftLengthController(3, timings)
    sampled = planted._acceptance[False]
    sampled.rates = lambda step, hope=False: [1.0] * 3 if hope else _Acceptance.rates(sampled, step)
    assert set(serve(planted, 20 * EXPLORE_EVERY, 0.6, random.Random(0))) > {0}, "explored while hope is ignored"
    later = serve(c, 20 * EXPLORE_EVERY, 0.97, rng)
    assert any(later) and later[-EXPLORE_EVERY:].count(3) > EXPLORE_EVERY // 2, later[-EXPLORE_EVERY:]
