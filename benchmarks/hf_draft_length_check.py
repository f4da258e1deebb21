"""How many target tokens does transformers' greedy universal assisted generation draft per step?

Its ``num_assistant_tokens`` = k counts drafter tokens. The drafter's text is
re-tokenized by the target's tokenizer, so one step may propose more or fewer
than k target tokens, where vllm-usd always proposes k target tokens. This script
wraps the candidate generator to count the target tokens proposed per step, and
the tokens per target forward (the benchmark's acceptance length), on the same
prompts and settings as the benchmark's batch-1 transformers rows (T=0).

    .venv/bin/python benchmarks/hf_draft_length_check.py --pair smollm2-gemma3 --prompts 3 --tokens 24
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="gemma3-smollm2", choices=("tiny", "gemma3-smollm2", "smollm2-gemma3"))
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation import candidate_generator as cg

    from benchmarks.run import pair_specs
    from benchmarks.script_io import emit
    from vllm_usd.bench import load_prompts

    pair = pair_specs([args.pair])[0]
    target = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    drafter = AutoModelForCausalLM.from_pretrained(pair.drafter, dtype=torch.float32).eval()
    t_tok, d_tok = AutoTokenizer.from_pretrained(pair.target), AutoTokenizer.from_pretrained(pair.drafter)
    prompts = [p["text"] for p in load_prompts()[0][: args.prompts]]

    proposed: list[int] = []
    original = cg.AssistedCandidateGeneratorDifferentTokenizers.get_candidates

    def counting(self, input_ids, *a, **kw):
        out_ids, logits = original(self, input_ids, *a, **kw)
        proposed.append(int(out_ids.shape[-1] - input_ids.shape[-1]))
        return out_ids, logits

    matches: list[int] = []
    original_update = cg.AssistedCandidateGeneratorDifferentTokenizers.update_candidate_strategy

    def recording(self, input_ids, scores, num_matches):
        matches.append(int(num_matches))
        return original_update(self, input_ids, scores, num_matches)

    cg.AssistedCandidateGeneratorDifferentTokenizers.get_candidates = counting
    cg.AssistedCandidateGeneratorDifferentTokenizers.update_candidate_strategy = recording
    forwards = {"n": 0}
    target.register_forward_hook(lambda *a: forwards.__setitem__("n", forwards["n"] + 1))
    result = {"pair": args.pair, "prompts": args.prompts, "tokens": args.tokens, "by_k": {}}
    for k in args.ks:
        drafter.generation_config.num_assistant_tokens = k
        drafter.generation_config.num_assistant_tokens_schedule = "constant"
        drafter.generation_config.assistant_confidence_threshold = 0.0
        proposed.clear()
        matches.clear()
        produced = calls = 0
        for prompt in prompts:
            enc = t_tok(prompt, return_tensors="pt")
            forwards["n"] = 0
            with torch.inference_mode():
                out = target.generate(**enc, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                                      assistant_model=drafter, tokenizer=t_tok, assistant_tokenizer=d_tok,
                                      pad_token_id=t_tok.eos_token_id if t_tok.pad_token_id is None
                                      else t_tok.pad_token_id)
            produced += out.shape[1] - enc.input_ids.shape[1]
            calls += forwards["n"]
        result["by_k"][k] = {"target_tokens_proposed_per_step": statistics.fmean(proposed) if proposed else 0.0,
                             "steps": len(proposed), "tokens_per_target_forward": produced / max(calls, 1),
                             # [proposed target tokens, of them accepted] -> steps; a step's
                             # proposals past k are what a k-capped proposer cannot offer
                             "proposed_accepted_steps": _pairs(proposed, matches),
                             "accepted_past_k": sum(max(0, m - k) for m in matches),
                             "accepted": sum(matches)}
    return emit(result, args.out)


def _pairs(proposed: list[int], matches: list[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p, m in zip(proposed, matches):
        key = f"{p},{m}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


if __name__ == "__main__":
    sys.exit(main())
