"""The transformers systems: the target alone, and universal assisted generation, at batch 1."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from vllm_usd.bench.plan import BenchEvent, BenchPlan, EventSink, PairSpec


def hf_rows(pair: PairSpec, plan: BenchPlan, prompts: list[str], emit: EventSink) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    rows: list[dict] = []
    target = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    t_tok: Any = None
    d_tok: Any = None
    drafter: Any = None
    calls = {"n": 0}
    hook = target.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    matches: list[int] = []  # accepted drafts of each assisted step, in order
    from transformers.generation import candidate_generator

    assisted = candidate_generator.AssistedCandidateGenerator
    update = assisted.update_candidate_strategy

    def logged_update(self, input_ids, scores, num_matches):
        matches.append(int(num_matches))
        return update(self, input_ids, scores, num_matches)

    def generate(prompt: str, temperature: float, k: int | None) -> tuple[int, int, int]:
        """(tokens generated, target forwards, tokens the first forward gave)"""
        enc = t_tok(prompt, return_tensors="pt")
        kwargs: dict[str, Any] = dict(max_new_tokens=plan.max_tokens, min_new_tokens=plan.max_tokens,
                                      do_sample=temperature > 0,
                                      pad_token_id=t_tok.eos_token_id if t_tok.pad_token_id is None
                                      else t_tok.pad_token_id)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        if k is not None:
            drafter.generation_config.num_assistant_tokens = k
            drafter.generation_config.num_assistant_tokens_schedule = "constant"
            drafter.generation_config.assistant_confidence_threshold = 0.0
            kwargs.update(assistant_model=drafter, tokenizer=t_tok, assistant_tokenizer=d_tok)
        calls["n"] = 0
        matches.clear()
        with torch.inference_mode():
            out = target.generate(**enc, **kwargs)
        produced = int(out.shape[1] - enc.input_ids.shape[1])
        return produced, calls["n"], min(matches[0] + 1, produced) if matches else 1

    settings: list[tuple[str, int | None]] = []
    if "hf_plain" in plan.systems:
        settings.append(("hf_plain", None))
    if "hf_assisted" in plan.systems:
        settings += [("hf_assisted", k) for k in plan.ks]
    assisted.update_candidate_strategy = logged_update
    try:
        for temperature in plan.temperatures:
            # fresh per temperature: sampled assisted generation prunes the assistant's LM head in
            # place and caches its vocabulary translator by tokenizer object, so renew both
            drafter = AutoModelForCausalLM.from_pretrained(pair.drafter, dtype=torch.float32).eval()
            t_tok = AutoTokenizer.from_pretrained(pair.target)
            d_tok = AutoTokenizer.from_pretrained(pair.drafter)
            for system, k in settings:
                emit(BenchEvent("setting", f"{pair.name}: {system} k={k} T={temperature} batch=1"))
                generate(prompts[0], temperature, k)  # warm-up
                runs, tokens_per_call, after_first = [], [], []
                for _ in range(plan.repeats):
                    start, produced, forwards, first = time.perf_counter(), 0, 0, 0
                    for p in prompts:
                        n, f, n_first = generate(p, temperature, k)
                        produced += n
                        forwards += f
                        first += n_first
                    runs.append(produced / (time.perf_counter() - start))
                    # assisted generation drafts before its first target forward, so every forward
                    # (the prompt's included) verifies drafts: tokens per forward is its acceptance length
                    tokens_per_call.append(produced / max(forwards, 1))
                    # vLLM writes each request's first token in its prefill step, undrafted; from the
                    # second token on, the two systems draft the same positions
                    after_first.append((produced - first) / max(forwards - len(prompts), 1))
                rows.append({"pair": pair.name, "system": system, "k": k, "temperature": temperature, "batch": 1,
                             "status": "ok", "tok_s_runs": runs, "tok_s": statistics.median(runs),
                             # tokens per decoding forward of the target: assisted generation's acceptance length
                             "acceptance_length": statistics.fmean(tokens_per_call) if k else None,
                             "acceptance_length_after_first": statistics.fmean(after_first) if k else None,
                             "per_position_acceptance": None, "draft_tokens_per_step": k,
                             "num_prompts": len(prompts)})
    finally:
        assisted.update_candidate_strategy = update
        hook.remove()
        del target, drafter
        gc.collect()
    return rows
