"""LlamaCppDrafterRuntime on the demo pair's SmolLM2 GGUF: the same model as the converted folder,
batched, rolled back exactly, deterministic. No vLLM."""

from __future__ import annotations

import pytest
import torch

from vllm_usd.drafter.llama_cpp_runtime import llama_cpp_available

pytestmark = pytest.mark.real_pair

if not llama_cpp_available():
    pytest.skip("llama-cpp-python is not installed (scripts/setup-env.sh builds it)", allow_module_level=True)

PROMPTS = ["The capital of France is Paris. The capital of Germany is",
           "def add(a, b):\n    return",
           "Once upon a time"]


@pytest.fixture(scope="module")
def drafters(real_pair):
    from vllm_usd.drafter.select import DrafterChoice, find_gguf, open_drafter

    folder = real_pair["smollm2"]
    gguf = find_gguf(folder, None)
    assert gguf, f"the demo pair keeps its GGUF in {folder}"
    kw = dict(max_len=512, max_requests=8, kv_budget_bytes=1 << 30)
    llama = open_drafter(folder, DrafterChoice("llama_cpp", "gguf", "cpu", gguf), **kw)
    hf = open_drafter(folder, DrafterChoice("transformers", "float32", "cpu"), **kw)
    return llama, hf


def _ids(opened, text):
    return opened.tokenizer(text).input_ids


def test_same_model_as_the_converted_folder(drafters):
    """The GGUF is what the float32 folder was dequantised from: same next-token choices, close logits."""
    llama, hf = drafters
    assert llama.vocab_size == hf.vocab_size
    prompts = [_ids(hf, p) for p in PROMPTS]
    ids = [f"same{i}" for i in range(len(prompts))]
    for o in drafters:
        for r in ids:
            o.runtime.add(r)
    a = llama.runtime.forward(ids, [0] * len(ids), prompts)
    b = hf.runtime.forward(ids, [0] * len(ids), prompts)
    assert a.shape == b.shape == (len(ids), hf.vocab_size)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert (a - b).abs().max() < 0.1 * b.abs().max()  # llama.cpp quantizes activations for its Q4 matmuls
    for o in drafters:
        for r in ids:
            o.runtime.free(r)


def test_rollback_and_batching_give_what_a_fresh_sequence_gives(drafters):
    llama, _ = drafters
    rt = llama.runtime
    rows = torch.tensor([3, 11, 200, 7042, 11452])
    p = _ids(llama, PROMPTS[0])
    rt.add("x")
    rt.add("y")
    rt.add("fresh")
    rt.forward(["x", "y"], [0, 0], [p, _ids(llama, PROMPTS[1])])
    rt.forward(["x"], [len(p)], [[100, 200, 300]])  # three drafts ...
    rolled = rt.forward(["x", "y"], [len(p) + 1, len(rt.cached_tokens("y"))], [[555], [17]])  # ... one kept
    assert rt.cached_tokens("x") == p + [100, 555]
    fresh = rt.forward(["fresh"], [0], [p + [100, 555]])
    assert torch.allclose(rolled[0], fresh[0], atol=1e-3), "rollback must leave no trace of the rejected drafts"
    again = rt.forward(["x", "y"], [len(p) + 1, len(rt.cached_tokens("y")) - 1], [[555], [17]])
    assert torch.equal(again, rolled), "the same call twice gives the same bits (every TP rank must agree)"
    rt.set_output_rows(rows)
    pruned = rt.forward(["fresh"], [len(p) + 1], [[555]])
    assert pruned.shape == (1, 5) and torch.allclose(pruned[0], fresh[0, rows], atol=1e-3)
    for r in ("x", "y", "fresh"):
        rt.free(r)
    assert rt.num_requests == 0


def test_a_few_tokens_run_one_at_a_time_where_timings_say_that_is_faster(drafters):
    """one_at_a_time_where_faster: each token count timed in one call (B requests' one-token step, a prompt) that
    one-token calls in turn beat (here 2 and 4 tokens, not 8 or 32) runs as one-token llama_decode calls from
    then on, and is priced as that many one-token steps. The logits are what one batched call gives, up to
    rounding, and the KV is the same. Timings where batches are cheaper change nothing."""
    llama, _ = drafters
    rt = llama.runtime
    cheap = (((1, 0.010), (2, 0.015)), ((4, 0.030), (32, 0.100)))
    assert rt.one_at_a_time_where_faster(*cheap) == cheap
    calls: list[int] = []
    decode = rt._decode
    rt._decode = lambda chunk, out: (calls.append(len(chunk)), decode(chunk, out))
    p = _ids(llama, PROMPTS[1])
    try:
        for r in ("batched", "single"):
            rt.add(r)
        rt.forward(["batched", "single"], [0, 0], [p, p])
        batched = rt.forward(["batched"], [len(p)], [[100, 200, 300]])
        assert calls[-1] == 3
        steps, prompts = rt.one_at_a_time_where_faster(((1, 0.005), (2, 0.009)), ((4, 0.030), (8, 0.035), (32, 0.1)))
        assert [n for n, _ in steps + prompts] == [1, 2, 4, 8, 32]
        assert [s for _, s in steps + prompts] == pytest.approx([0.005, 0.010, 0.020, 0.035, 0.1]), \
            "sizes up to 4 run as one-token calls, 2 included (cheaper as one call, but below 4): priced as they run"
        calls.clear()
        single = rt.forward(["single"], [len(p)], [[100, 200, 300]])
        assert calls == [1, 1, 1]
        assert torch.equal(single.argmax(-1), batched.argmax(-1))
        assert (single - batched).abs().max() < 0.02 * batched.abs().max(), "one kernel or the other: rounding only"
        calls.clear()
        after = rt.forward(["batched", "single"], [len(p) + 3] * 2, [[7, 8, 9], [7, 8, 9]])  # 6 tokens: one call
        assert calls == [6] and rt.cached_tokens("single") == rt.cached_tokens("batched") == p + [100, 200, 300, 7, 8, 9]
        assert torch.equal(after[0].argmax(-1), after[1].argmax(-1))
    finally:
        del rt._decode
        rt.one_at_a_time_where_faster(*cheap)  # as the other tests expect it
        for r in ("batched", "single"):
            rt.free(r)


def test_sequences_are_limited_and_reused(real_pair):
    from vllm_usd.drafter.select import DrafterChoice, find_gguf, open_drafter

    folder = real_pair["smollm2"]
    opened = open_drafter(folder, DrafterChoice("llama_cpp", "gguf", "cpu", find_gguf(folder, None)),
                          max_len=256, max_requests=2, kv_budget_bytes=1 << 28)
    rt = opened.runtime
    assert rt.add("a") and rt.add("b") and not rt.add("c")
    rt.free("a")
    assert rt.add("c")
    with pytest.raises(ValueError, match="context full"):
        rt.forward(["c"], [0], [[5] * (rt.max_len + 1)])
