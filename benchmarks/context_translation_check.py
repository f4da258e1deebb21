"""How much does the drafter's view of the context cost in acceptance? Measured, teacher-forced.

vllm-usd hands the drafter the target's context token by token: a shared token
through the 1:1 intersection map, an unshared one by decoding it and re-encoding
the text (TLI, arXiv 2502.05202). The drafter thus sees the text cut where the
target's tokenizer cuts it, which may not be how its own tokenizer would cut it.
transformers' greedy universal assisted generation instead re-tokenizes the text
with the drafter's tokenizer.

For the target's greedy continuation of each prompt, at every position this
script takes the drafter's argmax over the shared vocabulary given

- ``translated``: the context as vllm-usd's ContextTranslator builds it, and
- ``canonical``:  the drafter tokenizer's own encoding of the same text,

and counts how often it equals the target's next token. It also counts the
positions where the two contexts differ, where the drafter's own argmax over its
whole vocabulary is a token the target does not share (TLI must draft its
second choice there), where the target's next token is not shared at all
(no draft from the intersection can match it), and the share of misses where the
drafted token and the target's token begin the same text but end in different
places (a cut that token-by-token drafting cannot get right, and re-tokenizing
the drafter's text can). Greedy acceptance lengths per k are
simulated from the match runs as vLLM steps run.

    .venv/bin/python benchmarks/context_translation_check.py --pair gemma3-smollm2 --prompts 3 --tokens 24
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="gemma3-smollm2", choices=("tiny", "gemma3-smollm2", "smollm2-gemma3"))
    parser.add_argument("--prompts", type=int, default=3, help="the first N built-in benchmark prompts")
    parser.add_argument("--tokens", type=int, default=24, help="greedy continuation length")
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.run import pair_specs
    from benchmarks.script_io import emit
    from vllm_usd.analysis.acceptance import _simulate_greedy
    from vllm_usd.bench import load_prompts
    from vllm_usd.core import DraftPair

    pair = pair_specs([args.pair])[0]
    t_tok, d_tok = AutoTokenizer.from_pretrained(pair.target), AutoTokenizer.from_pretrained(pair.drafter)
    target = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    drafter = AutoModelForCausalLM.from_pretrained(pair.drafter, dtype=torch.float32).eval()
    draft_pair = DraftPair.for_models(target, t_tok, drafter, d_tok)
    mapping, bos = draft_pair.mapping, draft_pair.draft_bos
    d_vocab = mapping.draft_vocab_size
    shared = mapping.draft_ids  # [n] drafter ids of the intersection

    is_shared = torch.zeros(d_vocab, dtype=torch.bool)
    is_shared[shared] = True
    outside = {"argmax": 0, "truth": 0, "misses": 0, "same_text_cut_differently": 0}

    def drafted(draft_ids: list[int], count: bool = False) -> int:
        logits = drafter(torch.tensor([draft_ids])).logits[0, -1]  # [drafter vocab]
        if count:  # the drafter's own favourite is a token the target does not have
            outside["argmax"] += int(not is_shared[int(logits.argmax())])
        return int(mapping.target_ids[int(logits[shared].argmax())])

    runs: dict[str, list[list[bool]]] = {"translated": [], "canonical": []}
    differ = positions = 0
    with torch.inference_mode():
        for prompt in [p["text"] for p in load_prompts()[0][: args.prompts]]:
            enc = t_tok(prompt, return_tensors="pt")
            out = target.generate(**enc, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                                  pad_token_id=t_tok.eos_token_id if t_tok.pad_token_id is None else t_tok.pad_token_id)
            ids = out[0].tolist()
            start = enc.input_ids.shape[1]
            translator = draft_pair.translator()
            translator.start(ids[:start])
            run = {"translated": [], "canonical": []}
            for pos in range(start, len(ids)):
                if pos > start:
                    translator.feed([ids[pos - 1]])
                text = mapping.target_table.bytes_of(ids[:pos]).decode("utf-8", errors="replace")
                canonical = d_tok(text, add_special_tokens=False).input_ids
                canonical = ([bos] if bos is not None else []) + canonical
                translated = list(translator.draft_ids)
                differ += translated != canonical
                positions += 1
                truth = ids[pos]
                outside["truth"] += int(mapping.target_to_draft[truth]) < 0  # no intersection draft can match
                guess = drafted(translated, count=True)
                run["translated"].append(guess == truth)
                if guess != truth:  # a miss: is the drafted text a prefix of the target's token, or longer?
                    outside["misses"] += 1
                    g_bytes = mapping.target_table.token_bytes[guess]
                    t_bytes = mapping.target_table.token_bytes[truth]
                    cut = g_bytes and t_bytes and (t_bytes.startswith(g_bytes) or g_bytes.startswith(t_bytes))
                    outside["same_text_cut_differently"] += bool(cut)
                run["canonical"].append(drafted(canonical) == truth if canonical != translated
                                        else run["translated"][-1])
            for key in runs:
                runs[key].append(run[key])

    def length(key: str, k: int) -> float:
        counts = [_simulate_greedy(r, k) for r in runs[key]]
        return sum(c[0] for c in counts) / max(sum(c[1] for c in counts), 1)

    result = {"pair": args.pair, "prompts": args.prompts, "tokens": args.tokens, "positions": positions,
              "contexts_differ_share": differ / max(positions, 1),
              "drafter_argmax_outside_intersection_share": outside["argmax"] / max(positions, 1),
              "target_token_outside_intersection_share": outside["truth"] / max(positions, 1),
              # misses where the draft and the target's token start the same text but end elsewhere
              "misses_cut_differently_share": outside["same_text_cut_differently"] / max(outside["misses"], 1)}
    for key in runs:
        flat = [x for r in runs[key] for x in r]
        result[key] = {"match_rate": sum(flat) / max(len(flat), 1),
                       "greedy_length": {k: length(key, k) for k in (2, 4)}}
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
