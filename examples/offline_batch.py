"""Offline batch inference with vllm-usd, and the acceptance rate from vLLM's own metrics.

    python examples/offline_batch.py --target TARGET_DIR --drafter DRAFTER_DIR [-k 3]

Without --target/--drafter it uses the converted real pair (Gemma-3-270m drafted by SmolLM2-135M).
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    import vllm_usd

    if not (args.target and args.drafter):
        from vllm_usd.demo_pair import ensure_real_pair

        pair = ensure_real_pair()
        args.target, args.drafter = pair["gemma3"], pair["smollm2"]

    llm = LLM(model=args.target, dtype="float32", enforce_eager=True, max_model_len=1024,
              disable_log_stats=False,  # needed for get_metrics()
              **vllm_usd.speculative_args(drafter=args.drafter, k=args.k))
    prompts = ["The capital of France is", "A short poem about the sea:\n", "def is_prime(n):\n"]
    for out in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens)):
        print(repr(out.prompt), "->", repr(out.outputs[0].text))

    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    print(f"drafts {drafts}, accepted tokens {accepted}, acceptance length {1 + accepted / max(drafts, 1):.2f}")
    print("acceptance by position:", [round(p / max(drafts, 1), 2) for p in per_pos])


if __name__ == "__main__":  # vLLM spawns its engine: keep LLM() under this guard
    main()
