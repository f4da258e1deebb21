"""The target alone and vllm-usd's defaults side by side, interleaved, on one pair.

Both engines are up at once. Every round times each (temperature, batch) setting one group of
prompts at a time (batch 1: one prompt), each group on every engine in turn (the order rotates
by group and round), so paired timings are seconds apart and see the machine in the same state:
on these VMs a lone engine's speed drifts by 10-25% within a minute, which a plan that times one
engine after the other reads as a speed-up or a slow-down. A setting's tok/s on an engine is its
tokens over its seconds, summed over the groups (each group's seconds are kept in the result).
The ratio of a setting is the median over rounds of the paired ratios. ``--control`` adds a
second engine of the target alone, timed the same way: its ratio to the first is the noise
band of every other ratio in the run (an A/A test).

    .venv/bin/python benchmarks/interleaved_check.py --pair gemma3-smollm2 --rounds 5 \\
        --out benchmarks/results/<date>-vm-interleaved.json

Each run: ``--groups`` batches of ``batch`` prompts at once (batch 1: four prompts one after
another), ``--max-tokens`` tokens each with EOS masked (one run per length given); engines
in-process as ``benchmarks/run.py`` runs them. The prompts are per kind (``--workloads``): code
and prose nobody here wrote (the standard library's functions cut before the body, paragraphs of
``pydoc_data``; ``vllm_usd/bench/public_prompts.py``) and our own chat prompts; the result names
each prompt's file and offset, and the host's CPU model and flags. The table has a row per kind,
length, temperature and batch size (SpecBench-style categories).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _lengths(llm, proposer_stats) -> dict[str, int]:
    """The proposer's row-steps counted at each draft length so far (``length_0`` ... ``length_k``)."""
    counters = (llm.collective_rpc(proposer_stats)[0] or {}).get("counters") or {}
    return {key: value for key, value in counters.items() if key.startswith("length_")}


