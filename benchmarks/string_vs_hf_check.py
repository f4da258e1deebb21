"""vllm-usd's string-level drafting against transformers' universal assisted generation, step by step.

Both on the same text and the same float32 drafter, no vLLM. transformers
runs its greedy assisted generation (k drafter tokens a step, constant
schedule, no confidence stop, as the benchmark's ``hf_assisted`` rows), and its
every step is logged: the position, the target ids it proposed, how many the
target accepted. vllm-usd's ``StringDrafting`` (the code the proposer runs,
with the transformers drafter runtime) is then run teacher-forced on
transformers' own output: at each step its committed text is the output so
far, its proposal is checked against the output's next tokens, and it moves
on by the accepted tokens plus one, as a target step would. Where both
systems draft from the same position, their proposals are compared.

    .venv/bin/python benchmarks/string_vs_hf_check.py --pair gemma3-smollm2 --prompts 6 --tokens 32 --ks 4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _hf_steps(target, drafter, t_tok, d_tok, prompt: str, tokens: int, k: int):
    """transformers' output ids (prompt included), prompt length, and its steps: (position, proposed, accepted)."""
    import torch
    from transformers.generation import candidate_generator as cg

    steps: list[list] = []
    cls = cg.AssistedCandidateGeneratorDifferentTokenizers
    get, update = cls.get_candidates, cls.update_candidate_strategy

    def logged_get(self, input_ids, *a, **kw):
        out_ids, logits = get(self, input_ids, *a, **kw)
        steps.append([int(input_ids.shape[-1]), out_ids[0, input_ids.shape[-1]:].tolist(), None])
        return out_ids, logits

    def logged_update(self, input_ids, scores, num_matches):
        steps[-1][2] = int(num_matches)
        return update(self, input_ids, scores, num_matches)

    drafter.generation_config.num_assistant_tokens = k
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.assistant_confidence_threshold = 0.0
    enc = t_tok(prompt, return_tensors="pt")
    cls.get_candidates, cls.update_candidate_strategy = logged_get, logged_update
    try:
        with torch.inference_mode():
            out = target.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                  assistant_model=drafter, tokenizer=t_tok, assistant_tokenizer=d_tok,
                                  pad_token_id=t_tok.eos_token_id if t_tok.pad_token_id is None else t_tok.pad_token_id)
    finally:
        cls.get_candidates, cls.update_candidate_strategy = get, update
    return out[0].tolist(), int(enc.input_ids.shape[1]), [tuple(s) for s in steps]


def _canonical_rows(rows, t_tok, d_tok, ids: list[int], pos: int):
    """The same rows with the drafter context transformers gives its assistant: the drafter's own
    tokenization of the committed text (decoded without special tokens), nothing pending."""
    import copy
    import types

    from vllm_usd.drafting.requests import DraftRows

    text = t_tok.decode(ids[:pos], skip_special_tokens=True)
    state = copy.copy(rows.states[0])
    state.translator = types.SimpleNamespace(pending_bytes=b"")  # all StringDrafting reads of it
    return DraftRows(rows=[0], req_ids=list(rows.req_ids), states=[state],
                     sequences=[d_tok(text, add_special_tokens=True)["input_ids"]], unchanged=[0],
                     positions=list(rows.positions), target_tails=list(rows.target_tails))


def _usd_steps(strings, table, ids: list[int], prompt_len: int, k: int, req_id: str, canonical=None,
               start: int | None = None):
    """StringDrafting teacher-forced on ``ids``: (position, proposed, accepted) per step.

    ``start``: the first position drafted (default: right after the prompt, as transformers drafts;
    ``prompt_len + 1`` is vLLM's first drafting step, after the prefill step wrote one token).

    ``canonical``: (target tokenizer, drafter tokenizer) to draft from the drafter's own
    tokenization of the committed text instead of vllm-usd's context translation.
    """
    import numpy as np

    from vllm_usd.drafting.requests import RequestSampling

    steps, pos, history = [], start or prompt_len, np.array([ids])
    while pos < len(ids):
        rows, lengths = table.collect([req_id], [[ids[pos - 1]]], np.array([pos]), history,
                                      sampling=lambda r: RequestSampling(), length_of=lambda r, s: k)
        if canonical is not None and len(rows):
            rows = _canonical_rows(rows, *canonical, ids, pos)
        proposed = strings.draft(rows, lengths)[0] if len(rows) else []
        accepted = 0
        while accepted < len(proposed) and pos + accepted < len(ids) and proposed[accepted] == ids[pos + accepted]:
            accepted += 1
        steps.append((pos, list(proposed), accepted))
        pos += accepted + 1
    table.forget(req_id)
    return steps


def sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact sign test: the chance of a split at least this uneven if each side is equally likely."""
    from math import comb

    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(comb(n, i) for i in range(min(wins, losses) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="gemma3-smollm2", choices=("tiny", "gemma3-smollm2", "smollm2-gemma3"))
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--drafter-context", choices=("by_text", "tokens", "canonical"), default="by_text",
                        help="vllm-usd's context translation for string drafting (by_text, as the proposer), "
                             "its 1:1 translation of shared tokens (tokens, as TLI), or the drafter's own "
                             "tokenization of the whole committed text each step (canonical, as transformers)")
    parser.add_argument("--examples", type=int, default=12, help="shared positions to print where the two differ")
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.run import pair_specs
    from benchmarks.script_io import emit
    from vllm_usd.bench import load_prompts
    from vllm_usd.core.pair import DraftPair
    from vllm_usd.core.retokenize import TargetRetokenizer
    from vllm_usd.drafter.attention import ATTN_NAME, register_attention
    from vllm_usd.drafter.hf_runtime import HFDrafterRuntime
    from vllm_usd.drafting import PhaseTimer
    from vllm_usd.drafting.requests import RequestTable
    from vllm_usd.drafting.string_level import StringDrafting, default_budget

    pair_spec = pair_specs([args.pair])[0]
    register_attention()
    target = AutoModelForCausalLM.from_pretrained(pair_spec.target, dtype=torch.float32).eval()
    drafter = AutoModelForCausalLM.from_pretrained(pair_spec.drafter, dtype=torch.float32).eval()
    slot_drafter = AutoModelForCausalLM.from_pretrained(pair_spec.drafter, dtype=torch.float32,
                                                        attn_implementation=ATTN_NAME).eval()
    t_tok, d_tok = AutoTokenizer.from_pretrained(pair_spec.target), AutoTokenizer.from_pretrained(pair_spec.drafter)
    pair = DraftPair.build(t_tok, d_tok, target_vocab_size=int(target.get_output_embeddings().weight.shape[0]),
                           draft_vocab_size=int(slot_drafter.get_output_embeddings().weight.shape[0]))
    prompts = [p["text"] for p in load_prompts()[0][: args.prompts]]

    def text(ids):
        return t_tok.decode(ids)

    result = {"pair": args.pair, "prompts": args.prompts, "tokens": args.tokens, "drafter": "transformers float32",
              "drafter_context": args.drafter_context,
              "by_k": {}}
    for k in args.ks:
        runtime = HFDrafterRuntime(slot_drafter, max_len=4096, max_requests=1, kv_budget_bytes=1 << 30)
        strings = StringDrafting(pair.mapping, TargetRetokenizer(t_tok, pair.mapping.target_table), runtime,
                                 budget=default_budget(k), timer=PhaseTimer(False))
        table = RequestTable(pair, runtime, k=default_budget(k), always_greedy=False, seed=0,
                             drafts_text=lambda temperature: args.drafter_context == "by_text")
        # steps, proposed, accepted; "..._after_first": leaving out each text's first generated token, which
        # transformers drafts before its first target forward and vLLM writes in its prefill step, undrafted
        # tokens: a step writes its accepted drafts and one token of the target's, but not past the
        # text's end, where generation stops (transformers never proposes past it; the teacher-forced
        # replay would count a token there)
        totals = {name: [0, 0, 0, 0] for name in ("hf", "usd", "hf_after_first", "usd_after_first")}
        # where both drafted from the same position: who accepted more; "capped" counts transformers'
        # accepted drafts up to k, the most vLLM verifies (its k counts drafter tokens, not target tokens)
        shared = {"positions": 0, "hf_more": 0, "usd_more": 0, "same": 0, "hf_accepted": 0, "usd_accepted": 0,
                  "hf_more_capped": 0, "usd_more_capped": 0, "hf_accepted_capped": 0}
        examples = []
        for n, prompt in enumerate(prompts):
            ids, prompt_len, hf = _hf_steps(target, drafter, t_tok, d_tok, prompt, args.tokens, k)
            usd = _usd_steps(strings, table, ids, prompt_len, k, f"p{n}",
                             canonical=(t_tok, d_tok) if args.drafter_context == "canonical" else None)
            usd_vllm = _usd_steps(strings, table, ids, prompt_len, k, f"p{n}v", start=prompt_len + 1,
                                  canonical=(t_tok, d_tok) if args.drafter_context == "canonical" else None)
            hf_after = [(p, prop, a) for p, prop, a in hf if p > prompt_len]
            for name, steps in (("hf", hf), ("usd", usd), ("hf_after_first", hf_after), ("usd_after_first", usd_vllm)):
                totals[name][0] += len(steps)
                totals[name][1] += sum(len(p) for _, p, _ in steps)
                totals[name][2] += sum(a for _, _, a in steps)
                totals[name][3] += sum(min(a + 1, len(ids) - pos) for pos, _, a in steps)
            by_pos = {p: (prop, a) for p, prop, a in usd}
            for p, prop, a in hf:
                if p not in by_pos:
                    continue
                uprop, ua = by_pos[p]
                shared["positions"] += 1
                shared["hf_accepted"] += a
                shared["usd_accepted"] += ua
                key = "hf_more" if a > ua else "usd_more" if ua > a else "same"
                shared[key] += 1
                shared["hf_accepted_capped"] += min(a, k)
                if min(a, k) != ua:
                    shared["hf_more_capped" if min(a, k) > ua else "usd_more_capped"] += 1
                if a != ua and len(examples) < args.examples:
                    examples.append({"prompt": n, "position": p - prompt_len, "committed_tail": text(ids[max(p - 6, 0):p]),
                                     "truth": text(ids[p:p + max(len(prop), len(uprop))]),
                                     "hf": [text([t]) for t in prop], "hf_accepted": a,
                                     "usd": [text([t]) for t in uprop], "usd_accepted": ua})
        result["by_k"][k] = {
            name: {"steps": s, "proposed_per_step": pr / max(s, 1), "accepted_per_step": ac / max(s, 1),
                   "tokens_per_step": tok / max(s, 1)} for name, (s, pr, ac, tok) in totals.items()}
        # two-sided sign test over the shared positions where the two differ: is either system ahead?
        shared["sign_test_p"] = sign_test_p(shared["hf_more"], shared["usd_more"])
        shared["sign_test_p_capped"] = sign_test_p(shared["hf_more_capped"], shared["usd_more_capped"])
        result["by_k"][k]["shared_positions"] = shared
        result["by_k"][k]["usd_counters"] = dict(table.counters) | dict(strings.counters)
        result["by_k"][k]["examples"] = examples
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
