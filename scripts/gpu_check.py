"""The vLLM-free pieces of vllm-usd on an accelerator (or the CPU): one JSON summary.

    python scripts/gpu_check.py            # cuda if torch sees one, else cpu
    bash scripts/gpu_check.sh              # the same, from the repo root

Needs torch, transformers and tokenizers only (a GPU machine that cannot install vLLM
runs it). Checks, each with "ok":
- runtime_vs_eager: the transformers drafter runtime on the device (batched, with a
  rollback) gives the logits of a plain eager transformers forward on the same device;
- q_sums_to_one: sampled drafts on the device: q sums to 1 over the intersection, is
  positive at the draft and zero outside the intersection once scattered;
- draft_loop_host_copies: TLI's draft loop (3 positions, mixed greedy and sampled rows) on
  the device reads nothing back to the host between positions (``tolist``/``item`` counted:
  the one read is the next step's settle); on cuda it also reports the synchronizing calls
  ``torch.cuda.set_sync_debug_mode("warn")`` sees (host-to-device copies of positions count there);
- graph_replay: the one-token decode step replayed from CUDA graphs captured per batch bucket
  (``vllm_usd/drafter/decode_graphs.py``) gives the eager runtime's logits, through idle and
  rolled-back rows; on cuda also the decode-step times with and without graphs. On the CPU,
  where there is no graph, the same fixed-shape step runs through ``replay_eagerly``;
- step_ms: decode-step times of a SmolLM2-135M-shaped drafter (random weights, so no
  download) per weight format and batch size, against the weight-read limit.
Exit code 1 when a check fails.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def runtime_vs_eager(device: str) -> dict:
    from transformers import AutoModelForCausalLM

    from tests.fixtures import tiny
    from vllm_usd.drafter.select import DrafterChoice, open_drafter

    _, drafter = tiny.build_distribution_pair()
    opened = open_drafter(drafter, DrafterChoice("transformers", "float32", device), max_len=256, max_requests=4,
                          kv_budget_bytes=1 << 28)
    eager = AutoModelForCausalLM.from_pretrained(drafter, dtype=torch.float32).to(device).eval()
    rt = opened.runtime
    a, b = [5, 17, 42, 9, 33, 8, 21], [60, 2, 2, 71]
    rt.add("a")
    rt.add("b")
    rt.forward(["a", "b"], [0, 0], [a + [99, 98], b])  # two drafts for "a" ...
    got = rt.forward(["a", "b"], [len(a) + 1, len(b)], [[7], [3]])  # ... one rejected, then a step for both
    with torch.no_grad():
        want = torch.stack([eager(torch.tensor([a + [99, 7]], device=device)).logits[0, -1],
                            eager(torch.tensor([b + [3]], device=device)).logits[0, -1]]).float()
    err = float((got - want).abs().max())
    return {"ok": err < 1e-3 and got.device.type == torch.device(device).type, "max_abs_err": err,
            "logits_device": str(got.device)}


def q_sums_to_one(device: str) -> dict:
    from vllm_usd.core.sampling import DraftSamplingParams, sample_drafts
    from vllm_usd.core.seeding import position_generators
    from vllm_usd.vllm_adapter.q_buffer import DraftProbsBuffer

    torch.manual_seed(0)
    n, vocab, batch, k = 500, 800, 6, 2
    target_ids = torch.randperm(vocab)[:n].sort().values
    logits = torch.randn(batch, n, device=device) * 3
    params = DraftSamplingParams.from_lists(temperature=[0.0, 0.7, 1.0, 1.3, 0.9, 1.0], top_k=[0, 0, 20, 0, 5, 0],
                                            top_p=[1.0, 0.9, 1.0, 0.8, 1.0, 1.0],
                                            greedy=[True, False, False, False, False, False], device=device)
    params.generators, shared = position_generators([1, 2, 3, 4, 5, 6], [10] * batch, [False, True] * 3, 0, device)
    index, q = sample_drafts(logits, params, shared)
    buf = DraftProbsBuffer(k, vocab, target_ids, device).fill(list(range(batch)), [q, q], batch)  # [B, k, V]
    sums = q.sum(-1)
    outside = torch.ones(vocab, dtype=torch.bool, device=device)
    outside[target_ids.to(device)] = False
    ok = (bool(torch.allclose(sums, torch.ones_like(sums), atol=1e-5))
          and bool((q.gather(-1, index.unsqueeze(-1)) > 0).all())
          and float(buf[:, :, outside].abs().max()) == 0.0 and str(q.device).startswith(torch.device(device).type))
    return {"ok": ok, "max_sum_err": float((sums - 1).abs().max())}


def draft_loop_host_copies(device: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.fixtures import tiny
    from vllm_usd.core.pair import DraftPair
    from vllm_usd.drafter.attention import ATTN_NAME, register_attention
    from vllm_usd.drafter.hf_runtime import HFDrafterRuntime
    from vllm_usd.drafting import DraftRows, PhaseTimer
    from vllm_usd.drafting.requests import RequestState
    from vllm_usd.drafting.tli import IntersectionDrafting

    target_dir, drafter_dir = tiny.build_distribution_pair()
    pair = DraftPair.build(AutoTokenizer.from_pretrained(target_dir), AutoTokenizer.from_pretrained(drafter_dir))
    register_attention()
    model = AutoModelForCausalLM.from_pretrained(drafter_dir, attn_implementation=ATTN_NAME).to(device).eval()
    rt = HFDrafterRuntime(model, max_len=256, max_requests=4, kv_budget_bytes=1 << 26)
    strategy = IntersectionDrafting(pair.mapping, rt, k=3, pruned_head=True, timer=PhaseTimer(False))
    rows = DraftRows()
    for i, temperature in enumerate((0.0, 0.8, 1.0)):
        tr = pair.translator()
        tr.start(list(range(5 + i, 20 + 2 * i)))
        rt.add(f"r{i}")
        for column, value in ((rows.rows, i), (rows.req_ids, f"r{i}"), (rows.unchanged, 0), (rows.target_tails, []),
                              (rows.sequences, list(tr.draft_ids)), (rows.positions, len(tr.draft_ids))):
            column.append(value)
        rows.states.append(RequestState(translator=tr, greedy=temperature == 0.0, temperature=temperature, top_k=0,
                                        top_p=1.0, key=1000 + i, seeded=False, last_token=1 << 30))
    strategy.draft(rows, salt=0, lengths=[3, 3, 3])
    rt.cached_tokens("r0")  # settle the warm-up step's ids
    copies = {"n": 0}
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "item")}

    def counting(name):
        def read(tensor, *args, **kwargs):
            copies["n"] += 1
            return originals[name](tensor, *args, **kwargs)
        return read

    import warnings

    on_cuda = torch.device(device).type == "cuda"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for name in originals:
                setattr(torch.Tensor, name, counting(name))
            if on_cuda:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            batch = strategy.draft(rows, salt=0, lengths=[3, 2, 1])
        finally:
            if on_cuda:
                torch.cuda.set_sync_debug_mode("default")
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)
    syncs = [str(w.message)[:120] for w in caught if "synchroniz" in str(w.message)]
    return {"ok": copies["n"] == 0 and tuple(batch.target_ids.shape) == (3, 3), "host_reads": copies["n"],
            "cuda_sync_warnings": len(syncs) if on_cuda else None, "first_sync_warning": syncs[0] if syncs else None}


def graph_replay(device: str) -> dict:
    from transformers import AutoModelForCausalLM

    from tests.fixtures import tiny
    from vllm_usd.drafter.attention import ATTN_NAME, register_attention
    from vllm_usd.drafter.decode_graphs import capture_cuda_graph, replay_eagerly
    from vllm_usd.drafter.hf_runtime import HFDrafterRuntime

    on_cuda = torch.device(device).type == "cuda"
    capture = capture_cuda_graph if on_cuda else replay_eagerly
    _, drafter_dir = tiny.build_distribution_pair()
    register_attention()
    model = AutoModelForCausalLM.from_pretrained(drafter_dir, dtype=torch.float32,
                                                 attn_implementation=ATTN_NAME).to(device).eval()
    eager = HFDrafterRuntime(model, max_len=256, max_requests=4, kv_budget_bytes=1 << 26)
    graphs = HFDrafterRuntime(model, max_len=256, max_requests=4, kv_budget_bytes=1 << 26, capture=capture)
    prompts = {"a": list(range(20, 41)), "b": list(range(100, 106)), "c": list(range(7, 19))}
    errors = []
    for rt in (eager, graphs):
        for r in prompts:
            rt.add(r)
        rt.forward(list(prompts), [0] * 3, list(prompts.values()))
    n = {r: len(p) for r, p in prompts.items()}
    # (rows, their keep): b idle, then a rolled back by one, then all three, then a alone
    steps = [(["a", "c"], [n["a"], n["c"]]), (["a", "c"], [n["a"], n["c"] + 1]),
             (["b", "a", "c"], [n["b"], n["a"] + 1, n["c"] + 2]), (["a"], [n["a"] + 2])]
    for s, (rows, keep) in enumerate(steps):
        ids = torch.tensor([10 + 7 * s + i for i in range(len(rows))], device=device)
        want = eager.forward_next(rows, keep, ids)
        got = graphs.forward_next(rows, keep, ids)
        errors.append(float((got - want).abs().max()))
    same_cache = all(eager.cached_tokens(r) == graphs.cached_tokens(r) for r in prompts)
    out = {"capture": "cuda_graph" if on_cuda else "replay_eagerly (no CUDA graph on this device)",
           "max_abs_err": max(errors), "captures": graphs.graphs.captures, "capture_failed": graphs.graphs.failed,
           "decode_ms": _graph_decode_times(device) if on_cuda else None}
    out["ok"] = max(errors) < 1e-3 and same_cache and graphs.graphs.captures > 0 and not graphs.graphs.failed
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
            for s in range(13):  # three warm-up steps (the first one captures)
                torch.cuda.synchronize()
                start = time.perf_counter()
                rt.forward_next(ids, [CONTEXT] * batch, tokens)  # roll back the last step's token, decode one
                torch.cuda.synchronize()
                if s >= 3:
                    times.append(time.perf_counter() - start)
            row[name] = 1000 * sorted(times)[len(times) // 2]
        rows.append(row)
    return rows


def _smollm2_config():
    from transformers import LlamaConfig

    from vllm_usd.drafter.attention import ATTN_NAME

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                       tie_word_embeddings=True, attn_implementation=ATTN_NAME)


def step_times(device: str) -> dict:
    from transformers import LlamaForCausalLM

    from benchmarks.drafter_step import read_bandwidth, step_times as time_steps
    from vllm_usd.drafter.attention import register_attention
    from vllm_usd.drafter.hf_runtime import HFDrafterRuntime
    from vllm_usd.drafter.weight_formats import quantize_int8

    register_attention()
    cfg = _smollm2_config()
    on_cpu = torch.device(device).type == "cpu"
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
            times = time_steps(rt, batch, 10, device)
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
    checks = (("runtime_vs_eager", runtime_vs_eager), ("q_sums_to_one", q_sums_to_one),
              ("draft_loop_host_copies", draft_loop_host_copies), ("graph_replay", graph_replay),
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
