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


def test_intersection_drafting_copies_nothing_to_the_host_between_positions(monkeypatch):
    """TLI's draft loop hands each position's ids to the runtime in place (one host copy per step is the
    proposer's, of the final target ids)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.fixtures import tiny
    from vllm_usd.core.pair import DraftPair
    from vllm_usd.drafter.attention import ATTN_NAME, register_attention
    from vllm_usd.drafting import DraftRows, PhaseTimer
    from vllm_usd.drafting.requests import RequestState
    from vllm_usd.drafting.tli import IntersectionDrafting

    target_dir, drafter_dir = tiny.build_distribution_pair()
    pair = DraftPair.build(AutoTokenizer.from_pretrained(target_dir), AutoTokenizer.from_pretrained(drafter_dir))
    register_attention()
    model = AutoModelForCausalLM.from_pretrained(drafter_dir, attn_implementation=ATTN_NAME).eval()
    rt = HFDrafterRuntime(model, max_len=256, max_requests=4, kv_budget_bytes=1 << 26)
    strategy = IntersectionDrafting(pair.mapping, rt, k=3, pruned_head=True, timer=PhaseTimer(False))
    rows = DraftRows()
    for i, (greedy, temperature) in enumerate([(True, 0.0), (False, 0.8), (False, 1.0)]):
        tr = pair.translator()
        tr.start(list(range(5 + i, 20 + 2 * i)))
        rt.add(f"r{i}")
        rows.rows.append(i)
        rows.req_ids.append(f"r{i}")
        rows.states.append(RequestState(translator=tr, greedy=greedy, temperature=temperature, top_k=0, top_p=1.0,
                                        key=1000 + i, seeded=False, last_token=1 << 30))
        rows.sequences.append(list(tr.draft_ids))
        rows.unchanged.append(0)
        rows.positions.append(len(tr.draft_ids))
        rows.target_tails.append([])
    strategy.draft(rows, salt=0, lengths=[3, 3, 3])  # warm: the first step settles nothing
    copies = _HostCopies(monkeypatch)
    batch = strategy.draft(rows, salt=0, lengths=[3, 2, 1])
    assert copies.count == 1  # catch_up reads the cached ids once: the last step's drafts, in one copy
    assert batch.target_ids.shape == (3, 3) and len(batch.q) == 3
    assert [q.shape[0] for q in batch.q] == [3, 2, 1]
