"""``vllm-usd``: analyze a target/drafter pair, or serve it with vLLM's OpenAI server.

    vllm-usd analyze TARGET DRAFTER [--text FILE] [--json]
    vllm-usd serve TARGET --drafter DRAFTER [-k K] [--usd KEY=VALUE ...] [vLLM server flags ...]
    vllm-usd doctor [--json] [--vllm-source DIR] [--drafter FOLDER [--drafter-gguf FILE] ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any, Sequence

from vllm_usd.config import PROPOSER_CLASS, parse_usd_config, speculative_args


# -- serve ---------------------------------------------------------------------------------
def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def serve_command(target: str, drafter: str, k: int, usd: dict[str, Any], passthrough: Sequence[str],
                  python: str | None = None) -> list[str]:
    """The plain vLLM command line (OpenAI API server) that serves ``target`` with vllm-usd."""
    args = speculative_args(drafter=drafter, k=k, **usd)
    return [
        python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target,
        "--speculative-config", json.dumps(args["speculative_config"]),
        "--additional-config", json.dumps(args["additional_config"]),
        *passthrough,
    ]


def _bench(args: argparse.Namespace, argv_used: Sequence[str] | None = None) -> int:
    from pathlib import Path

    from vllm_usd.bench import (
        ALL_SYSTEMS, BenchPlan, PairSpec, count_settings, load_prompts, markdown_table, run_plan, write_outputs,
    )

    bad = [s for s in args.systems if s not in ALL_SYSTEMS]
    if bad:
        print(f"vllm-usd bench: unknown system(s) {', '.join(bad)}; choose from {', '.join(ALL_SYSTEMS)}",
              file=sys.stderr)
        return 2
    prompts, meta = load_prompts(args.prompts)
    plan = BenchPlan(pairs=[PairSpec("pair", args.target, args.drafter)], systems=tuple(args.systems),
                     ks=tuple(args.ks), temperatures=tuple(args.temperatures), batch_sizes=tuple(args.batch_sizes),
                     repeats=args.repeats, max_tokens=args.max_tokens, prompts=prompts)
    bar = _Progress(total=count_settings(plan))
    try:
        result = run_plan(plan, command=shlex.join(["vllm-usd", "bench", *(argv_used or [])]), on_event=bar)
    finally:
        bar.close()
    result["prompts"] = meta
    print(markdown_table(result))
    if args.out:
        paths = write_outputs(result, Path(args.out), make_plot=_has_matplotlib())
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


class _Progress:
    """A tqdm bar over the benchmark's settings; messages go above it."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, unit="setting", file=sys.stderr, dynamic_ncols=True)

    def __call__(self, event) -> None:  # a vllm_usd.bench.BenchEvent
        if event.kind == "setting":
            self._bar.set_description_str(event.text[-60:])
            self._bar.update(1)
        else:
            self._bar.write(f"bench: {event.text}")

    def close(self) -> None:
        self._bar.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-usd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p_an = sub.add_parser("analyze", help="vocabulary overlap of a target/drafter pair")
    p_an.add_argument("target")
    p_an.add_argument("drafter")
    p_an.add_argument("--text", help="a text file to measure running-text coverage on")
    p_an.add_argument("--json", action="store_true", help="print JSON")
    p_an.add_argument("--trust-remote-code", action="store_true")
    p_an.add_argument("--models", action="store_true",
                      help="also load both models and estimate the acceptance length for k = 1..8")

    p_sv = sub.add_parser("serve", help="start vLLM's OpenAI API server with vllm-usd on",
                          description="Unknown flags are passed to vLLM's server unchanged.")
    p_sv.add_argument("target")
    p_sv.add_argument("--drafter", required=True)
    p_sv.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    p_sv.add_argument("--usd", action="append", default=[], metavar="KEY=VALUE",
                      help=f"a setting under additional_config.usd (repeatable); see {PROPOSER_CLASS}")
    p_sv.add_argument("--dry-run", action="store_true", help="print the vLLM command and exit")

    p_bn = sub.add_parser("bench", help="acceptance and speedup of vllm-usd on your pair and prompts",
                          description="A front for vllm_usd.bench: the target alone, vllm-usd greedy and sampled "
                                      "drafting (and, on request, vLLM's native heterogeneous drafter and "
                                      "transformers' assisted generation), side by side.")
    p_bn.add_argument("target")
    p_bn.add_argument("drafter")
    p_bn.add_argument("--prompts", help="prompts file: JSON list, {\"groups\": {...}}, or one prompt per line "
                                        "(default: the built-in 64)")
    p_bn.add_argument("-k", "--ks", nargs="+", type=int, default=[3])
    p_bn.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.8])
    p_bn.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    p_bn.add_argument("--systems", nargs="+", default=["plain", "usd_greedy", "usd_sampled", "usd_adaptive"],
                      help="any of plain, native, usd_greedy, usd_sampled, usd_adaptive, hf_plain, hf_assisted")
    p_bn.add_argument("--repeats", type=int, default=3)
    p_bn.add_argument("--max-tokens", type=int, default=64)
    p_bn.add_argument("--out", help="write JSON (and .md, .png) here")

    p_dr = sub.add_parser("doctor", help="will vllm-usd work on this vLLM? (version, patches, device, known bugs)")
    p_dr.add_argument("--json", action="store_true", help="print one JSON object")
    p_dr.add_argument("--vllm-source", metavar="DIR",
                      help="check an unpacked vLLM source tree (a folder holding vllm/) without importing it")
    p_dr.add_argument("--drafter", metavar="FOLDER",
                      help="also show how this drafter runs here: runtime, format, the native probe's verdict")
    p_dr.add_argument("--drafter-gguf", metavar="FILE", help="as usd.drafter_gguf")
    p_dr.add_argument("--drafter-gguf-type", default="auto", help="as usd.drafter_gguf_type")
    p_dr.add_argument("--drafter-runtime", default="auto", help="as usd.drafter_runtime")
    p_dr.add_argument("--target", metavar="MODEL",
                      help="with --drafter: start vLLM with both (about a minute) and print the start-up "
                           "measurements: a cycle at batch 1 with and without drafts, where drafting pays")
    p_dr.add_argument("-k", "--num-speculative-tokens", type=int, default=3, help="with --target")
    p_dr.add_argument("--max-num-seqs", type=int, default=32, help="with --target: the largest batch judged")

    args, rest = parser.parse_known_args(argv)
    if args.command == "doctor":
        from vllm_usd.vllm_adapter.doctor import diagnose, format_report

        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.target and not args.drafter:
            parser.error("doctor --target needs --drafter")
        if args.target:  # vLLM's start-up logs (on stdout) at WARNING and above, before vLLM is imported
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        report = diagnose(args.vllm_source)
        text = format_report(report)
        if args.drafter:
            from vllm_usd.vllm_adapter.doctor import drafter_report, format_drafter

            try:
                report["drafter"] = drafter_report(args.drafter, gguf=args.drafter_gguf,
                                                   gguf_type=args.drafter_gguf_type, runtime=args.drafter_runtime)
            except ValueError as exc:  # a bad drafter or GGUF: vllm-usd's own one line
                print(str(exc), file=sys.stderr)
                return 2
            text += "\n" + format_drafter(report["drafter"])
        if args.target:
            from vllm_usd.bench.vllm_systems import EngineStartError
            from vllm_usd.vllm_adapter.doctor import startup_report

            usd = {key: value for key, value in (("drafter_gguf", args.drafter_gguf),
                                                 ("drafter_gguf_type", args.drafter_gguf_type),
                                                 ("drafter_runtime", args.drafter_runtime)) if value not in (None, "auto")}
            try:
                report["startup"] = startup_report(args.target, args.drafter, args.num_speculative_tokens,
                                                   args.max_num_seqs, usd)
            except EngineStartError as exc:  # vLLM's root cause, in one line
                print(f"vllm-usd doctor: vLLM did not start with target {args.target}: {exc}", file=sys.stderr)
                return 2
            text += f"\nwith target {args.target} (float32, eager, up to {args.max_num_seqs} sequences):\n  " + \
                str(report["startup"]["line"])
        print(json.dumps(report, indent=2) if args.json else text)
        return 0 if report["supported"] else 1
    if args.command == "bench":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return _bench(args, list(argv if argv is not None else sys.argv[1:])[1:])
    if args.command == "analyze":
        from vllm_usd.analysis.pair_report import SAMPLE_TEXT, analyze_pair, estimate_for_text, print_analysis

        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        text = open(args.text, encoding="utf-8").read() if args.text else SAMPLE_TEXT
        report = analyze_pair(args.target, args.drafter, text, args.trust_remote_code)
        if args.models:
            report["acceptance"] = estimate_for_text(args.target, args.drafter, text, report["param_ratio"],
                                                     args.trust_remote_code)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print_analysis(report)
        return 0

    usd: dict[str, Any] = {}
    for item in args.usd:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--usd takes KEY=VALUE, got {item!r}")
        usd[key] = _parse_value(value)
    try:
        parse_usd_config({"usd": {"drafter": args.drafter, **usd}})
        cmd = serve_command(args.target, args.drafter, args.num_speculative_tokens, usd, rest)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print("[vllm-usd] equivalent plain vLLM command:\n  " + shlex.join(cmd), flush=True)
    if args.dry_run:
        return 0
    os.execv(cmd[0], cmd)
    return 0  # unreachable


if __name__ == "__main__":
    raise SystemExit(main())
