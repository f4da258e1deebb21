"""q is exactly the distribution each draft was drawn from. No vLLM."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from vllm_usd.core import DraftSamplingParams, draft_distribution, sample_drafts


def _reference_q(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Plain-Python temperature -> top-k -> top-p, written independently of the code under test."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: (-scaled[i], i))
    keep = set(order[: top_k] if 0 < top_k < len(order) else order)
    kept = [i for i in order if i in keep]
    m = max(scaled[i] for i in kept)
    z = sum(math.exp(scaled[i] - m) for i in kept)
    mass, final = 0.0, []
    for i in kept:
        if mass >= top_p and final:
            break
        final.append(i)
        mass += math.exp(scaled[i] - m) / z
    m = max(scaled[i] for i in final)
    z = sum(math.exp(scaled[i] - m) for i in final)
    return [math.exp(scaled[i] - m) / z if i in final else 0.0 for i in range(len(scaled))]


CASES = [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0), (0.5, 8, 0.6), (2.0, 0, 0.3)]


def test_q_matches_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CASES), 40, generator=g) * 3
    params = DraftSamplingParams.from_lists(
        temperature=[c[0] for c in CASES], top_k=[c[1] for c in CASES], top_p=[c[2] for c in CASES],
        greedy=[False] * len(CASES))
    q = draft_distribution(logits, params)
    for row, (t, k, p) in enumerate(CASES):
        ref = torch.tensor(_reference_q(logits[row].tolist(), t, k, p))
        assert torch.allclose(q[row], ref, atol=1e-6), (t, k, p)
        assert abs(float(q[row].sum()) - 1) < 1e-5


def test_draws_follow_q():
    """N = 20,000 seeded draws per row; chi-square against q; fails at p < 1e-3 (deterministic seed)."""
    logits = torch.randn(len(CASES), 12, generator=torch.Generator().manual_seed(1)) * 2
    params = DraftSamplingParams.from_lists(
        temperature=[c[0] for c in CASES], top_k=[c[1] for c in CASES], top_p=[c[2] for c in CASES],
        greedy=[False] * len(CASES))
    gen = torch.Generator().manual_seed(2)
    n = 20_000
    counts = torch.zeros(len(CASES), 12)
    q_seen = None
    for _ in range(n // 500):
        batch = logits.repeat_interleave(500, dim=0)
        p = DraftSamplingParams.from_lists(
            temperature=params.temperature.repeat_interleave(500).tolist(),
            top_k=params.top_k.repeat_interleave(500).tolist(),
            top_p=params.top_p.repeat_interleave(500).tolist(), greedy=[False] * batch.shape[0])
        idx, q = sample_drafts(batch, p, torch.rand(batch.shape[0], generator=gen))
        assert bool((q.gather(1, idx[:, None]) > 0).all()), "q(draft) must be > 0"
        counts += torch.nn.functional.one_hot(idx, 12).view(len(CASES), 500, 12).sum(1).float()
        q_seen = q.view(len(CASES), 500, 12)[:, 0]
    for row in range(len(CASES)):
        expected = q_seen[row] * n
        support = expected > 0
        assert counts[row][~support].sum() == 0, "drew a token q gives zero mass"
        if int(support.sum()) == 1:
            continue  # a single token: every draw must be it (checked above)
        obs, exp = counts[row][support].double(), expected[support].double()
        _, pval = stats.chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy())
        assert pval >= 1e-3, (CASES[row], pval)


def test_greedy_rows_are_argmax_with_one_hot_q():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    params = DraftSamplingParams.from_lists([0.0, 1.0, 0.0, 0.8], [0] * 4, [1.0] * 4, [True, False, True, False])
    idx, q = sample_drafts(logits, params, torch.rand(4, generator=torch.Generator().manual_seed(0)))
    for row in (0, 2):
        assert idx[row] == logits[row].argmax()
        assert q[row].sum() == 1 and q[row, idx[row]] == 1
    for row in (1, 3):
        assert torch.allclose(q[row], draft_distribution(logits[:row + 1], params.prefix(row + 1))[row])
    all_greedy = DraftSamplingParams.from_lists([0.0] * 4, [0] * 4, [1.0] * 4, [True] * 4)
    idx2, q2 = sample_drafts(logits, all_greedy)
    assert torch.equal(idx2, logits.argmax(-1)) and torch.equal(q2.sum(-1), torch.ones(4))


def test_a_draw_is_q_s_inverse_cdf_and_never_lands_on_a_token_q_leaves_out():
    """Each row's index is the first token whose cumulative q passes the row's uniform; tokens that
    top-k or top-p remove (q = 0), before, between or after the kept ones, are never drawn, even at
    uniforms 0 and just below 1."""
    logits = torch.tensor([[0.0, 5.0, -9.0, 4.0, 0.5, 4.5, -50.0]] * 5)
    params = DraftSamplingParams.from_lists([1.0] * 5, [3] * 5, [1.0] * 5, [False] * 5)
    u = torch.tensor([0.0, 0.3, 0.5, 0.99, 1.0 - 2 ** -24])
    idx, q = sample_drafts(logits, params, u)
    cdf = q.cumsum(-1)
    for row in range(5):
        i = int(idx[row])
        assert q[row, i] > 0, (row, i)
        assert float(cdf[row, i - 1] if i else 0.0) <= float(u[row]) * float(cdf[row, -1]) < float(cdf[row, i])
    assert set(idx.tolist()) <= {1, 3, 5} and idx[0] == 1 and idx[-1] == 5


def test_scatter_keeps_q_on_the_right_target_ids():
    """q over the intersection, scattered to target order, puts each mass on its mapped id."""
    from vllm_usd.core import VocabMapping
    from tests.test_vocab_mapping import _word_level

    target = _word_level(["c", "a", "b", "zz"])
    draft = _word_level(["a", "b", "yy", "c"])
    m = VocabMapping.build(target, draft, min_share=0.0)
    q = torch.tensor([[0.2, 0.3, 0.5]])  # draft ids [0 a, 1 b, 3 c]
    qt = m.scatter_to_target(q)[0]
    assert qt.tolist() == pytest.approx([0.5, 0.2, 0.3, 0.0])


def test_draft_probs_buffer_rows_follow_the_batch_and_stay_zero_elsewhere():
    from vllm_usd.vllm_adapter.q_buffer import DraftProbsBuffer

    target_ids = torch.tensor([5, 1, 7])  # intersection, in draft_ids order
    buf = DraftProbsBuffer(k=2, target_vocab_size=10, target_ids=target_ids, max_rows=4)
    q0 = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    q1 = torch.tensor([[0.1, 0.1, 0.8], [0.0, 0.0, 1.0]])
    out = buf.fill(rows=[2, 0], qs=[q0, q1], num_rows=3)
    assert out.shape == (3, 2, 10)
    assert out[2, 0, [5, 1, 7]].tolist() == pytest.approx([0.2, 0.3, 0.5])
    assert out[0, 1, [5, 1, 7]].tolist() == pytest.approx([0.0, 0.0, 1.0])
    off = torch.ones(10, dtype=torch.bool)
    off[target_ids] = False
    assert out[..., off].abs().sum() == 0
    # next step: rows move; the new q overwrites every intersection column of the rows drafted
    again = buf.fill(rows=[1], qs=[torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.5, 0.5, 0.0]])], num_rows=2)
    assert again[1, 0].tolist() == [0, 1.0, 0, 0, 0, 0, 0, 0, 0, 0]
    assert again[1, 1, [5, 1, 7]].tolist() == pytest.approx([0.5, 0.5, 0.0])
    assert torch.allclose(again[1].sum(-1), torch.ones(2))


def test_request_keys_are_stable_across_processes():
    """Seeds derive from request ids with blake2b, not Python's per-process salted hash()."""
    import os
    import subprocess
    import sys

    from vllm_usd.core.seeding import mix_seed, text_key

    code = "from vllm_usd.core.seeding import text_key, mix_seed; print(text_key('req-17'), mix_seed(3, 5))"
    seen = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        seen.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    assert seen == {f"{text_key('req-17')} {mix_seed(3, 5)}"}
    assert text_key("req-17") != text_key("req-18")
    assert len({mix_seed(a, b) for a in range(20) for b in range(20)}) == 400
    assert all(0 <= mix_seed(a, 1 << 70) < 1 << 63 for a in range(5))


