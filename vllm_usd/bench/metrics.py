"""Derived numbers: step split, ratios against the target alone, projection, output quality."""

from __future__ import annotations

import statistics
from typing import Any


def step_split(timings: dict[str, float]) -> dict[str, float] | None:
    """Step time in target (+ rest of vLLM), drafter forwards and proposer overhead, as fractions."""
    total = timings.get("propose_total", 0.0) + timings.get("outside_proposer", 0.0)
    if total <= 0:
        return None
    drafter = timings.get("drafter_forward", 0.0)
    overhead = timings.get("propose_total", 0.0) - drafter
    return {"target_and_vllm": timings.get("outside_proposer", 0.0) / total, "drafter_forward": drafter / total,
            "proposer_overhead": overhead / total,
            "proposer_phases_s": {k: v for k, v in timings.items() if k not in ("propose_total", "outside_proposer")}}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """tok/s ratios against the target alone in vLLM (and, for HF rows, in transformers)."""
    base = {(r["pair"], r["temperature"], r["batch"]): r for r in rows
            if r["system"] == "plain" and r["status"] == "ok"}
    hf_base = {(r["pair"], r["temperature"]): r for r in rows if r["system"] == "hf_plain" and r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        b = base.get((r["pair"], r["temperature"], r["batch"]))
        r["ratio_vs_plain"] = r["tok_s"] / b["tok_s"] if b else None
        if r["system"].startswith("hf"):
            hb = hf_base.get((r["pair"], r["temperature"]))
            r["ratio_vs_hf_plain"] = r["tok_s"] / hb["tok_s"] if hb else None
        if b and r["system"] != "plain" and r.get("greedy_outputs") is not None and b.get("greedy_outputs"):
            r["greedy_equal_plain"] = r["greedy_outputs"] == b["greedy_outputs"]
        if b and r.get("mean_logprob_per_seq") and b.get("mean_logprob_per_seq") and r["system"] != "plain":
            r["quality"] = quality(b["mean_logprob_per_seq"], r["mean_logprob_per_seq"])
    for r in rows:
        r.pop("greedy_outputs", None)
        add_projection(r)


PROJECTION_COST_RATIO = 0.05  # a 135M drafter for a multi-billion target on a GPU: one draft ~ 5% of a target step


def add_projection(row: dict[str, Any]) -> None:
    """(E[accepted] + 1) / (1 + k*c): the speedup the measured acceptance would give at cost ratio c.

    ``measured_cost_ratio`` is c on this machine for vllm-usd rows: the drafter's time per drafted
    token over the time of one target step (and the rest of vLLM), from the phase timers.
    """
    if row.get("status") != "ok" or not row.get("k") or not row.get("acceptance_length"):
        return
    if row["system"].startswith("hf"):
        return  # transformers' k counts drafter tokens, not target tokens
    k, length = row["k"], row["acceptance_length"]
    row["projected_speedup"] = length / (1 + k * PROJECTION_COST_RATIO)
    row["projection_cost_ratio"] = PROJECTION_COST_RATIO
    split = row.get("step_split")
    if split and split.get("target_and_vllm"):
        row["measured_cost_ratio"] = split["drafter_forward"] / (k * split["target_and_vllm"])


def quality(plain: list[float], spec: list[float]) -> dict[str, float]:
    """Mean per-sequence log-prob under the target, speculation vs not (Mann-Whitney U p-value)."""
    out = {"plain_mean_logprob": statistics.fmean(plain), "spec_mean_logprob": statistics.fmean(spec)}
    try:
        from scipy.stats import mannwhitneyu

        out["mannwhitney_p"] = float(mannwhitneyu(plain, spec).pvalue)
    except Exception:  # noqa: BLE001 - scipy is optional here
        pass
    return out
