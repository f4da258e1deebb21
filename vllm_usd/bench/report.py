"""Tables, plot and files from a benchmark result."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable

from vllm_usd.bench.metrics import add_projection
from vllm_usd.bench.plan import ALL_SYSTEMS


def cell(text: str, limit: int = 100) -> str:
    # "EngineStartError: RuntimeError: Worker failed with error 'X', please check ..." -> "X"
    m = re.search(r"failed with error '(.+?)'", text)
    text = m.group(1) if m else text
    return text[:limit].replace("|", "\\|")


def fmt(x: Any, spec: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


def markdown_table(result: dict[str, Any]) -> str:
    lines = ["| pair | system | k | T | batch | accept. length | per-position acceptance | tok/s | vs target alone "
             "| greedy = target | step: target / drafter / overhead | measured c | projected at c=0.05 | peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['pair']} | {r['system']} | {fmt(r['k'], 'd')} | {fmt(r['temperature'], '.1f')} "
                         f"| {r['batch']} | failed: {cell(r['error'], 90)} | | | | | | | | |")
            continue
        split = r.get("step_split")
        split_s = (f"{split['target_and_vllm']:.0%} / {split['drafter_forward']:.0%} / "
                   f"{split['proposer_overhead']:.0%}") if split else "-"
        pos = r.get("per_position_acceptance")
        pos_s = " ".join(f"{p:.2f}" for p in pos) if pos else "-"
        ratio = r.get("ratio_vs_plain")
        if r["system"].startswith("hf") and r.get("ratio_vs_hf_plain") is not None:
            ratio_s = f"{fmt(ratio)}x (HF: {fmt(r.get('ratio_vs_hf_plain'))}x)"
        else:
            ratio_s = f"{fmt(ratio)}x"
        equal = r.get("greedy_equal_plain")
        equal_s = "-" if equal is None else ("yes" if equal else "**no**")
        proj = r.get("projected_speedup")
        lines.append(f"| {r['pair']} | {r['system']} | {fmt(r['k'], 'd')} | {r['temperature']:.1f} | {r['batch']} "
                     f"| {fmt(r.get('acceptance_length'))} | {pos_s} | {fmt(r['tok_s'], '.1f')} | {ratio_s} "
                     f"| {equal_s} | {split_s} | {fmt(r.get('measured_cost_ratio'))} "
                     f"| {fmt(proj) + 'x' if proj else '-'} | {fmt(r.get('peak_memory_mib'), '.0f')} |")
    return "\n".join(lines) + "\n"


def summary_table(result: dict[str, Any]) -> str:
    """One line per (pair, T, system, k): acceptance length and speed ratio at each batch size."""
    rows = [r for r in result["rows"] if r["system"] != "plain"]
    batches = sorted({r["batch"] for r in rows})
    keys = list(dict.fromkeys((r["pair"], r["temperature"], r["system"], r["k"]) for r in rows))
    head = ("| pair | T | system | k | " + " | ".join(f"accept. length b={b}" for b in batches) + " | "
            + " | ".join(f"vs target alone b={b}" for b in batches) + " | projected at c=0.05 |")
    lines = [head, "|" + "---|" * (5 + 2 * len(batches))]
    for pair, temp, system, k in keys:
        match = {r["batch"]: r for r in rows if (r["pair"], r["temperature"], r["system"], r["k"]) == (pair, temp, system, k)}
        if all(r["status"] != "ok" for r in match.values()):
            error = next(iter(match.values()))["error"]
            lines.append(f"| {pair} | {fmt(temp, '.1f')} | {system} | {fmt(k, 'd')} | "
                         f"failed: {cell(error)} |" + " |" * (2 * len(batches)))
            continue
        acc = [fmt(match[b].get("acceptance_length")) if b in match and match[b]["status"] == "ok" else ""
               for b in batches]
        speed = [(fmt(match[b].get("ratio_vs_plain")) + "x") if b in match and match[b]["status"] == "ok"
                 and match[b].get("ratio_vs_plain") is not None else "" for b in batches]
        projected = [m["projected_speedup"] for m in match.values() if m.get("projected_speedup")]
        proj = (f"{min(projected):.2f}x" if len(projected) == 1 or min(projected) == max(projected)
                else f"{min(projected):.2f}-{max(projected):.2f}x") if projected else "-"
        lines.append(f"| {pair} | {fmt(temp, '.1f')} | {system} | {fmt(k, 'd')} | " + " | ".join(acc) + " | "
                     + " | ".join(speed) + f" | {proj} |")
    return "\n".join(lines) + "\n"


def quality_table(result: dict[str, Any]) -> str:
    """Sampled rows: mean per-sequence log-prob under the target, with and without speculation."""
    rows = [r for r in result["rows"] if r.get("status") == "ok" and r.get("quality")]
    if not rows:
        return ""
    lines = ["| pair | system | k | T | batch | sequences | target alone | with speculation | Mann-Whitney p |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q = r["quality"]
        lines.append(f"| {r['pair']} | {r['system']} | {fmt(r['k'], 'd')} | {r['temperature']:.1f} | {r['batch']} "
                     f"| {r.get('num_prompts', '-')} | {q['plain_mean_logprob']:.3f} | {q['spec_mean_logprob']:.3f} "
                     f"| {fmt(q.get('mannwhitney_p'), '.2f')} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str | os.PathLike) -> None:
    """Acceptance length and speedup by system, grouped by pair, temperature and batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result["rows"] if r["status"] == "ok" and r["system"] != "plain"]
    panels = sorted({(r["pair"], r["temperature"]) for r in ok}, key=lambda p: (p[0], p[1]))
    if not panels:
        return
    fig, axes = plt.subplots(len(panels), 2, figsize=(13, 3.2 * len(panels)), squeeze=False)
    for (pair, temp), (ax_acc, ax_speed) in zip(panels, axes):
        rows = [r for r in ok if r["pair"] == pair and r["temperature"] == temp]
        labels = sorted({(r["system"], r["k"] or 0) for r in rows}, key=lambda s: (ALL_SYSTEMS.index(s[0]), s[1]))
        batches = sorted({r["batch"] for r in rows})
        width = 0.8 / max(len(labels), 1)
        for i, (system, k) in enumerate(labels):
            acc, speed = [], []
            for b in batches:
                match = [r for r in rows if r["system"] == system and (r["k"] or 0) == k and r["batch"] == b]
                acc.append(match[0].get("acceptance_length") or 0.0 if match else 0.0)
                speed.append(match[0].get("ratio_vs_plain") or 0.0 if match else 0.0)
            xs = [j + i * width for j in range(len(batches))]
            name = f"{system} k={k}" if k else system
            ax_acc.bar(xs, acc, width, label=name)
            ax_speed.bar(xs, speed, width, label=name)
        for ax, title in ((ax_acc, "acceptance length"), (ax_speed, "tok/s vs target alone")):
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
            ax.set_title(f"{pair}, T={temp}: {title}", fontsize=9)
        ax_speed.axhline(1.0, color="grey", linewidth=0.8)
        ax_acc.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out: Path, make_plot: bool = True,
                  judge: Callable[[dict[str, Any]], str] | None = None) -> dict[str, Path]:
    """Write the JSON, the Markdown tables and (optionally) the plot next to ``out``.

    ``judge(result)``, if given, returns Markdown verdicts on the result (it may add to
    ``result`` too, which is then saved): the project's targets in benchmarks/targets.py.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))  # first, whatever the report below does
    for row in result["rows"]:  # idempotent: a JSON from an older harness gets them too
        add_projection(row)
    verdicts = judge(result) if judge is not None else ""
    md = out.with_suffix(".md")
    out.write_text(json.dumps(result, indent=1, default=str))
    md.write_text(f"Command: `{result['command']}`  \nCPU: {result['cpu']} x {result['cpus']}; "
                  f"versions: {result['versions']}\n\n### Summary\n\n" + summary_table(result)
                  + "\n### Every row\n\n" + markdown_table(result)
                  + ("\n### Output quality of sampled rows (mean log-prob under the target)\n\n" + quality_table(result)
                     if quality_table(result) else "")
                  + ("\n### Targets\n\n" + verdicts if verdicts else ""))
    paths = {"json": out, "md": md}
    if make_plot:
        png = out.with_suffix(".png")
        plot(result, png)
        paths["png"] = png
    return paths
