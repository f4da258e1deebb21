"""Acceptance and tokens/s on the real pair, with and without vllm-usd, side by side.

    .venv/bin/python benchmarks/real_pair.py                 # Gemma-3-270m target, SmolLM2-135M drafter, k=3
    .venv/bin/python benchmarks/real_pair.py --reverse       # SmolLM2 target, Gemma-3 drafter

One engine without speculation and one with vllm-usd, same settings, same
prompts, same process; each setting is run after a warm-up, `--repeats` times,
and the median is reported. Greedy rows also check that the outputs are equal.
Writes benchmarks/results/<date>-<host>-real-pair.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

PROMPTS = [
    "The capital of France is", "Here is a short story about a lighthouse keeper:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "The three primary colors are",
    "To make a cup of tea, first", "Photosynthesis is the process by which",
    "Translate to French: Good morning, how are you?\nFrench:", "The main differences between Python lists and tuples are",
    "Write a SQL query that counts users per country:\n", "The water cycle consists of",
    "A recipe for pancakes:\n1.", "The history of the Roman Empire began", "import json\n\ndef load(path):\n",
    "Dear team,\n\nThis week we", "The best way to learn a new language is", "Summary of the article:",
]


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _counters(llm) -> dict[str, float]:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = list(m.values) if hasattr(m, "values") else m.value
    return out


def _proposer_timings(llm) -> dict[str, float]:
    """Seconds spent in each proposer phase, and outside it, in the worker (usd.profile)."""
    from vllm_usd.vllm_adapter.debug import proposer_stats

    (stats,) = llm.collective_rpc(proposer_stats)
    return dict(stats["timings"])


def _measure(llm, params, repeats: int) -> dict:
    llm.generate(PROMPTS[:2], params, use_tqdm=False)  # warm-up
    runs, outputs = [], None
    before = _counters(llm)
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        runs.append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
    after = _counters(llm)
    drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get("vllm:spec_decode_num_drafts", 0)
    accepted = (after.get("vllm:spec_decode_num_accepted_tokens", 0)
                - before.get("vllm:spec_decode_num_accepted_tokens", 0))
    per_pos = [a - b for a, b in zip(after.get("vllm:spec_decode_num_accepted_tokens_per_pos", []),
                                      before.get("vllm:spec_decode_num_accepted_tokens_per_pos", [0] * 16))]
    return {
        "tok_s_runs": runs, "tok_s": statistics.median(runs),
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_acceptance": [p / drafts for p in per_pos] if drafts else None,
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reverse", action="store_true", help="SmolLM2 target, Gemma-3 drafter")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    import vllm
    import vllm_usd
    from vllm_usd.demo_pair import ensure_real_pair
    from vllm_usd.vllm_adapter.compat import shutdown_engine

    pair = ensure_real_pair()
    target, drafter = (pair["smollm2"], pair["gemma3"]) if args.reverse else (pair["gemma3"], pair["smollm2"])
    settings = {"greedy": SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
                "T=0.8": SamplingParams(temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True, seed=0)}
    engine_args = dict(dtype="float32", enforce_eager=True, max_model_len=1024, max_num_seqs=len(PROMPTS),
                       disable_log_stats=False, seed=0)
    results: dict = {}
    profile: dict = {}
    usd_args = vllm_usd.speculative_args(drafter=drafter, k=args.k, profile=True)
    for system, spec in (("target alone", {}), (f"vllm-usd k={args.k}", usd_args)):
        llm = LLM(model=target, **engine_args, **spec)
        results[system] = {}
        for name, params in settings.items():
            before = _proposer_timings(llm) if spec else {}
            results[system][name] = _measure(llm, params, args.repeats)
            if spec:
                after = _proposer_timings(llm)
                profile[name] = {key: after[key] - before.get(key, 0.0) for key in after}
        shutdown_engine(llm)
        del llm

    base, usd = results["target alone"], results[f"vllm-usd k={args.k}"]
    rows = []
    for name in settings:
        rows.append({
            "setting": name, "target_tok_s": base[name]["tok_s"], "usd_tok_s": usd[name]["tok_s"],
            "speed_ratio": usd[name]["tok_s"] / base[name]["tok_s"],
            "acceptance_length": usd[name]["acceptance_length"],
            "per_position_acceptance": usd[name]["per_position_acceptance"],
            "greedy_equal": (base[name]["token_ids"] == usd[name]["token_ids"]) if name == "greedy" else None,
            "usd_time_split_s": profile.get(name),
        })
    record = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "cpu": _cpu_model(), "cores": os.cpu_count(),
        "versions": {"vllm": vllm.__version__, "vllm_usd": vllm_usd.__version__, "python": platform.python_version()},
        "target": target, "drafter": drafter, "k": args.k, "prompts": len(PROMPTS),
        "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{dt.date.today().isoformat()}-{socket.gethostname()}-real-pair{'-reverse' if args.reverse else ''}"
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")

    print(f"\ntarget {Path(target).name}, drafter {Path(drafter).name}, k={args.k}, "
          f"{len(PROMPTS)} prompts x {args.max_tokens} tokens, batched; median of {args.repeats} runs")
    print("| setting | target alone tok/s | vllm-usd tok/s | ratio | acceptance length | greedy equal |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        eq = "" if r["greedy_equal"] is None else ("yes" if r["greedy_equal"] else "NO")
        print(f"| {r['setting']} | {r['target_tok_s']:.1f} | {r['usd_tok_s']:.1f} | {r['speed_ratio']:.2f}x | "
              f"{r['acceptance_length']:.2f} | {eq} |")
    for r in rows:
        split = r["usd_time_split_s"] or {}
        total = split.get("propose_total", 0.0) + split.get("outside_proposer", 0.0)
        if total:
            share = {key: f"{100 * split.get(key, 0.0) / total:.0f}%" for key in
                     ("outside_proposer", "drafter_forward", "translate", "sample", "map_and_q")}
            print(f"{r['setting']}: share of engine-step time: target step and vLLM (outside the proposer) "
                  f"{share['outside_proposer']}, drafter forwards {share['drafter_forward']}, context translation "
                  f"{share['translate']}, draft sampling {share['sample']}, id map + q {share['map_and_q']}")
    print(f"\nwritten to {out / (stem + '.json')}")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(proposer_stats)
    main()
