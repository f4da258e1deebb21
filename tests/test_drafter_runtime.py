"""HFDrafterRuntime: batched forwards over the paged KV cache equal a plain transformers forward. No vLLM."""

from __future__ import annotations

import tempfile

import pytest
import torch

from vllm_usd.core.device import SyncCounter
from vllm_usd.drafter import HFDrafterRuntime, load_drafter


def _save(model) -> str:
    folder = tempfile.mkdtemp(prefix="usd-rt-")
    model.save_pretrained(folder)
    return folder


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           max_position_embeddings=512, query_pre_attn_scalar=16)
    return Gemma3ForCausalLM(cfg).eval()


def _reference_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def _runtime(ref, tokenizer_free_folder: str, **kw) -> HFDrafterRuntime:
    from transformers import AutoModelForCausalLM

    from vllm_usd.drafter.attention import ATTN_NAME, register_attention

    register_attention()
    model = AutoModelForCausalLM.from_pretrained(tokenizer_free_folder, attn_implementation=ATTN_NAME).eval()
    return HFDrafterRuntime(model, max_len=kw.get("max_len", 512), max_requests=kw.get("max_requests", 8),
                            kv_budget_bytes=kw.get("budget", 1 << 30))


@pytest.mark.parametrize("make", [_llama, _gemma3], ids=["llama", "gemma3-sliding"])
def test_batched_forward_with_rollback_equals_reference(make):
    ref = make()
    rt = _runtime(ref, _save(ref))
    g = torch.Generator().manual_seed(1)
    seqs = {f"r{i}": torch.randint(0, 300, (12 + 9 * i,), generator=g).tolist() for i in range(3)}
    for r in seqs:
        assert rt.add(r)
    cut = {r: len(s) - 3 for r, s in seqs.items()}
    first = rt.forward(list(seqs), [0] * 3, [s[: cut[r]] for r, s in seqs.items()])
    rt.forward(list(seqs), [cut[r] for r in seqs], [[5, 6] for _ in seqs])  # drafts, to be rolled back
    second = rt.forward(list(seqs), [cut[r] for r in seqs], [s[cut[r]:] for r, s in seqs.items()])
    for i, (r, s) in enumerate(seqs.items()):
        full = _reference_logits(ref, s)
        assert torch.allclose(first[i], full[cut[r] - 1], atol=1e-4)
        assert torch.allclose(second[i], full[-1], atol=1e-4)
        assert rt.cached_tokens(r) == s


def test_free_returns_blocks_and_keeps_the_others_exact():
    ref = _llama()
    rt = _runtime(ref, _save(ref))
    seqs = {f"r{i}": list(range(10 + i, 30 + 2 * i)) for i in range(4)}
    for r in seqs:
        rt.add(r)
    rt.forward(list(seqs), [0] * 4, list(seqs.values()))
    free = rt.free_blocks
    rt.free("r0")
    rt.free("r2")
    assert rt.num_requests == 2 and not rt.has("r0")
    assert rt.free_blocks == free + 4  # 20 and 24 tokens: two blocks each
    out = rt.forward(["r3", "r1"], [len(seqs["r3"]), len(seqs["r1"])], [[7], [8]])
    assert torch.allclose(out[0], _reference_logits(ref, seqs["r3"] + [7])[-1], atol=1e-4)
    assert torch.allclose(out[1], _reference_logits(ref, seqs["r1"] + [8])[-1], atol=1e-4)