def _generate(llm, group: list[str], temperature: float, max_tokens: int) -> tuple[int, float]:
    """(tokens, seconds) of one ``generate`` call over ``group``, all at once."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    tokens = sum(len(o.outputs[0].token_ids) for o in llm.generate(group, params, use_tqdm=False))
    return tokens, time.perf_counter() - start


def _rotated(names: list[str], by: int) -> list[str]:
    return names[by % len(names):] + names[:by % len(names)]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.run import pair_specs
    from vllm_usd.bench.machine import cpu_flags, cpu_model
    from vllm_usd.bench.public_prompts import load_workloads, sources
    from vllm_usd.bench.vllm_systems import engine
    from vllm_usd.vllm_adapter.debug import proposer_stats
    from vllm_usd.config import speculative_args

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="gemma3-smollm2")
    parser.add_argument("-k", type=int, default=3, help="num_speculative_tokens (the policy's cap)")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--groups", type=int, default=2, help="batches of prompts per timed run (batch > 1)")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--workloads", nargs="+", default=["code", "prose", "chat"],
                        help="kinds of prompt: code, prose (public, shipped with Python), chat (ours)")
    parser.add_argument("--usd", default="{}", help="extra usd settings, JSON (default: vllm-usd's defaults)")
    parser.add_argument("--with-fixed", action="store_true",
                        help="a third engine: the same settings with adaptive_length false (always k drafts)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="another vllm-usd engine, with these usd settings over --usd's (repeatable)")
    parser.add_argument("--control", action="store_true",
                        help="another engine of the target alone: its paired ratios show the run's noise")
    parser.add_argument("--control-engine", default="{}", metavar="JSON",
                        help="vLLM engine arguments for the control engine only, e.g. '{\"async_scheduling\": false}' "
                             "(the target alone as vLLM runs it with a custom_class proposer)")
    parser.add_argument("--warmup-rounds", type=int, default=0,
                        help="untimed rounds of every setting first (the engine's cost calibration runs in them)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    spec = pair_specs([args.pair])[0]
    workloads = load_workloads(args.workloads, n=max(4, max(args.batch_sizes) * args.groups))
    prompts = {kind: [p["text"] for p in items] for kind, items in workloads.items()}
    settings = [(w, n, t, b) for w in args.workloads for n in args.max_tokens for t in args.temperatures
                for b in args.batch_sizes]
    usd = json.loads(args.usd)
    drafter = usd.pop("drafter", spec.drafter)  # --usd may name another drafter than the pair's
    systems = {"plain": {}, "usd": speculative_args(drafter=drafter, k=args.k, profile=True, **usd)}
    if args.with_fixed:
        systems["fixed"] = speculative_args(drafter=drafter, k=args.k, profile=True,
                                            **{**usd, "adaptive_length": False})
    for variant in args.variant:
        name, _, settings_json = variant.partition("=")
        settings_of = {**usd, **json.loads(settings_json)}  # "drafter" here replaces the pair's
        systems[name] = speculative_args(drafter=settings_of.pop("drafter", drafter), k=args.k, profile=True,
                                         **settings_of)
    if args.control:
        systems["control"] = json.loads(args.control_engine)
    max_batch = max(args.batch_sizes)
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    with contextlib.ExitStack() as stack:
        engines = {name: stack.enter_context(engine(spec.target, max_batch, extra))
                   for name, extra in systems.items()}
        def groups(kind: str, batch: int) -> list[list[str]]:
            chosen = prompts[kind][:4] if batch == 1 else prompts[kind][:batch * args.groups]
            return [chosen[i:i + batch] for i in range(0, len(chosen), batch)]

        for name, llm in engines.items():  # warm-up
            _generate(llm, prompts[args.workloads[0]][:2], 0.0, 8)
            for _ in range(args.warmup_rounds):
                for kind, max_tokens, temperature, batch in settings:
                    for g in groups(kind, batch):
                        _generate(llm, g, temperature, max_tokens)
        drafting = [name for name in systems if name not in ("plain", "control")]
        for r in range(args.rounds):
            for kind, max_tokens, temperature, batch in settings:
                before = {name: _lengths(engines[name], proposer_stats) for name in drafting}
                tokens, seconds = dict.fromkeys(systems, 0), {name: [] for name in systems}
                for i, g in enumerate(groups(kind, batch)):
                    for name in _rotated(list(systems), r + i):
                        n, s = _generate(engines[name], g, temperature, max_tokens)
                        tokens[name] += n
                        seconds[name].append(s)
                for name in systems:
                    runs[name].append({"round": r, "workload": kind, "max_tokens": max_tokens,
                                       "temperature": temperature, "batch": batch,
                                       "tok_s": tokens[name] / sum(seconds[name]), "group_seconds": seconds[name]})
                    if name in drafting:  # row-steps at each draft length in this cell: what the controller did
                        after = _lengths(engines[name], proposer_stats)
                        runs[name][-1]["row_steps_by_length"] = {n: after[n] - before[name].get(n, 0) for n in after
                                                                 if after[n] - before[name].get(n, 0)}
                    print(json.dumps({"system": name, **runs[name][-1]}), file=sys.stderr, flush=True)
        proposers = {name: {key: (engines[name].collective_rpc(proposer_stats)[0] or {}).get(key)
                            for key in ("counters", "timings", "controller", "controller_summary")}
                     for name in drafting}
    rows = []
    for kind, max_tokens, temperature, batch in settings:
        def of(name, key="tok_s"):
            return [x[key] for x in runs[name] if (x["workload"], x["max_tokens"], x["temperature"], x["batch"])
                    == (kind, max_tokens, temperature, batch)]

        row = {"workload": kind, "max_tokens": max_tokens, "temperature": temperature, "batch": batch,
               "plain_tok_s": of("plain"), "plain_group_seconds": of("plain", "group_seconds")}
        for name in systems:
            if name != "plain":
                ratios = [u / p for u, p in zip(of(name), of("plain"))]
                row.update({f"{name}_tok_s": of(name), f"{name}_group_seconds": of(name, "group_seconds"),
                            f"{name}_paired_ratios": ratios, f"{name}_ratio": statistics.median(ratios)})
        if "fixed" in systems:  # adaptive against always-k, paired the same way
            row["usd_vs_fixed"] = statistics.median([u / f for u, f in zip(of("usd"), of("fixed"))])
        rows.append(row)
    result = {"command": "python benchmarks/interleaved_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "pair": args.pair, "k": args.k, "usd": json.loads(args.usd), "rounds": args.rounds,
              "max_tokens": args.max_tokens, "rows": rows, "proposers": proposers, "warmup_rounds": args.warmup_rounds,
              "host": {"cpu": cpu_model(), "flags": cpu_flags(), "cpus": len(os.sched_getaffinity(0))},
              "workloads": sources(workloads),
              # what the command line does not show but changes every engine's speed
              "environment": {k: v for k, v in sorted(os.environ.items())
                              if k.startswith(("VLLM_CPU_", "OMP_")) or k == "LD_PRELOAD"}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    others = [name for name in systems if name != "plain"]
    print("| prompts | tokens | T | batch | target alone tok/s | "
          + " | ".join(f"{n} tok/s | {n} paired ratios | {n} median" for n in others)
          + (" | adaptive / fixed |" if "fixed" in systems else " |"))
    print("|---" * (5 + 3 * len(others) + ("fixed" in systems)) + "|")
    for row in rows:
        cells = [row["workload"], str(row["max_tokens"]), str(row["temperature"]), str(row["batch"]),
                 f"{statistics.median(row['plain_tok_s']):.1f}"]
        for n in others:
            cells += [f"{statistics.median(row[f'{n}_tok_s']):.1f}",
                      " ".join(f"{x:.2f}" for x in row[f"{n}_paired_ratios"]), f"**{row[f'{n}_ratio']:.2f}x**"]
        if "fixed" in systems:
            cells.append(f"{row['usd_vs_fixed']:.2f}")
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
