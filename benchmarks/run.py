"""Speculative methods side by side: vllm-usd, vLLM's native heterogeneous drafter, transformers.

    .venv/bin/python benchmarks/run.py                       # the full plan (real pair both ways + tiny)
    .venv/bin/python benchmarks/run.py --smoke               # the smallest plan (tiny pair, a minute or two)
    .venv/bin/python benchmarks/run.py --pairs gemma3-smollm2 --ks 2 --batch-sizes 1 8

Writes benchmarks/results/<date>-<host>.json, and .md (table) and .png (plot)
next to it; `benchmarks/report.py FILE.json` regenerates those two from the JSON.
See vllm_usd/bench/ for what each system and column means; benchmarks/targets.py judges the results.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.fixtures (the tiny pair), benchmarks.targets

PAIRS = ("gemma3-smollm2", "smollm2-gemma3", "tiny")


def pair_specs(names: list[str]):
    from vllm_usd.bench import PairSpec

    specs = []
    if any(n != "tiny" for n in names):
        from vllm_usd.demo_pair import ensure_real_pair

        real = ensure_real_pair()
    for name in names:
        if name == "gemma3-smollm2":
            specs.append(PairSpec(name, target=real["gemma3"], drafter=real["smollm2"]))
        elif name == "smollm2-gemma3":
            specs.append(PairSpec(name, target=real["smollm2"], drafter=real["gemma3"]))
        elif name == "tiny":
            from tests.fixtures import tiny

            target, drafter = tiny.build_distribution_pair()
            specs.append(PairSpec(name, target=target, drafter=drafter))
        else:
            raise SystemExit(f"unknown pair {name!r}; choose from {', '.join(PAIRS)}")
    return specs


def main(argv: list[str] | None = None) -> int:
    from benchmarks.targets import judge
    from vllm_usd.bench import ALL_SYSTEMS, BenchPlan, load_prompts, markdown_table, run_plan, write_outputs

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), help="target-drafter pairs: " + ", ".join(PAIRS))
    parser.add_argument("--systems", nargs="+", default=list(ALL_SYSTEMS))
    parser.add_argument("--ks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.8])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--min-prompts", type=int, default=8)
    parser.add_argument("--hf-prompts", type=int, default=4)
    parser.add_argument("--prompts", help="prompts file (default: the built-in 64)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny pair; plain, usd_greedy and transformers; k=2, batch 1 and 4, one repeat")
    parser.add_argument("--fix-cpu-sampler", action="store_true",
                        help="install vllm-usd's fix of vLLM's CPU rejection-sampler bug in every engine, "
                             "vLLM's native drafter included (vllm-usd installs it for itself anyway)")
    parser.add_argument("--usd", type=json.loads, default={}, metavar="JSON",
                        help='extra usd settings for every vllm-usd system, e.g. \'{"drafter_runtime": "transformers"}\'')
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.smoke:
        args.pairs, args.ks, args.batch_sizes, args.repeats = ["tiny"], [2], [1, 4], 1
        args.systems = ["plain", "usd_greedy", "hf_plain", "hf_assisted"]
        args.max_tokens, args.min_prompts, args.hf_prompts = 16, 4, 2
    prompts, meta = load_prompts(args.prompts)
    plan = BenchPlan(pairs=pair_specs(args.pairs), systems=tuple(args.systems), ks=tuple(args.ks),
                     temperatures=tuple(args.temperatures), batch_sizes=tuple(args.batch_sizes),
                     repeats=args.repeats, max_tokens=args.max_tokens, min_prompts=args.min_prompts,
                     hf_prompts=args.hf_prompts, prompts=prompts,
                     fix_cpu_sampler=args.fix_cpu_sampler, usd_settings=args.usd)
    out = args.out or Path(__file__).parent / "results" / f"{dt.date.today().isoformat()}-{socket.gethostname()}.json"

    def checkpoint(partial: dict) -> None:  # a killed run keeps what it measured
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".partial.json").write_text(json.dumps({**partial, "prompts": meta}, indent=1, default=str))

    result = run_plan(plan, command=" ".join([Path(sys.executable).name, *sys.argv]), checkpoint=checkpoint)
    result["prompts"] = meta
    out.with_suffix(".partial.json").unlink(missing_ok=True)
    paths = write_outputs(result, out, judge=judge)
    print(markdown_table(result))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
