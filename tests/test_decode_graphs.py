"""The fixed-shape decode step that CUDA graphs capture, checked on the CPU. No vLLM.

A graph replays the step on the rows padded to a bucket and block tables padded
to a power-of-two width. These tests run that fixed-shape step through
``capture_recorded`` (the same shapes and static buffers, no graph) and compare it
with a plain transformers forward: idle rows, rolled-back rows, bucket reuse,
wider tables and a failed capture. The graph capture itself needs a GPU (``scripts/gpu_check.py``,
check ``graph_replay``).
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.test_drafter_runtime import _gemma3, _llama, _reference_logits, _save
from vllm_usd.drafter import HFDrafterRuntime
from vllm_usd.drafter.decode_graphs import DecodeGraphs
from vllm_usd.drafter.graph_double import capture_recorded


def _runtime(folder: str, capture, **kw) -> HFDrafterRuntime:
    from transformers import AutoModelForCausalLM

    from vllm_usd.drafter.attention import ATTN_NAME, register_attention

    register_attention()
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=ATTN_NAME).eval()
    return HFDrafterRuntime(model, max_len=kw.get("max_len", 512), max_requests=kw.get("max_requests", 8),
                            kv_budget_bytes=1 << 30, capture=capture)


def test_buckets_and_widths_cover_every_batch_and_row_length_up_to_the_caps():
    graphs = DecodeGraphs(lambda *a: None, torch.device("cpu"), max_rows=20, max_blocks=20, capture=capture_recorded)
    assert graphs.buckets == (1, 2, 4, 8, 16, 20) and graphs.widths == (1, 2, 4, 8, 16, 20)
    assert [graphs.bucket(n) for n in (1, 3, 5, 16, 17, 20, 21)] == [1, 4, 8, 16, 20, 20, None]
    assert DecodeGraphs(lambda *a: None, torch.device("cpu"), max_rows=1000, max_blocks=1).buckets[-1] == 256
    assert DecodeGraphs(lambda *a: None, torch.device("cpu"), max_rows=1, max_blocks=512).widths[-1] == 512


def _count_eager_forwards(rt) -> list:
    """From now on, every eager forward of ``rt`` (graph replays run recorded calls, not the step)."""
    calls = []
    step = rt._step
    rt._step = lambda tokens, *rest: calls.append(tuple(tokens.shape)) or step(tokens, *rest)
    return calls


@pytest.mark.parametrize("make", [_llama, _gemma3], ids=["llama", "gemma3-sliding"])
def test_the_fixed_shape_step_gives_the_reference_logits(make):
    ref = make()
    rt = _runtime(_save(ref), capture_recorded)  # the step compiles whole: test_drafter_runtime
    seqs = {"a": list(range(20, 41)), "b": list(range(100, 106)), "c": list(range(7, 19))}
    for r in seqs:
        rt.add(r)
    rt.forward(list(seqs), [0] * 3, list(seqs.values()))
    captured = len(rt.graphs.buckets) * len(rt.graphs.widths)
    assert rt.graphs.captures == captured, "every graph is captured when the memory is taken, before serving"
    eager = _count_eager_forwards(rt)
    # a and c draft (b idle between them), then a's draft is rejected and both draft again
    got = rt.forward_next(["a", "c"], [len(seqs["a"]), len(seqs["c"])], torch.tensor([7, 8]))
    assert torch.allclose(got[0], _reference_logits(ref, seqs["a"] + [7])[-1], atol=1e-4)
    assert torch.allclose(got[1], _reference_logits(ref, seqs["c"] + [8])[-1], atol=1e-4)
    got = rt.forward_next(["c", "a"], [len(seqs["c"]) + 1, len(seqs["a"])], torch.tensor([9, 10]))
    assert torch.allclose(got[0], _reference_logits(ref, seqs["c"] + [8, 9])[-1], atol=1e-4)
    assert torch.allclose(got[1], _reference_logits(ref, seqs["a"] + [10])[-1], atol=1e-4)
    assert eager == [] and rt.graphs.captures == captured, "decode steps are replays only: nothing eager or new"
    # b, idle through both replays, is still exact
    out = rt.forward(["b"], [len(seqs["b"])], [[11]])
    assert torch.allclose(out[0], _reference_logits(ref, seqs["b"] + [11])[-1], atol=1e-4)
    assert rt.cached_tokens("a") == seqs["a"] + [10] and rt.cached_tokens("c") == seqs["c"] + [8, 9]


def test_a_wider_table_and_a_larger_batch_capture_again_and_the_pool_never_moves():
    ref = _llama()
    rt = _runtime(_save(ref), capture_recorded)
    long = list(range(1, 256))  # 16 blocks of 16 tokens
    rt.add("x")
    rt.forward(["x"], [0], [long])
    pool = rt._k[0].data_ptr()
    captured = rt.graphs.captures
    eager = _count_eager_forwards(rt)
    rt.forward_next(["x"], [len(long)], torch.tensor([5]))
    assert rt.kv_bytes > 0
    got = rt.forward_next(["x"], [len(long) + 1], torch.tensor([6]))  # position 256: a 17th block, width 32
    assert torch.allclose(got[0], _reference_logits(ref, long + [5, 6])[-1], atol=1e-4)
    for r in ("y", "z"):
        rt.add(r)
    rt.forward(["y", "z"], [0, 0], [[3, 4, 5], [6, 7]])
    got = rt.forward_next(["x", "z"], [len(long) + 2, 2], torch.tensor([8, 9]))  # two rows of three: bucket 2
    assert eager == [(2, 3)], "only the catch-up ran eagerly"
    assert rt.graphs.captures == captured
    assert torch.allclose(got[0], _reference_logits(ref, long + [5, 6, 8])[-1], atol=1e-4)
    assert torch.allclose(got[1], _reference_logits(ref, [6, 7, 9])[-1], atol=1e-4)
    assert rt._k[0].data_ptr() == pool


def test_a_failed_capture_drafts_eagerly(caplog):
    ref = _llama()

    def broken(step, inputs, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    rt = _runtime(_save(ref), broken)
    with caplog.at_level(logging.WARNING, logger="vllm.usd"):
        rt.add("a")  # takes the memory: the captures fail here, at start-up
        rt.forward(["a"], [0], [[1, 2, 3, 4]])
        got = rt.forward_next(["a"], [4], torch.tensor([5]))
        again = rt.forward_next(["a"], [5], torch.tensor([6]))
    assert rt.graphs.failed and rt.graphs.captures == 0
    assert sum("runs eagerly" in r.getMessage() for r in caplog.records) == 1
    assert torch.allclose(got[0], _reference_logits(ref, [1, 2, 3, 4, 5])[-1], atol=1e-4)
    assert torch.allclose(again[0], _reference_logits(ref, [1, 2, 3, 4, 5, 6])[-1], atol=1e-4)


def test_a_catch_up_padded_past_a_rows_blocks_leaves_the_next_decode_within_the_graphs_width():
    """Issue 39, finding 7: A near the drafter's max_len shares a catch-up with B feeding 16 tokens. The
    catch-up's table is as wide as B's padding makes A's positions (4 blocks, past A's max of 3); the
    decode that continues it must not reuse that width: a graph's table has at most 3."""
    ref = _llama()
    rt = _runtime(_save(ref), capture_recorded, max_len=48)
    a, b = list(range(1, 41)), list(range(50, 82))
    for r in ("A", "B"):
        rt.add(r)
    rt.forward(["A", "B"], [0, 0], [a, b])
    rt.forward(["A", "B"], [40, 32], [[90], list(range(100, 116))])
    got = rt.forward_next(["A"], [41], torch.tensor([91]))
    assert torch.allclose(got[0], _reference_logits(ref, a + [90, 91])[-1], atol=1e-4)


