"""The vLLM-free pieces of vllm-usd on an accelerator (or the CPU): one JSON summary.

    python scripts/gpu_check.py            # cuda if torch sees one, else cpu
    bash scripts/gpu_check.sh              # the same, from the repo root

Needs torch, transformers and tokenizers only (a GPU machine that cannot install vLLM
runs it). Checks, each with "ok"; exit code 1 when one fails:
- paged_vs_contiguous: three requests decode greedily in turns on the paged KV cache (their
  blocks interleave, a freed request's blocks are reused): the same tokens as a plain eager
  transformers forward on the device, and every step's logits within 1e-3;
- q_sums_to_one: sampled drafts on the device: q sums to 1 over the intersection, is
  positive at the draft and zero outside the intersection once scattered;
- draft_syncs: one TLI step (3 positions, greedy, sampled and seeded rows) makes at most one
  host read, and a string-drafting step one per drafter forward. Counted by
  ``SyncCounter``, and on cuda by ``torch.cuda.set_sync_debug_mode("warn")``: any other
  synchronizing call fails the check;
- graph_replay: every (tokens per row, batch bucket, table width) graph is captured when the drafter
  takes its memory, before serving (``vllm_usd/drafter/decode_graphs.py``); decode steps and the
  catch-up after verification (up to k + 1 tokens per row) then replay them
  only (no eager forward, no new capture, reserved memory unchanged) after memory the graphs
  must not read was filled with junk, and give the eager runtime's logits through idle and
  rolled-back rows; on cuda also the decode-step times with and without graphs. On the CPU,
  where there is no graph, the same steps run through ``capture_recorded``, which fails a replay
  that reads freed memory;
- memory: the KV pool and the q buffer are allocated in full up front; a load of mixed-length
  requests, freed as they end, leaves both where they were and every block back in the pool
  (on cuda also ``torch.cuda.memory_allocated`` before and after);
- step_ms: decode-step times of a SmolLM2-135M-shaped drafter (random weights, so no
  download) per weight format and batch size, against the weight-read limit. On the CPU, 2 of its
  30 layers and 2 steps each: that run only keeps the script from rotting.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def paged_vs_contiguous(device: str) -> dict:
    from transformers import AutoModelForCausalLM

    from tests.fixtures.drafting import tiny_drafting

    _, _, rt = tiny_drafting(device, pruned_head=False)
    plain = AutoModelForCausalLM.from_pretrained(rt.model.config._name_or_path, dtype=torch.float32).to(device).eval()
    prompts = {"a": [5, 17, 42, 9], "b": list(range(60, 97)), "c": [250, 3]}
    rt.add("z")
    rt.forward(["z"], [0], [list(range(1, 40))])  # three blocks, given back mid-way
    seqs, last = {}, {}
    for r, p in prompts.items():
        rt.add(r)
        last[r] = rt.forward([r], [0], [p])[0]
        seqs[r] = list(p)
    errors, same = [], True
    for step in range(24):
        if step == 4:
            rt.free("z")
        order = list(seqs) if step % 2 else list(reversed(seqs))
        nxt = {r: int(last[r].argmax()) for r in order}
        out = rt.forward_next(order, [len(seqs[r]) for r in order], torch.tensor([nxt[r] for r in order], device=device))
        for i, r in enumerate(order):
            seqs[r].append(nxt[r])
            last[r] = out[i]
    with torch.no_grad():
        for r, seq in seqs.items():
            want = plain(torch.tensor([seq], device=device)).logits[0].float()  # [L, V]
            n = len(prompts[r])
            same &= want[n - 1:-1].argmax(-1).tolist() == seq[n:]
            errors.append(float((last[r] - want[-1]).abs().max()))
    return {"ok": same and max(errors) < 1e-3, "greedy_equal": same, "max_abs_err": max(errors),
            "tokens_per_request": 24}


def q_sums_to_one(device: str) -> dict:
    from vllm_usd.core.sampling import DraftSamplingParams, sample_drafts
    from vllm_usd.core.seeding import DraftUniforms
    from vllm_usd.vllm_adapter.q_buffer import DraftProbsBuffer

    torch.manual_seed(0)
    n, vocab, batch, k = 500, 800, 6, 2
    target_ids = torch.randperm(vocab)[:n].sort().values
    logits = torch.randn(batch, n, device=device) * 3
    params = DraftSamplingParams.from_lists(temperature=[0.0, 0.7, 1.0, 1.3, 0.9, 1.0], top_k=[0, 0, 20, 0, 5, 0],
                                            top_p=[1.0, 0.9, 1.0, 0.8, 1.0, 1.0],
                                            greedy=[True, False, False, False, False, False], device=device)
    uniforms = DraftUniforms().draw([1, 2, 3, 4, 5, 6], [10] * batch, [False, True] * 3, 0, depth=1)[:, 0]
    index, q = sample_drafts(logits, params, uniforms.to(device))
    buf = DraftProbsBuffer(k, vocab, target_ids, device, max_rows=batch).fill(list(range(batch)), [q, q], batch)  # [B, k, V]
    sums = q.sum(-1)
    outside = torch.ones(vocab, dtype=torch.bool, device=device)
    outside[target_ids.to(device)] = False
    ok = (bool(torch.allclose(sums, torch.ones_like(sums), atol=1e-5))
          and bool((q.gather(-1, index.unsqueeze(-1)) > 0).all())
          and float(buf[:, :, outside].abs().max()) == 0.0 and str(q.device).startswith(torch.device(device).type))
    return {"ok": ok, "max_sum_err": float((sums - 1).abs().max())}


def draft_syncs(device: str) -> dict:
    from tests.fixtures.drafting import forwards_of, run_counted, tli_and_string

    tli, tli_rows, strings, string_rows = tli_and_string(device)
    forwards = forwards_of(tli.runtime)
    batch, tli_reads, tli_cuda = run_counted(device, lambda: tli.draft(tli_rows, salt=0, lengths=[3, 2, 1]))
    _, settle_reads, settle_cuda = run_counted(device, lambda: tli.runtime.cached_tokens("r0"))
    string_forwards = forwards_of(strings.runtime)
    drafted, string_reads, string_cuda = run_counted(device, lambda: strings.draft(string_rows, [3, 3, 3]))
    allowed_string = len(string_forwards)
    cuda_ok = tli_cuda is None or (len(tli_cuda) <= 1 and not settle_cuda and len(string_cuda) <= allowed_string)
    ok = (len(tli_reads) <= 1 and not settle_reads and len(string_reads) <= allowed_string and cuda_ok
          and len(forwards) == 3 and [len(t) for t in batch.target_ids] == [3, 2, 1])
    return {"ok": ok, "tli_host_reads": tli_reads + settle_reads, "tli_cuda_syncs": tli_cuda,
            "string_forwards": allowed_string, "string_host_reads": len(string_reads),
            "string_cuda_syncs": string_cuda, "string_drafted": [len(d) for d in drafted]}


def memory(device: str) -> dict:
    from tests.fixtures.drafting import tiny_drafting
    from vllm_usd.vllm_adapter.q_buffer import DraftProbsBuffer

    pair, _, rt = tiny_drafting(device, pruned_head=True)
    on_cuda = torch.device(device).type == "cuda"
    q = DraftProbsBuffer(3, pair.mapping.target_vocab_size, pair.mapping.target_ids, device, max_rows=4)
    rt.allocate()
    q.allocate()
    sizes = (rt.kv_bytes, q.nbytes)
    if on_cuda:
        torch.cuda.synchronize()
    before = torch.cuda.memory_allocated() if on_cuda else None
    g = torch.Generator().manual_seed(0)
    live: dict[str, int] = {}
    for step in range(60):  # requests of 8 to 200 tokens come, decode a few tokens and go
        if len(live) < 4:
            r = f"q{step}"
            rt.add(r)
            n = int(torch.randint(8, 200, (1,), generator=g))
            rt.forward([r], [0], [torch.randint(1, 200, (n,), generator=g).tolist()])
            live[r] = n
        ids = list(live)
        rt.forward_next(ids, [live[r] for r in ids], torch.full((len(ids),), 7, device=device))
        for r in ids:
            live[r] += 1
        q.fill(list(range(len(ids))), [torch.full((len(ids), pair.mapping.size), 1.0 / pair.mapping.size,
                                                  device=device)], len(ids))
        if step % 3 == 2:
            rt.free(ids[0])
            del live[ids[0]]
    for r in list(live):
        rt.free(r)
    if on_cuda:
        torch.cuda.synchronize()
    after = torch.cuda.memory_allocated() if on_cuda else None
    ok = (rt.kv_bytes, q.nbytes) == sizes and rt.free_blocks == rt.num_blocks
    if on_cuda:
        ok &= after - before < (16 << 20)  # nothing left behind but the allocator's small change
    return {"ok": ok, "kv_pool_bytes": sizes[0], "q_buffer_bytes": sizes[1], "blocks": rt.num_blocks,
            "blocks_free_after": rt.free_blocks, "cuda_allocated_before": before, "cuda_allocated_after": after}


def graph_replay(device: str) -> dict:
    from transformers import AutoModelForCausalLM

    from tests.fixtures import tiny
    from vllm_usd.drafter.attention import ATTN_NAME, register_attention
    from vllm_usd.drafter.decode_graphs import capture_cuda_graph
    from vllm_usd.drafter.graph_double import capture_recorded
    from vllm_usd.drafter.hf_runtime import HFDrafterRuntime

    on_cuda = torch.device(device).type == "cuda"
    capture = capture_cuda_graph if on_cuda else capture_recorded
    _, drafter_dir = tiny.build_distribution_pair()
    register_attention()
    model = AutoModelForCausalLM.from_pretrained(drafter_dir, dtype=torch.float32,
                                                 attn_implementation=ATTN_NAME).to(device).eval()
    eager = HFDrafterRuntime(model, max_len=256, max_requests=4, kv_budget_bytes=1 << 26, catch_up_tokens=4)
    graphs = HFDrafterRuntime(model, max_len=256, max_requests=4, kv_budget_bytes=1 << 26, capture=capture,
                              catch_up_tokens=4)
    prompts = {"a": list(range(20, 41)), "b": list(range(100, 106)), "c": list(range(7, 19))}
    errors = []
    for rt in (eager, graphs):
        for r in prompts:
            rt.add(r)  # the first takes the memory: graphs.allocate() captures every graph here
        rt.forward(list(prompts), [0] * 3, list(prompts.values()))
    captured = graphs.graphs.captures
    # index lifetimes (issue 39, finding 1): fill memory a graph could wrongly read, then replay
    junk = [torch.full((1 << 16,), -7, dtype=torch.long, device=device) for _ in range(64)]
    del junk
    eager_decodes = []
    step = graphs._step
    graphs._step = lambda tokens, *rest: eager_decodes.append(tuple(tokens.shape)) or step(tokens, *rest)
    reserved = torch.cuda.memory_reserved() if on_cuda else None
    n = {r: len(p) for r, p in prompts.items()}
    # (rows, their keep): b idle, then a rolled back by one, then all three, then a alone
    steps = [(["a", "c"], [n["a"], n["c"]]), (["a", "c"], [n["a"], n["c"] + 1]),
             (["b", "a", "c"], [n["b"], n["a"] + 1, n["c"] + 2]), (["a"], [n["a"] + 2])]
    for s, (rows, keep) in enumerate(steps):
        ids = torch.tensor([10 + 7 * s + i for i in range(len(rows))], device=device)
        want = eager.forward_next(rows, keep, ids)
        got = graphs.forward_next(rows, keep, ids)
        errors.append(float((got - want).abs().max()))
    # the catch-up after verification (1..k+1 tokens per row, here k = 3) replays the k + 1 graph
    rows, keep = ["c", "a", "b"], [n["c"] + 1, n["a"] + 3, n["b"] + 1]
    new = [[60, 61, 62, 63], [64], [65, 66]]
    errors.append(float((graphs.forward(rows, keep, new) - eager.forward(rows, keep, new)).abs().max()))
    same_cache = all(eager.cached_tokens(r) == graphs.cached_tokens(r) for r in prompts)
    grew = torch.cuda.memory_reserved() - reserved if on_cuda else 0
    out = {"capture": "cuda_graph" if on_cuda else "capture_recorded (no CUDA graph on this device)",
           "max_abs_err": max(errors), "captured_at_start": captured,
           "expected": 2 * len(graphs.graphs.buckets) * len(graphs.graphs.widths),
           "captured_while_serving": graphs.graphs.captures - captured, "eager_decodes": len(eager_decodes),
           "reserved_growth_bytes": grew, "capture_failed": graphs.graphs.failed,
           "decode_ms": _graph_decode_times(device) if on_cuda else None}
    out["ok"] = (max(errors) < 1e-3 and same_cache and captured == out["expected"] > 0 and not graphs.graphs.failed
                 and out["captured_while_serving"] == 0 and not eager_decodes and grew == 0)
    return out


def _graph_decode_times(device: str) -> list[dict]:
    """forward_next on a SmolLM2-135M-shaped drafter (random weights, bfloat16), eager against graphs."""
    from transformers import LlamaForCausalLM

    from benchmarks.drafter_step import CONTEXT
    from vllm_usd.drafter.attention import register_attention
    from vllm_usd.drafter.decode_graphs import capture_cuda_graph
    from vllm_usd.drafter.hf_runtime import HFDrafterRuntime

    register_attention()
    torch.manual_seed(0)
    model = LlamaForCausalLM(_smollm2_config()).eval().requires_grad_(False).to(torch.bfloat16).to(device)
    rows = []
    for batch in (1, 8, 32):
        row = {"batch": batch}
        for name, capture in (("eager_ms", None), ("graph_ms", capture_cuda_graph)):
            rt = HFDrafterRuntime(model, max_len=256, max_requests=32, kv_budget_bytes=1 << 30, capture=capture)
            rt.set_output_rows(torch.arange(46_000))
            ids = [f"r{i}" for i in range(batch)]
            for r in ids:
                rt.add(r)
            rt.forward(ids, [0] * batch, [[(7 * i + j) % 1000 + 10 for j in range(CONTEXT)] for i in range(batch)])
            tokens = torch.arange(batch, device=device) + 11
            times = []
            for s in range(13):  # three warm-up steps
                torch.cuda.synchronize()
                start = time.perf_counter()
                rt.forward_next(ids, [CONTEXT] * batch, tokens)  # roll back the last step's token, decode one
                torch.cuda.synchronize()
                if s >= 3:
                    times.append(time.perf_counter() - start)
            row[name] = 1000 * sorted(times)[len(times) // 2]
        rows.append(row)
    return rows


def _smollm2_config(layers: int = 30):
    from transformers import LlamaConfig

    from vllm_usd.drafter.attention import ATTN_NAME

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                       tie_word_embeddings=True, attn_implementation=ATTN_NAME)


def step_times(device: str) -> dict:
    from transformers import LlamaForCausalLM

    from benchmarks.drafter_step import read_bandwidth, step_times as time_steps
    from vllm_usd.drafter.attention import register_attention
    from vllm_usd.drafter.hf_runtime import HFDrafterRuntime
    from vllm_usd.drafter.weight_formats import quantize_int8

    register_attention()
    on_cpu = torch.device(device).type == "cpu"
    cfg = _smollm2_config(2 if on_cpu else 30)
    formats = ["float32", "bfloat16", "int8"] if on_cpu else ["float32", "bfloat16", "float16"]
    bandwidth = read_bandwidth(device, gib=0.5)
    out = {"bandwidth_gb_s": bandwidth / 1e9, "rows": []}
    for fmt in formats:
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
        model = model.to(torch.float32 if fmt == "int8" else getattr(torch, fmt)).to(device)
        if fmt == "int8":
            model = quantize_int8(model)
        rt = HFDrafterRuntime(model, max_len=128, max_requests=32, kv_budget_bytes=1 << 30)
        rt.set_output_rows(torch.arange(46_000))
        head = rt._head_weight
        embed = model.get_input_embeddings().weight
        read = rt.param_bytes - embed.numel() * embed.element_size() + head.numel() * head.element_size()
        for batch in (1, 8, 32):
            times = time_steps(rt, batch, 2 if on_cpu else 10, device)
            ms = 1000 * sorted(times)[len(times) // 2]
            out["rows"].append({"format": fmt, "batch": batch, "step_ms": ms,
                                "read_limit_ms": 1000 * read / bandwidth, "vs_limit": ms / (1000 * read / bandwidth)})
        del model, rt
    out["ok"] = True
    return out


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
    summary: dict = {"device": device, "torch": torch.__version__,
                     "gpu": torch.cuda.get_device_name(0) if torch.device(device).type == "cuda" else None}
    checks = (("paged_vs_contiguous", paged_vs_contiguous), ("q_sums_to_one", q_sums_to_one),
              ("draft_syncs", draft_syncs), ("graph_replay", graph_replay), ("memory", memory),
              ("step_ms", step_times))
    for name, check in checks:
        try:
            summary[name] = check(device)
        except Exception as exc:  # noqa: BLE001 - one failed check must not hide the others
            summary[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    summary["ok"] = all(summary[name]["ok"] for name, _ in checks)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
