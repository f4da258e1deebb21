"""The project's targets for its benchmark results, each judged from the JSON.

``judge(result)`` stores the verdicts in ``result["targets"]`` and returns them as
Markdown; ``benchmarks/run.py`` and ``benchmarks/report.py`` pass it to ``write_outputs``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from vllm_usd.bench.report import cell


def _ok(rows: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("status") == "ok" and all(r.get(k) == v for k, v in match.items())]


def check_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's four targets, each as measured: ``met`` is True, False, or None (not measurable)."""
    rows = result["rows"]
    out: list[dict[str, Any]] = []
    pairs = list(dict.fromkeys(r["pair"] for r in rows))
    for pair in pairs:
        # 1. acceptance >= 1.15x vLLM native's at T=0, same k and batch
        for usd in _ok(rows, pair=pair, system="usd_greedy", temperature=0.0):
            native = [r for r in rows if r["pair"] == pair and r["system"] == "native" and r["k"] == usd["k"]
                      and r["temperature"] == 0.0 and r["batch"] == usd["batch"]]
            what = f"{pair} k={usd['k']} batch={usd['batch']}: usd_greedy vs native acceptance at T=0, target >= 1.15x"
            if not native:
                continue
            if not usd.get("acceptance_length"):
                continue
            if native[0]["status"] != "ok" or not native[0].get("acceptance_length"):
                detail = f"native did not run: {native[0].get('error', 'no drafts')}"
                if not any(c["target"] == "vs_native" and c["what"].startswith(f"{pair}:") and c["detail"] == detail
                           for c in out):  # one line per pair, not per setting
                    out.append({"target": "vs_native", "met": None, "detail": detail,
                                "what": f"{pair}: usd_greedy vs native acceptance at T=0, target >= 1.15x"})
                continue
            ratio = usd["acceptance_length"] / native[0]["acceptance_length"]
            out.append({"target": "vs_native", "what": what, "met": ratio >= 1.15, "value": ratio,
                        "detail": f"{usd['acceptance_length']:.2f} vs {native[0]['acceptance_length']:.2f} "
                                  f"= {ratio:.2f}x"})
        # 2. acceptance >= transformers' universal assisted generation, batch 1, same prompts
        for hf in _ok(rows, pair=pair, system="hf_assisted", temperature=0.0):
            usd = _ok(rows, pair=pair, system="usd_greedy", temperature=0.0, k=hf["k"], batch=1)
            if not usd or not hf.get("acceptance_length") or not usd[0].get("acceptance_length"):
                continue
            a, b = usd[0]["acceptance_length"], hf["acceptance_length"]
            out.append({"target": "vs_transformers", "met": a >= b, "value": a / b,
                        "what": f"{pair} k={hf['k']} batch=1: usd_greedy vs transformers assisted acceptance at T=0",
                        "detail": f"{a:.2f} vs {b:.2f} = {a / b:.2f}x"})
        # 2b. string-level drafting: acceptance >= transformers' and above TLI greedy, batch 1, T=0.
        # Measured as tokens per target step of each request, drafted or not, as transformers' is:
        # a string row may propose nothing in a step, which vLLM's counters leave out.
        for string in _ok(rows, pair=pair, system="usd_string", temperature=0.0, batch=1):
            a = string.get("tokens_per_step")
            hf = _ok(rows, pair=pair, system="hf_assisted", temperature=0.0, k=string["k"])
            tli = _ok(rows, pair=pair, system="usd_greedy", temperature=0.0, k=string["k"], batch=1)
            if a and hf and hf[0].get("acceptance_length"):
                b = hf[0]["acceptance_length"]
                out.append({"target": "string_vs_transformers", "met": a >= b, "value": a / b,
                            "what": f"{pair} k={string['k']} batch=1: usd_string vs transformers assisted "
                                    "tokens per target step at T=0", "detail": f"{a:.2f} vs {b:.2f} = {a / b:.2f}x"})
            if a and tli and tli[0].get("tokens_per_step"):
                b = tli[0]["tokens_per_step"]
                out.append({"target": "string_vs_tli", "met": a > b, "value": a / b,
                            "what": f"{pair} k={string['k']} batch=1: usd_string vs usd_greedy (TLI) tokens per "
                                    "target step at T=0", "detail": f"{a:.2f} vs {b:.2f} = {a / b:.2f}x"})
        # 2c. at T>0 the default rule (TLI with q for sampled requests) is no worse than string drafts
        for string in _ok(rows, pair=pair, system="usd_string"):
            if string["temperature"] == 0.0:
                continue
            tli = _ok(rows, pair=pair, system="usd_sampled", temperature=string["temperature"], k=string["k"],
                      batch=string["batch"])
            if tli and tli[0].get("tok_s") and string.get("tok_s"):
                a, b = tli[0]["tok_s"], string["tok_s"]
                out.append({"target": "auto_rule_sampled", "met": a >= b, "value": a / b,
                            "what": f"{pair} k={string['k']} T={string['temperature']} batch={string['batch']}: "
                                    "TLI with q (auto's choice) vs string drafts, tokens/s",
                            "detail": f"{a:.1f} vs {b:.1f} tok/s; acceptance {tli[0].get('acceptance_length') or 0:.2f}"
                                      f" vs {string.get('acceptance_length') or 0:.2f}"})
        # 3. at T>0 sampled drafting (with q) beats greedy drafting in acceptance
        for sampled in _ok(rows, pair=pair, system="usd_sampled"):
            greedy = _ok(rows, pair=pair, system="usd_greedy", temperature=sampled["temperature"],
                         k=sampled["k"], batch=sampled["batch"])
            if not greedy or not sampled.get("acceptance_length") or not greedy[0].get("acceptance_length"):
                continue
            a, b = sampled["acceptance_length"], greedy[0]["acceptance_length"]
            out.append({"target": "sampled_beats_greedy", "met": a > b, "value": a / b,
                        "what": f"{pair} k={sampled['k']} T={sampled['temperature']} batch={sampled['batch']}: "
                                "usd_sampled vs usd_greedy acceptance",
                        "detail": f"{a:.2f} vs {b:.2f}"})
        # 4. proposer overhead <= 10% of step time at the largest batch
        batches = [r["batch"] for r in rows if r["pair"] == pair]
        top = max(batches) if batches else None
        for r in _ok(rows, pair=pair, batch=top):
            split = r.get("step_split")
            if not r["system"].startswith("usd") or not split:
                continue
            out.append({"target": "overhead", "met": split["proposer_overhead"] <= 0.10,
                        "value": split["proposer_overhead"],
                        "what": f"{pair} {r['system']} k={r['k']} T={r['temperature']} batch={top}: "
                                "proposer overhead share of step time, target <= 10%",
                        "detail": f"{split['proposer_overhead']:.1%}"})
    return out


def targets_markdown(checks: list[dict[str, Any]]) -> str:
    if not checks:
        return ""
    mark = {True: "met", False: "**missed**", None: "not measurable"}
    lines = ["| check | measured | verdict |", "|---|---|---|"]
    lines += [f"| {cell(c['what'], 200)} | {cell(c['detail'], 200)} | {mark[c['met']]} |" for c in checks]
    return "\n".join(lines) + "\n"


def judge(result: dict[str, Any]) -> str:
    result["targets"] = check_targets(result)
    return targets_markdown(result["targets"])


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="Print the project's target verdicts for a benchmarks/run.py JSON.")
    parser.add_argument("json", type=Path)
    args = parser.parse_args(argv)
    print(judge(json.loads(args.json.read_text())) or "no target applies to these rows")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())
