"""Is transformers' universal assisted generation lossless under sampling?

For a few prompts, draws the first generated token N times with transformers'
``generate(do_sample=True)``: once with the target alone (the control) and once
with universal assisted generation (``assistant_model`` + ``assistant_tokenizer``).
Each sample set is compared with the exact target distribution
softmax(logits / T) by a chi-square goodness-of-fit test (bins with an expected
count below 5 are pooled). The control should pass; a lossless method should
pass too. The benchmark compares acceptance lengths with transformers, so this
says whether its sampled acceptance is comparable at all.

    .venv/bin/python benchmarks/hf_sampling_check.py --pair tiny --n 300
    .venv/bin/python benchmarks/hf_sampling_check.py --pair gemma3-smollm2 --n 300

With the default alpha of 1e-3 per test, the control fails by chance with
probability 1e-3 per prompt.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path


def pool_bins(counts: dict[int, int], expected: list[float], floor: float = 5.0) -> tuple[list[int], list[float]]:
    """Chi-square bins: every token expected at least ``floor`` times gets its own bin; the rest
    (observations on near-zero mass included) are pooled, and a pool below ``floor`` joins the
    smallest bin. Totals are kept exactly, so no observation is dropped."""
    n = sum(counts.values())
    big = sorted((i for i, e in enumerate(expected) if e >= floor), key=lambda i: expected[i])
    obs = [counts.get(i, 0) for i in big]
    exp = [expected[i] for i in big]
    rest_obs, rest_exp = n - sum(obs), sum(expected) - sum(exp)
    if rest_exp >= floor or not obs:
        obs.append(rest_obs)
        exp.append(rest_exp)
    else:
        obs[0] += rest_obs
        exp[0] += rest_exp
    return obs, exp


def first_token_test(target, t_tok, drafter, d_tok, prompt: str, n: int, temperature: float, k: int,
                     assisted: bool) -> dict:
    import torch
    from scipy.stats import chisquare

    enc = t_tok(prompt, return_tensors="pt")
    with torch.inference_mode():
        p = torch.softmax(target(**enc).logits[0, -1].float() / temperature, -1)  # [vocab]
    kwargs = dict(max_new_tokens=k + 1, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                  pad_token_id=t_tok.eos_token_id if t_tok.pad_token_id is None else t_tok.pad_token_id)
    if assisted:
        drafter.generation_config.num_assistant_tokens = k
        drafter.generation_config.num_assistant_tokens_schedule = "constant"
        drafter.generation_config.assistant_confidence_threshold = 0.0
        kwargs.update(assistant_model=drafter, tokenizer=t_tok, assistant_tokenizer=d_tok)
    counts: collections.Counter[int] = collections.Counter()
    start = enc.input_ids.shape[1]
    for _ in range(n):
        with torch.inference_mode():
            out = target.generate(**enc, **kwargs)
        counts[int(out[0, start])] += 1
    expected = (p.double() / p.double().sum() * n).tolist()  # totals must agree for chisquare
    obs, exp = pool_bins(counts, expected)
    pvalue = float(chisquare(obs, exp).pvalue) if len(obs) >= 2 else float("nan")
    worst = max(range(len(expected)), key=lambda i: abs(counts[i] - expected[i]) / max(expected[i], 1e-9) ** 0.5
                if expected[i] >= 5 else -1.0)
    return {"assisted": assisted, "n": n, "bins": len(obs), "chi2_p": pvalue,
            "worst_token": {"id": worst, "text": t_tok.decode([worst]), "observed": counts[worst],
                            "expected": expected[worst]},
            "top_observed": counts.most_common(3)}


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="tiny", choices=("tiny", "gemma3-smollm2", "smollm2-gemma3"))
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--prompts", type=int, default=3, help="the first N built-in benchmark prompts")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=1e-3)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.run import pair_specs
    from vllm_usd.bench import load_prompts

    pair = pair_specs([args.pair])[0]
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    t_tok = AutoTokenizer.from_pretrained(pair.target)
    prompts = [p["text"] for p in load_prompts()[0][: args.prompts]]
    results = []
    for i, prompt in enumerate(prompts):
        for assisted in (False, True):
            # fresh drafter and tokenizers: sampled assisted generation prunes the drafter's LM head in place
            drafter = AutoModelForCausalLM.from_pretrained(pair.drafter, dtype=torch.float32).eval()
            d_tok = AutoTokenizer.from_pretrained(pair.drafter)
            t_tok = AutoTokenizer.from_pretrained(pair.target)
            row = first_token_test(target, t_tok, drafter, d_tok, prompt, args.n, args.temperature, args.k, assisted)
            row.update(prompt=i, passes=row["chi2_p"] >= args.alpha)
            results.append(row)
            print(f"prompt {i} {'assisted' if assisted else 'target alone'}: chi-square p = {row['chi2_p']:.2e} "
                  f"({row['bins']} bins, N = {args.n}); worst token {row['worst_token']}", flush=True)
    summary = {"pair": args.pair, "temperature": args.temperature, "k": args.k, "alpha": args.alpha,
               "transformers": transformers.__version__, "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    control_ok = all(r["passes"] for r in results if not r["assisted"])
    assisted_ok = all(r["passes"] for r in results if r["assisted"])
    print(f"target alone: {'passes' if control_ok else 'FAILS'}; assisted: {'passes' if assisted_ok else 'FAILS'} "
          f"(alpha {args.alpha} per prompt)")
    return 2 if not control_ok else (1 if not assisted_ok else 0)  # 2: the check itself is not to be trusted


if __name__ == "__main__":
    sys.exit(main())