@pytest.mark.parametrize("make", [_llama, _gemma3], ids=["llama", "gemma3-sliding"])
def test_paged_greedy_decoding_equals_contiguous_token_for_token(make):
    """Three requests decode greedily in turns, so their blocks interleave in the pool (and a freed
    request's blocks are reused out of order); each must generate what the plain model generates on
    its own contiguous cache, with the logits of every step within 1e-4."""
    ref = make()
    rt = _runtime(ref, _save(ref))
    prompts = {"a": [5, 17, 42, 8], "b": list(range(60, 97)), "c": [250, 3]}
    rt.add("z")
    rt.forward(["z"], [0], [list(range(1, 40))])  # holds three blocks, then gives them back mid-way
    for r, p in prompts.items():
        rt.add(r)
        rt.forward([r], [0], [p])
    seqs = {r: list(p) for r, p in prompts.items()}
    last = {r: rt.forward([r], [len(p) - 1], [[p[-1]]])[0] for r, p in prompts.items()}
    for step in range(40):
        if step == 5:
            rt.free("z")
        order = list(seqs) if step % 2 else list(reversed(seqs))
        nxt = {r: int(last[r].argmax()) for r in order}
        out = rt.forward_next(order, [len(seqs[r]) for r in order], torch.tensor([nxt[r] for r in order]))
        for i, r in enumerate(order):
            seqs[r].append(nxt[r])
            last[r] = out[i]
    for r, seq in seqs.items():
        want = _reference_logits(ref, seq)  # [L, V] on one contiguous cache-free forward
        assert [int(x) for x in want[len(prompts[r]) - 1:-1].argmax(-1)] == seq[len(prompts[r]):], r
        assert torch.allclose(last[r], want[-1], atol=1e-4)


def test_long_prefill_runs_apart_and_mixes_with_decodes():
    ref = _llama()
    rt = _runtime(ref, _save(ref))
    rt.add("a")
    rt.add("b")
    rt.forward(["a"], [0], [list(range(40, 50))])
    long_prompt = list(range(1, 120))
    out = rt.forward(["a", "b"], [10, 0], [[3], long_prompt])
    assert torch.allclose(out[0], _reference_logits(ref, list(range(40, 50)) + [3])[-1], atol=1e-4)
    assert torch.allclose(out[1], _reference_logits(ref, long_prompt)[-1], atol=1e-4)


def test_a_long_catch_up_runs_in_chunks_and_the_largest_forward_runs_at_start_up():
    """Issue 39, finding 3: a prompt longer than CATCH_UP_CHUNK is fed a chunk at a time (its masks are
    bounded by a chunk, not by the prompt), exactly; and allocate() already ran the largest forwards serving
    can ask for (one chunk, and every request's PREFILL_SPLIT tokens, at the end of max_len)."""
    from vllm_usd.drafter.hf_runtime import CATCH_UP_CHUNK, PREFILL_SPLIT

    ref = _llama()
    rt = _runtime(ref, _save(ref), max_requests=3)
    shapes = []
    step = rt._step
    rt._step = lambda tokens, *rest: shapes.append(tuple(tokens.shape)) or step(tokens, *rest)
    rt.allocate()
    assert shapes == [(1, CATCH_UP_CHUNK), (3, PREFILL_SPLIT)], shapes
    rt.add("a")
    prompt = [(7 * i) % 300 for i in range(CATCH_UP_CHUNK + 100)]
    shapes.clear()
    out = rt.forward(["a"], [0], [prompt])
    assert shapes == [(1, CATCH_UP_CHUNK), (1, 100)], shapes
    assert torch.allclose(out[0], _reference_logits(ref, prompt)[-1], atol=1e-4)
    assert rt.cached_tokens("a") == prompt


def test_pruned_head_gives_the_same_logits():
    ref = _llama()
    folder = _save(ref)
    full, pruned = _runtime(ref, folder), _runtime(ref, folder)
    rows = torch.tensor([0, 3, 4, 17, 250, 299])
    pruned.set_output_rows(rows)
    for rt in (full, pruned):
        rt.add("x")
    a = full.forward(["x"], [0], [[1, 2, 3, 4]])
    b = pruned.forward(["x"], [0], [[1, 2, 3, 4]])
    assert b.shape == (1, 6)
    assert torch.allclose(a[:, rows], b, atol=1e-5)


def test_a_full_pool_refuses_one_request_and_the_others_draft():
    ref = _llama()
    # 2 layers * 2 (k, v) * 2 heads * 16 dim * 4 bytes = 512 bytes per token: ten 16-token blocks
    rt = _runtime(ref, _save(ref), budget=512 * 16 * 10, max_requests=64)
    assert rt.num_blocks == 10
    for r in ("big", "mid", "small"):
        assert rt.add(r)
    size = rt.kv_bytes
    assert rt.reserve("big", 100)  # 7 blocks
    assert not rt.reserve("mid", 64) and rt.free_blocks == 3  # 4 blocks: refused, nothing taken
    assert rt.reserve("small", 48)
    out = rt.forward(["big", "small"], [0, 0], [list(range(1, 100)), list(range(2, 40))])
    assert torch.allclose(out[1], _reference_logits(ref, list(range(2, 40)))[-1], atol=1e-4)
    with pytest.raises(MemoryError):
        rt.forward(["mid"], [0], [list(range(64))])
    rt.free("big")
    assert rt.free_blocks == 7 and rt.reserve("mid", 64)
    assert rt.kv_bytes == size == 11 * 512 * 16  # one pool, allocated once (block 0 is scratch)


