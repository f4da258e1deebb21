"""Does the target alone write the same greedy text in vLLM as in transformers?

The benchmark compares vllm-usd's acceptance in vLLM with transformers' assisted
generation, each on the text its own target writes. This check says whether those texts
are the same: for each prompt, the target alone in vLLM (the benchmark's settings: EOS
masked, ``min_tokens``) and in transformers (``min_new_tokens``), both greedy, float32,
and the first position where they part, if any.

    .venv/bin/python benchmarks/target_text_check.py --pair smollm2-gemma3 --prompts 6 --tokens 32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="smollm2-gemma3", choices=("tiny", "gemma3-smollm2", "smollm2-gemma3"))
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.run import pair_specs
    from benchmarks.script_io import emit
    from vllm_usd.bench import load_prompts
    from vllm_usd.bench.vllm_systems import engine

    spec = pair_specs([args.pair])[0]
    prompts = [p["text"] for p in load_prompts()[0][: args.prompts]]
    t_tok = AutoTokenizer.from_pretrained(spec.target)
    target = AutoModelForCausalLM.from_pretrained(spec.target, dtype=torch.float32).eval()
    pad = t_tok.eos_token_id if t_tok.pad_token_id is None else t_tok.pad_token_id
    hf = []
    with torch.inference_mode():
        for prompt in prompts:
            enc = t_tok(prompt, return_tensors="pt")
            out = target.generate(**enc, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                                  pad_token_id=pad)
            hf.append(out[0, enc.input_ids.shape[1]:].tolist())
    del target

    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, min_tokens=args.tokens, ignore_eos=True)
    with engine(spec.target, 1, {}) as llm:
        vllm_ids = [list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]
    rows = []
    for prompt, a, b in zip(prompts, vllm_ids, hf):
        at = _first_difference(a, b)
        rows.append({"prompt": prompt[:60], "same": at is None, "first_difference": at,
                     "vllm_text": t_tok.decode(a), "transformers_text": t_tok.decode(b)})
    same_tokens = sum(r["first_difference"] if r["first_difference"] is not None else args.tokens for r in rows)
    return emit({"command": " ".join([Path(sys.executable).name, *sys.argv]), "pair": args.pair,
                 "tokens": args.tokens, "identical_texts": sum(r["same"] for r in rows), "texts": len(rows),
                 "tokens_before_first_difference": same_tokens, "rows": rows}, args.out)


if __name__ == "__main__":
    sys.exit(main())
