"""A busy batch on the real pair (Gemma-3 <- SmolLM2): the target alone against vllm-usd's defaults.

Each setting: 16 prompts in 2 groups of 8 concurrent requests, 32 tokens each (EOS masked),
2 timed runs after a warm-up, in multi-process engines as users run them; T = 0 and 0.8.

    .venv/bin/python benchmarks/busy_batch_check.py --out benchmarks/results/<name>.json
    .venv/bin/python benchmarks/busy_batch_check.py --systems plain adaptive adaptive_tli --out ...

Systems: ``plain``; ``adaptive`` (vllm-usd's defaults: adaptive lengths, draft_mode auto, k=2);
``adaptive_tli`` (the same with draft_mode tli); ``adaptive_no_probes`` (probe_interval 2^30).
"""

from __future__ import annotations

import argparse
import json
import sys

SYSTEMS = {
    "plain": None,
    "adaptive": {},
    "adaptive_tli": {"draft_mode": "tli"},
    "adaptive_no_probes": {"probe_interval": 1 << 30},
}


def main() -> None:
    from vllm_usd.bench import load_prompts
    from vllm_usd.bench.vllm_systems import engine, run_setting
    from vllm_usd.config import speculative_args
    from vllm_usd.demo_pair import ensure_real_pair

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", nargs="+", default=["plain", "adaptive"], choices=list(SYSTEMS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--logprobs", action="store_true", help="also time each setting with logprobs=0")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    pair = ensure_real_pair()
    prompts = [p["text"] for p in load_prompts()[0]][:2 * args.batch]
    rows = []
    for name in args.systems:
        usd = SYSTEMS[name]
        extra = {} if usd is None else speculative_args(drafter=pair["smollm2"], k=2, profile=True, **usd)
        with engine(pair["gemma3"], args.batch, extra) as llm:
            for temperature in (0.0, 0.8):
                for logprobs in ((False, True) if args.logprobs else (False,)):
                    row = run_setting(llm, prompts, args.batch, temperature, 32, 2, usd is not None, logprobs)
                    rows.append({"system": name, "T": temperature, "logprobs": logprobs, "tok_s": row["tok_s"],
                                 "runs": row["tok_s_runs"], "acceptance": row["acceptance_length"],
                                 "tokens_per_step": row.get("tokens_per_step"), "split": row.get("step_split")})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    base = {(r["T"], r["logprobs"]): r["tok_s"] for r in rows if r["system"] == "plain"}
    for r in rows:
        b = base.get((r["T"], r["logprobs"]))
        r["ratio_vs_plain"] = r["tok_s"] / b if b else None
    command = "python benchmarks/busy_batch_check.py " + " ".join(sys.argv[1:])
    with open(args.out, "w") as f:
        json.dump({"command": command, "rows": rows}, f, indent=1)
    for r in rows:
        ratio = f"{r['ratio_vs_plain']:.2f}x" if r["ratio_vs_plain"] else "-"
        print(f"{r['system']:20s} T={r['T']} logprobs={r['logprobs']}: {r['tok_s']:.1f} tok/s {ratio}")


if __name__ == "__main__":
    main()