def test_load_errors_are_clear(tmp_path):
    from vllm_usd.drafter import DrafterLoadError

    with pytest.raises(DrafterLoadError, match="drafter folder not found"):
        load_drafter(str(tmp_path / "missing" / "model"))
    ref = _llama()
    folder = _save(ref)  # weights and config, but no tokenizer
    with pytest.raises(DrafterLoadError, match="no readable tokenizer"):
        load_drafter(folder)


def test_forward_next_reads_ids_in_place_and_settles_them_in_one_copy():
    ref = _llama()
    folder = _save(ref)
    host, device = _runtime(ref, folder), _runtime(ref, folder)
    prompts = {"a": list(range(20, 31)), "b": list(range(100, 105)), "c": list(range(7, 25))}
    for rt in (host, device):
        for r, p in prompts.items():
            rt.add(r)
        rt.forward(list(prompts), [0] * 3, list(prompts.values()))
    steps = [[11, 12, 13], [14, 15], [16]]  # drafts at three positions; later positions fewer rows
    context = [len(p) for p in prompts.values()]
    for ids in steps:
        rows = list(prompts)[: len(ids)]
        want = host.forward(rows, context[: len(ids)], [[t] for t in ids])
        tokens = torch.tensor(ids)
        with SyncCounter() as syncs:
            got = device.forward_next(rows, context[: len(ids)], tokens)
        assert syncs.names == [], "forward_next read a tensor on the host"
        assert torch.allclose(got, want, atol=1e-5)
        context = [n + 1 for n in context[: len(ids)]]
    with SyncCounter() as syncs:
        cached = {r: list(device.cached_tokens(r)) for r in prompts}
    assert syncs.names == ["tolist"]  # every position's ids, in one copy
    assert cached == {r: host.cached_tokens(r) for r in prompts}
    assert cached["a"] == prompts["a"] + [11, 14, 16] and cached["c"] == prompts["c"] + [13]
    # a rollback after unsettled ids keeps only what it should
    out = device.forward(["a"], [len(prompts["a"]) + 1], [[99]])
    assert torch.allclose(out[0], _reference_logits(ref, prompts["a"] + [11, 99])[-1], atol=1e-4)
    assert device.cached_tokens("a") == prompts["a"] + [11, 99]



@pytest.mark.parametrize("make", [_llama, _gemma3], ids=["llama", "gemma3-sliding"])
def test_the_forward_step_compiles_whole_and_gives_the_eager_logits(make):
    """torch.compile(fullgraph=True) fails on any graph break (the precondition for graph capture); the
    eager backend keeps this test fast: it checks tracing, not generated kernels."""
    ref = make()
    rt = _runtime(ref, _save(ref))
    prompts = {"a": list(range(20, 41)), "b": list(range(100, 106))}
    for r in prompts:
        rt.add(r)
    rt.forward(list(prompts), [0, 0], list(prompts.values()))
    rt._step = torch.compile(rt._step, fullgraph=True, backend="eager")
    decode = rt.forward(list(prompts), [len(p) for p in prompts.values()], [[7], [8]])  # one token each
    more = rt.forward(["b"], [len(prompts["b"]) + 1], [[9, 10, 11]])  # several tokens, one row
    assert torch.allclose(decode[0], _reference_logits(ref, prompts["a"] + [7])[-1], atol=1e-4)
    assert torch.allclose(decode[1], _reference_logits(ref, prompts["b"] + [8])[-1], atol=1e-4)
    assert torch.allclose(more[0], _reference_logits(ref, prompts["b"] + [8, 9, 10, 11])[-1], atol=1e-4)
