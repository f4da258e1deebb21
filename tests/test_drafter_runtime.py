"""HFDrafterRuntime: batched slot-KV forwards equal a plain transformers forward. No vLLM."""

from __future__ import annotations

import tempfile

import pytest
import torch

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


def test_free_compacts_slots_and_keeps_the_others_exact():
    ref = _llama()
    rt = _runtime(ref, _save(ref))
    seqs = {f"r{i}": list(range(10 + i, 30 + 2 * i)) for i in range(4)}
    for r in seqs:
        rt.add(r)
    rt.forward(list(seqs), [0] * 4, list(seqs.values()))
    rt.free("r0")
    rt.free("r2")
    assert rt.num_requests == 2 and not rt.has("r0")
    out = rt.forward(["r3", "r1"], [len(seqs["r3"]), len(seqs["r1"])], [[7], [8]])
    assert torch.allclose(out[0], _reference_logits(ref, seqs["r3"] + [7])[-1], atol=1e-4)
    assert torch.allclose(out[1], _reference_logits(ref, seqs["r1"] + [8])[-1], atol=1e-4)


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


def test_budget_limits_requests_instead_of_failing():
    ref = _llama()
    # 2 layers * 2 (k, v) * 2 heads * 16 dim * 4 bytes = 512 bytes per token and slot
    rt = _runtime(ref, _save(ref), budget=512 * 256 * 4, max_requests=64)
    accepted = [rt.add(f"r{i}") for i in range(8)]
    assert accepted[:4] == [True] * 4 and not any(accepted[4:])
    rt.free("r1")
    assert rt.add("late")


def test_load_errors_are_clear(tmp_path):
    from vllm_usd.drafter import DrafterLoadError

    with pytest.raises(DrafterLoadError, match="drafter folder not found"):
        load_drafter(str(tmp_path / "missing" / "model"))
    ref = _llama()
    folder = _save(ref)  # weights and config, but no tokenizer
    with pytest.raises(DrafterLoadError, match="no readable tokenizer"):
        load_drafter(folder)


class _HostCopies:
    """Counts device-to-host reads of tensors (``tolist`` and ``item``) while installed."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        for name in ("tolist", "item"):
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, **kwargs):
                self.count += 1
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_forward_next_reads_ids_in_place_and_settles_them_in_one_copy(monkeypatch):
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
    copies = _HostCopies(monkeypatch)
    for ids in steps:
        rows = list(prompts)[: len(ids)]
        want = host.forward(rows, context[: len(ids)], [[t] for t in ids])
        before = copies.count
        got = device.forward_next(rows, context[: len(ids)], torch.tensor(ids))
        assert copies.count == before, "forward_next copied to the host"
        assert torch.allclose(got, want, atol=1e-5)
        context = [n + 1 for n in context[: len(ids)]]
    before = copies.count
    cached = {r: list(device.cached_tokens(r)) for r in prompts}
    assert copies.count == before + 1  # every position's ids, in one copy
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