def test_draft_uniforms_seed_by_row_key_and_position():
    from vllm_usd.core.seeding import DraftUniforms

    uniforms = DraftUniforms()

    def draws(keys, positions, seeded, salt=0):
        return uniforms.draw(keys, positions, seeded, salt, depth=3).tolist()

    a = draws([11, 22], [5, 9], [True, False])
    b = draws([11, 33], [5, 9], [True, False])
    assert a[0] == b[0], "a seeded row ignores the rest of the batch"
    assert a[1] != b[1], "the shared draws depend on the unseeded rows"
    assert draws([11, 22], [5, 9], [True, False]) == a, "the same inputs, the same draws (every rank alike)"
    assert DraftUniforms().draw([11, 22], [5, 9], [True, False], 0, 3).tolist() == a, "no state between draws"
    assert draws([11, 22], [6, 9], [True, False])[0] != a[0], "the next step, new draws"
    assert draws([11, 22], [5, 9], [True, False], salt=1)[1] != a[1]
    assert len({x for row in a for x in row}) == 6 and all(0.0 <= x < 1.0 for row in a for x in row)


def test_draft_probs_buffer_is_allocated_once_at_its_bound():
    """max_rows x k x vocabulary x 4 B, allocated before any fill and never replaced; a step with more
    rows than max_num_seqs is refused, not grown into; a proposer whose drafts carry no q holds none."""
    from vllm_usd.vllm_adapter.q_buffer import DraftProbsBuffer

    buf = DraftProbsBuffer(k=3, target_vocab_size=50, target_ids=torch.tensor([4, 9]), max_rows=6)
    assert buf.nbytes == 0 and buf.planned_bytes == 6 * 3 * 50 * 4
    buf.allocate()
    ptr = buf._buf.data_ptr()
    assert buf.nbytes == buf.planned_bytes
    for rows in ([0], [0, 1, 2, 3, 4, 5], [5, 1]):
        buf.fill(rows, [torch.full((len(rows), 2), 0.5)], num_rows=6)
        assert buf._buf.data_ptr() == ptr and buf.nbytes == buf.planned_bytes
    with pytest.raises(ValueError, match="7 rows"):
        buf.fill([6], [torch.full((1, 2), 0.5)], num_rows=7)
    none = DraftProbsBuffer(k=3, target_vocab_size=50, target_ids=torch.tensor([4, 9]), max_rows=6, needed=False)
    none.allocate()
    assert none.planned_bytes == 0 and none.nbytes == 0


def test_drafter_memory_is_checked_against_vllms_budget_not_the_free_memory(monkeypatch):
    """Issue 39, finding 4: on a GPU the drafter may take only what is left of vLLM's budget
    (gpu_memory_utilization x the card, less what is taken), not what happens to be free."""
    import types

    from vllm_usd.vllm_adapter import drafter_memory
    from vllm_usd.vllm_adapter.q_buffer import DraftProbsBuffer

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 16 * gib))  # 6 GiB taken
    allocated = []
    runtime = types.SimpleNamespace(device=torch.device("cuda"), planned_kv_bytes=3 * gib, kv_bytes=0,
                                    allocate=lambda: allocated.append("kv"))
    q = DraftProbsBuffer(k=1, target_vocab_size=1, target_ids=torch.tensor([0]), max_rows=1, needed=False)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.5\) 2048 MiB is left"):
        drafter_memory.allocate_drafter_memory(runtime, q, utilization=0.5)  # 8 GiB budget - 6 taken < 3 needed
    assert not allocated
    drafter_memory.allocate_drafter_memory(runtime, q, utilization=0.6)  # 9.6 - 6 = 3.6 GiB left: fits
    assert allocated == ["kv"]