def test_a_capture_failure_on_one_rank_sends_every_rank_eager():
    """Issue 39, finding 6: two tensor-parallel ranks (threads here) capture the same shape at the same step;
    a planted capture failure on rank 1 must send rank 0 down the eager path too, from that step on, or rank
    0's padded graph logits would differ from rank 1's eager ones in the last bits, and so would q."""
    import threading

    ref = _llama()
    folder = _save(ref)
    votes: list[bool] = []
    barrier = threading.Barrier(2)

    def agree(failed: bool) -> bool:  # what compat.tp_any does across ranks: any rank's failure, on every rank
        votes.append(failed)
        barrier.wait()
        return any(votes)

    def broken(step, inputs, pool):
        raise RuntimeError("planted capture failure on rank 1")

    runtimes = [_runtime(folder, capture_recorded), _runtime(folder, broken)]
    for rt in runtimes:
        rt.graphs._agree = agree
    got: dict[int, list[torch.Tensor]] = {}

    def rank(i: int) -> None:
        rt = runtimes[i]
        rt.add("a")
        rt.forward(["a"], [0], [[1, 2, 3, 4]])
        got[i] = [rt.forward_next(["a"], [4], torch.tensor([5])), rt.forward_next(["a"], [5], torch.tensor([6]))]

    threads = [threading.Thread(target=rank, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert votes == [False, True] or votes == [True, False], votes
    assert all(rt.graphs.failed and rt.graphs.captures == 0 for rt in runtimes)
    for a, b in zip(got[0], got[1]):
        assert torch.equal(a, b), "both ranks ran the same (eager) step"


@pytest.mark.parametrize("make", [_llama, _gemma3], ids=["llama", "gemma3-sliding"])
def test_the_catch_up_after_verification_replays_a_captured_step_padded_to_k_plus_1(make):
    """Issue 39: after verification each row feeds its accepted drafts and the bonus token (1..k+1 per row).
    That catch-up replays the step captured for k + 1 tokens per row, padding written to the scratch block:
    the reference logits, no eager forward, and the padding touches no row's cache (the next decode is
    still exact)."""
    ref = make()
    from transformers import AutoModelForCausalLM

    from vllm_usd.drafter.attention import ATTN_NAME, register_attention

    register_attention()
    model = AutoModelForCausalLM.from_pretrained(_save(ref), attn_implementation=ATTN_NAME).eval()
    rt = HFDrafterRuntime(model, max_len=64, max_requests=4, kv_budget_bytes=1 << 30, capture=capture_recorded,
                          catch_up_tokens=4)
    seqs = {"a": list(range(20, 34)), "b": list(range(100, 106)), "c": list(range(7, 19))}  # a ends at a block's edge
    for r in seqs:
        rt.add(r)
    rt.forward(list(seqs), [0] * 3, list(seqs.values()))  # a prompt: 12..14 tokens, more than 4
    assert rt.forwards == {"replayed": 0, "eager": 0, "long": 1}
    eager = _count_eager_forwards(rt)
    # a keeps all 14 and adds 4 (into a new block), b rolls back one and adds 1, c keeps 10 and adds 2
    new = {"a": [40, 41, 42, 43], "b": [44], "c": [45, 46]}
    keep = {"a": 14, "b": 5, "c": 10}
    got = rt.forward(list(new), list(keep.values()), list(new.values()))
    for i, r in enumerate(new):
        seqs[r] = seqs[r][:keep[r]] + new[r]
        assert torch.allclose(got[i], _reference_logits(ref, seqs[r])[-1], atol=1e-4), r
    nxt = rt.forward_next(["a", "b", "c"], [len(seqs[r]) for r in ("a", "b", "c")], torch.tensor([50, 51, 52]))
    for i, (r, t) in enumerate(zip(("a", "b", "c"), (50, 51, 52))):
        assert torch.allclose(nxt[i], _reference_logits(ref, seqs[r] + [t])[-1], atol=1e-4), r
    assert eager == [] and rt.forwards["replayed"] == 2 and rt.forwards["eager"] == 0
    assert rt.graphs.captures == 2 * len(rt.graphs.buckets) * len(rt.graphs.widths)
