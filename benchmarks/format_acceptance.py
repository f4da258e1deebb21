"""What each drafter weight format costs in acceptance, teacher-forced on the target's own text. No vLLM.

The target (transformers, float32) writes its greedy continuation of each prompt. On
that text, for every drafter format, ``estimate_acceptance`` (vllm_usd/analysis/acceptance.py,
TLI as the proposer drafts it) gives:

- the greedy match rate and the simulated greedy acceptance length at each k;
- at ``--temperature``, the mean acceptance probability sum_x min(p, q) and the expected
  acceptance length of sampled drafting with q.

Formats: ``float32``, ``bfloat16``, ``int8`` (transformers on the CPU), ``gguf`` (llama.cpp on the
drafter's GGUF as it is) and ``gguf:<type>`` (the GGUF requantized to a llama.cpp type,
``usd.drafter_gguf_type``). Every format drafts the same text, so the differences are the
format's alone.

    .venv/bin/python benchmarks/format_acceptance.py --pair gemma3-smollm2 --prompts 24 --tokens 48 \\
        --formats float32 bfloat16 int8 gguf gguf:q8_0 gguf:iq4_nl --out r.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _target_texts(target, t_tok, prompts: list[str], tokens: int) -> tuple[list[list[int]], list[int]]:
    """The target's greedy continuation of each prompt: (prompt + text ids, prompt lengths)."""
    import torch

    seqs, starts = [], []
    pad = t_tok.eos_token_id if t_tok.pad_token_id is None else t_tok.pad_token_id
    with torch.inference_mode():
        for prompt in prompts:
            enc = t_tok(prompt, return_tensors="pt")
            out = target.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                  pad_token_id=pad)
            seqs.append(out[0].tolist())
            starts.append(int(enc.input_ids.shape[1]))
    return seqs, starts


def _runtime(folder: str, fmt: str, max_len: int):
    """A drafter runtime of ``folder`` in format ``fmt`` (see the module docstring)."""
    from vllm_usd.drafter.select import DrafterChoice, find_gguf, open_drafter

    kw = dict(max_len=max_len, max_requests=1, kv_budget_bytes=1 << 30)
    if fmt.startswith("gguf"):
        gguf_type = fmt.partition(":")[2] or "file"
        opened = open_drafter(folder, DrafterChoice("llama_cpp", "gguf", "cpu", find_gguf(folder, None), gguf_type),
                              **kw)
    else:
        opened = open_drafter(folder, DrafterChoice("transformers", fmt, "cpu"), **kw)
    return opened.runtime, opened.choice.dtype


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="gemma3-smollm2", choices=("tiny", "gemma3-smollm2", "smollm2-gemma3"))
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--formats", nargs="+", default=["float32", "bfloat16", "int8", "gguf"])
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.run import pair_specs
    from benchmarks.script_io import emit
    from vllm_usd.analysis.acceptance import estimate_acceptance
    from vllm_usd.bench import load_prompts
    from vllm_usd.drafter import load_drafter

    spec = pair_specs([args.pair])[0]
    target = AutoModelForCausalLM.from_pretrained(spec.target, dtype=torch.float32).eval()
    t_tok = AutoTokenizer.from_pretrained(spec.target)
    drafter, d_tok = load_drafter(spec.drafter)  # float32: the vocabulary size, and the float32 row
    prompts = [p["text"] for p in load_prompts()[0][: args.prompts]]
    started = time.perf_counter()
    seqs, starts = _target_texts(target, t_tok, prompts, args.tokens)
    max_len = 4 * max(len(s) for s in seqs) + 64  # room for the drafter's cut of the longest text
    rows = []
    for fmt in args.formats:
        runtime, dtype = _runtime(spec.drafter, fmt, max_len)
        # greedy picks do not change with the temperature: one pass gives both
        est = estimate_acceptance(target, t_tok, drafter, d_tok, seqs, starts, ks=args.ks, runtime=runtime,
                                  temperature=args.temperature)
        row = {"format": fmt, "drafter_dtype": dtype, "positions": est.positions,
               "greedy_match_rate": est.greedy_match_rate, "greedy_length": est.greedy_length,
               "mean_alpha": est.mean_alpha, "sampled_length": est.sampled_length}
        rows.append(row)
        print(f"{fmt:>12}: match {row['greedy_match_rate']:.3f}, alpha {row['mean_alpha']:.3f}, greedy "
              + " ".join(f"k{k}={v:.2f}" for k, v in est.greedy_length.items()) + ", sampled "
              + " ".join(f"k{k}={v:.2f}" for k, v in est.sampled_length.items()), file=sys.stderr, flush=True)
        del runtime
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "pair": args.pair,
              "prompts": args.prompts, "tokens": args.tokens, "temperature": args.temperature,
              "seconds": time.perf_counter() - started, "rows": rows}
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
