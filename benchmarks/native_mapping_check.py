"""Where vLLM's native heterogeneous-vocab mapping and vllm-usd's differ, measured per pair.

vLLM's ``draft_model`` with ``use_heterogeneous_vocab`` (v1/spec_decode/vocab_mapping.py)
matches tokens by their strings after swapping a leading space marker, and feeds
the drafter its UNK (or EOS) for every target token of the context that it did
not match. vllm-usd matches tokens by the bytes they decode to and re-encodes an
unmatched target token's text with the drafter's tokenizer. This script counts,
on the benchmark prompts tokenized by the target:

- the size of each intersection, and native matches whose tokens decode to different bytes;
- the share of context tokens native hands its drafter as UNK/EOS;
- the share of all drafter-vocabulary ids each side can draft.

    .venv/bin/python benchmarks/native_mapping_check.py [--pairs tiny gemma3-smollm2 smollm2-gemma3] [--out F.json]

No engine starts; it needs vLLM importable (for its VocabMapping) and the tokenizers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def compare(target_path: str, drafter_path: str, texts: list[str]) -> dict:
    from transformers import AutoConfig, AutoTokenizer
    from vllm.v1.spec_decode.vocab_mapping import VocabMapping as NativeMapping

    from vllm_usd.core import VocabMapping
    from vllm_usd.core.token_bytes import build_token_table

    t_tok, d_tok = AutoTokenizer.from_pretrained(target_path), AutoTokenizer.from_pretrained(drafter_path)

    def logits_width(path: str) -> int:
        cfg = AutoConfig.from_pretrained(path)
        return getattr(cfg.get_text_config(), "vocab_size")

    t_size, d_size = logits_width(target_path), logits_width(drafter_path)
    native = NativeMapping(t_tok, d_tok, t_size, d_size, device="cpu")
    ours = VocabMapping.build(t_tok, d_tok, t_size, d_size)
    t_table, d_table = build_token_table(t_tok, t_size), build_token_table(d_tok, d_size)

    n_d2t = native.draft_to_target_ids
    matched = (n_d2t >= 0).nonzero().flatten().tolist()
    wrong = [(d, int(n_d2t[d])) for d in matched
             if d_table.token_bytes[d] != t_table.token_bytes[int(n_d2t[d])]
             and not (d in d_table.special_ids and int(n_d2t[d]) in t_table.special_ids)]
    context_ids = [i for text in texts for i in t_tok(text, add_special_tokens=False)["input_ids"]]
    native_unk = sum(1 for i in context_ids if int(native.target_to_draft_ids[i]) < 0)
    ours_unmatched = sum(1 for i in context_ids if int(ours.target_to_draft[i]) < 0)
    return {
        "target_vocab": t_size, "drafter_vocab": d_size,
        "native_intersection": native.intersection_size, "usd_intersection": ours.size,
        "native_matches_with_different_bytes": len(wrong),
        "native_wrong_examples": [(d_tok.convert_ids_to_tokens(d), t_tok.convert_ids_to_tokens(t))
                                  for d, t in wrong[:5]],
        "context_tokens": len(context_ids),
        "native_context_unk_share": native_unk / max(len(context_ids), 1),
        "usd_context_reencoded_share": ours_unmatched / max(len(context_ids), 1),
        "native_draftable_share": native.intersection_size / d_size,
        "usd_draftable_share": ours.size / d_size,
    }


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="+", default=["tiny", "gemma3-smollm2", "smollm2-gemma3"])
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    from benchmarks.run import pair_specs
    from vllm_usd.bench import load_prompts

    texts = [p["text"] for p in load_prompts()[0]]
    out = {}
    for pair in pair_specs(args.pairs):
        out[pair.name] = row = compare(pair.target, pair.drafter, texts)
        print(f"{pair.name}: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in row.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
