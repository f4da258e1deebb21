"""``vllm-usd``: analyze a target/drafter pair, or serve it with vLLM's OpenAI server.

    vllm-usd analyze TARGET DRAFTER [--text FILE] [--json]
    vllm-usd serve TARGET --drafter DRAFTER [-k K] [--usd KEY=VALUE ...] [vLLM server flags ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any, Sequence

from vllm_usd.config import PROPOSER_CLASS, parse_usd_config, speculative_args

SAMPLE_TEXT = """\
The quick brown fox jumps over the lazy dog. Speculative decoding lets a small model
propose tokens that a large model checks in one step.
def mean(xs):
\treturn sum(xs) / len(xs)  # average
Les élèves étudient à l'école. Die Straße ist naß. 東京は日本の首都です。 😀
{"key": [1, 2, 3], "ok": true}
"""


# -- analyze ------------------------------------------------------------------------------
def analyze_pair(target: str, drafter: str, text: str, trust_remote_code: bool = False) -> dict[str, Any]:
    """Vocabulary statistics for a pair; the numbers ``vllm-usd analyze`` prints."""
    from transformers import AutoConfig, AutoTokenizer

    from vllm_usd.vocab import VocabMapping

    t_tok = AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
    d_tok = AutoTokenizer.from_pretrained(drafter, trust_remote_code=trust_remote_code)
    configs = {}
    for name, path in (("target", target), ("drafter", drafter)):
        try:
            configs[name] = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            configs[name] = None
    t_size = getattr(configs["target"], "vocab_size", None)
    d_size = getattr(configs["drafter"], "vocab_size", None)
    m = VocabMapping.build(t_tok, d_tok, target_vocab_size=t_size, draft_vocab_size=d_size, min_share=0.0)
    ids = t_tok(text, add_special_tokens=False).input_ids
    shared = sum(1 for i in ids if m.target_to_draft[i] >= 0)

    def params(cfg) -> int | None:
        if cfg is None:
            return None
        try:
            from accelerate import init_empty_weights  # type: ignore[import-not-found]
        except ImportError:
            return _estimate_params(cfg)
        from transformers import AutoModelForCausalLM

        with init_empty_weights():
            return sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())

    t_params, d_params = params(configs["target"]), params(configs["drafter"])
    return {
        "target": {"path": target, "vocab_size": m.target_vocab_size, "tokenizer_size": len(t_tok), "params": t_params},
        "drafter": {"path": drafter, "vocab_size": m.draft_vocab_size, "tokenizer_size": len(d_tok), "params": d_params},
        "intersection": m.size,
        "intersection_share_of_target": m.size / m.target_vocab_size,
        "intersection_share_of_drafter": m.size / m.draft_vocab_size,
        "byte_only_matches": m.byte_only_matches,
        "text_tokens": len(ids),
        "text_tokens_shared": shared,
        "text_share_shared": shared / len(ids) if ids else None,
        "text_share_retokenized": (len(ids) - shared) / len(ids) if ids else None,
        "param_ratio": d_params / t_params if d_params and t_params else None,
    }


def _estimate_params(cfg) -> int | None:
    """Rough decoder-only parameter count from the config (no weights loaded)."""
    try:
        h, n, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
        inter = getattr(cfg, "intermediate_size", 4 * h)
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or h // heads
        kv = (getattr(cfg, "num_key_value_heads", None) or heads) * head_dim
        per_layer = h * heads * head_dim * 2 + 2 * h * kv + 3 * h * inter
        tied = getattr(cfg, "tie_word_embeddings", True)
        return n * per_layer + v * h * (1 if tied else 2)
    except AttributeError:
        return None


def _print_analysis(report: dict[str, Any]) -> None:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    rows = [
        ("target vocab (logits / tokenizer)", f"{report['target']['vocab_size']} / {report['target']['tokenizer_size']}"),
        ("drafter vocab (logits / tokenizer)", f"{report['drafter']['vocab_size']} / {report['drafter']['tokenizer_size']}"),
        ("shared tokens", str(report["intersection"])),
        ("  % of target vocab", pct(report["intersection_share_of_target"])),
        ("  % of drafter vocab", pct(report["intersection_share_of_drafter"])),
        ("  matched by bytes only (Ċ ~ <0x0A> ...)", str(report["byte_only_matches"])),
        ("sample text: target tokens", str(report["text_tokens"])),
        ("  in the intersection", pct(report["text_share_shared"])),
        ("  re-tokenized for the drafter", pct(report["text_share_retokenized"])),
        ("drafter / target parameters", "n/a" if report["param_ratio"] is None else f"{report['param_ratio']:.3f}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"target : {report['target']['path']}\ndrafter: {report['drafter']['path']}")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    acc = report.get("acceptance")
    if acc:
        print(f"\nestimated acceptance length (teacher-forced on {acc['positions']} positions; "
              f"greedy match {pct(acc['greedy_match_rate'])}, mean sum min(p,q) {acc['mean_alpha']:.2f})")
        print("   k  greedy  sampled(T=1)")
        for k, g in acc["greedy_acceptance_length"].items():
            print(f"  {k:>2}  {g:6.2f}  {acc['sampled_acceptance_length'][k]:6.2f}")
        print(f"recommended k at drafter/target cost ratio {acc['cost_ratio_used']:.3f}: "
              f"{acc['recommended_k_greedy']} (greedy), {acc['recommended_k_sampled']} (sampled)")


def estimate_for_text(target: str, drafter: str, text: str, cost_ratio: float | None,
                      trust_remote_code: bool = False) -> dict[str, Any]:
    """Teacher-forced acceptance estimate on ``text`` (see vllm_usd.acceptance)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_usd.acceptance import estimate_acceptance
    from vllm_usd.drafter.hf_runtime import load_drafter

    t_tok = AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
    t_model = AutoModelForCausalLM.from_pretrained(target, trust_remote_code=trust_remote_code).eval()
    d_model, d_tok = load_drafter(drafter, trust_remote_code=trust_remote_code)
    ids = t_tok(text).input_ids
    chunks = [ids[i:i + 256] for i in range(0, len(ids), 256)]
    est = estimate_acceptance(t_model, t_tok, d_model, d_tok, chunks)
    ratio = cost_ratio if cost_ratio else 0.1
    return {
        "positions": est.positions, "greedy_match_rate": est.greedy_match_rate, "mean_alpha": est.mean_alpha,
        "greedy_acceptance_length": est.greedy_length, "sampled_acceptance_length": est.sampled_length,
        "cost_ratio_used": ratio, "recommended_k_greedy": est.recommend_k(ratio, greedy=True),
        "recommended_k_sampled": est.recommend_k(ratio, greedy=False),
    }


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

    from vllm_usd.bench import ALL_SYSTEMS, BenchPlan, PairSpec, load_prompts, markdown_table, run_plan, write_outputs

    bad = [s for s in args.systems if s not in ALL_SYSTEMS]
    if bad:
        print(f"vllm-usd bench: unknown system(s) {', '.join(bad)}; choose from {', '.join(ALL_SYSTEMS)}",
              file=sys.stderr)
        return 2
    prompts, meta = load_prompts(args.prompts)
    plan = BenchPlan(pairs=[PairSpec("pair", args.target, args.drafter)], systems=tuple(args.systems),
                     ks=tuple(args.ks), temperatures=tuple(args.temperatures), batch_sizes=tuple(args.batch_sizes),
                     repeats=args.repeats, max_tokens=args.max_tokens, prompts=prompts)
    temps, batches, ks = len(args.temperatures), len(args.batch_sizes), len(args.ks)
    sampled_temps = len([t for t in args.temperatures if t > 0])
    per_system = {"plain": temps * batches, "native": ks * temps * batches, "usd_greedy": ks * temps * batches,
                  "usd_sampled": ks * sampled_temps * batches, "hf_plain": temps, "hf_assisted": ks * temps}
    bar = _progress(total=sum(per_system[s] for s in set(args.systems)))
    try:
        result = run_plan(plan, command=shlex.join(["vllm-usd", "bench", *(argv_used or [])]), progress=bar)
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


class _progress:
    """A tqdm bar over the benchmark's settings; other messages go above it."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, unit="setting", file=sys.stderr, dynamic_ncols=True)

    def __call__(self, message: str) -> None:
        self._bar.set_description_str(message[-60:])
        if " batch=" in message:
            self._bar.update(1)
        else:
            self._bar.write(f"bench: {message}")

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
    p_bn.add_argument("--systems", nargs="+", default=["plain", "usd_greedy", "usd_sampled"],
                      help="any of plain, native, usd_greedy, usd_sampled, hf_plain, hf_assisted")
    p_bn.add_argument("--repeats", type=int, default=3)
    p_bn.add_argument("--max-tokens", type=int, default=64)
    p_bn.add_argument("--out", help="write JSON (and .md, .png) here")

    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return _bench(args, list(argv if argv is not None else sys.argv[1:])[1:])
    if args.command == "analyze":
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
            _print_analysis(report)
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
