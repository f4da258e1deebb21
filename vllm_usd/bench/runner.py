"""Benchmark harness: acceptance and throughput of speculative methods, side by side.

Systems, each on the same prompts with identical engine settings:

    plain        the target alone in vLLM (the baseline for every ratio)
    native       vLLM's own ``draft_model`` with ``use_heterogeneous_vocab`` (greedy drafts)
    usd_greedy   vllm-usd TLI (``draft_mode="tli"``), ``draft_sampling="greedy"``
    usd_sampled  vllm-usd TLI, ``draft_sampling="auto"``: drafts sampled like the request, q handed over
                 (at temperature 0 this is the same as usd_greedy and is not run twice)
    usd_string   vllm-usd string-level drafting for every request (``draft_mode="string"``; no q)
    usd_adaptive vllm-usd's defaults: ``adaptive_length`` on (k is the cap, each request drafts 0..k
                 per step) and ``draft_mode="auto"`` (string drafts for greedy requests, TLI for sampled);
                 the other usd rows draft a fixed k
    hf_plain     transformers' ``generate`` with the target alone, batch 1
    hf_assisted  transformers' universal assisted generation (``assistant_tokenizer``), batch 1

Every vLLM row is a batch of ``batch`` concurrent requests; tokens/s is the
median of ``repeats`` timed runs after one warm-up run. vllm-usd rows read the
proposer's phase timers (``usd.profile``) to split a step into the target (and
the rest of vLLM), the drafter's forwards and the proposer's own overhead.

``python benchmarks/run.py`` and ``vllm-usd bench`` are fronts for ``run_plan``.
"""

from __future__ import annotations

import copy
import datetime as dt
import os
import socket
import sys
import time
from dataclasses import asdict
from typing import Any, Callable

from vllm_usd import envs
from vllm_usd.bench.hf_systems import hf_rows
from vllm_usd.bench.machine import PeakMemory, cpu_flags, cpu_model, versions
from vllm_usd.bench.metrics import add_ratios
from vllm_usd.bench.plan import ENGINE_SETTINGS, HF_SYSTEMS, BenchEvent, BenchPlan, EventSink
from vllm_usd.bench.vllm_systems import engine, engine_args, run_setting


def vllm_engines(plan: BenchPlan) -> list[tuple[str, int | None]]:
    engines: list[tuple[str, int | None]] = []
    if "plain" in plan.systems:
        engines.append(("plain", None))
    for system in ("native", "usd_greedy", "usd_sampled", "usd_string", "usd_adaptive"):
        if system in plan.systems:
            engines += [(system, k) for k in plan.ks]
    return engines


def _print_event(event: BenchEvent) -> None:
    print(f"bench: {event.text}", file=sys.stderr, flush=True)


def run_plan(plan: BenchPlan, *, command: str, on_event: EventSink | None = None,
             checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run every system of the plan.

    ``on_event`` hears of each setting as it starts (``count_settings`` of them) and of
    other news; ``checkpoint`` gets the partial result after each engine.
    """
    emit = on_event or _print_event

    def report(text: str) -> None:
        emit(BenchEvent("message", text))
    started = time.time()
    rows: list[dict[str, Any]] = []

    def result(final: bool) -> dict[str, Any]:
        done = rows if final else copy.deepcopy(rows)
        add_ratios(done)
        return {
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "complete": final,
            "command": command, "host": socket.gethostname(), "cpu": cpu_model(), "cpu_flags": cpu_flags(),
            "cpus": os.cpu_count(),
            "versions": versions(), "seconds": time.time() - started,
            "plan": {**asdict(plan), "prompts": None, "num_prompts": len(plan.prompts),
                     "pairs": [asdict(p) for p in plan.pairs]},
            "engine_settings": ENGINE_SETTINGS, "rows": done,
            "cpu_sampler_fix_in_every_engine": envs.fix_cpu_sampler(),
        }

    def save() -> None:
        if checkpoint is not None:
            checkpoint(result(final=False))
    if plan.fix_cpu_sampler:  # read by register() in each engine process
        envs.set_fix_cpu_sampler()
    n_prompts = max(plan.min_prompts, max(plan.batch_sizes))
    texts = [p["text"] for p in plan.prompts]
    setting_prompts = [texts[i % len(texts)] for i in range(n_prompts)]
    for pair in plan.pairs:
        for system, k in vllm_engines(plan):
            temps = [t for t in plan.temperatures if not (system == "usd_sampled" and t == 0)]
            if not temps:
                continue
            report(f"{pair.name}: starting {system}" + (f" k={k}" if k else ""))
            try:
                with PeakMemory() as mem, engine(pair.target, max(plan.batch_sizes),
                                                  engine_args(system, pair.drafter, k or 0, plan.usd_settings)) as llm:
                    for temperature in temps:
                        for batch in plan.batch_sizes:
                            emit(BenchEvent("setting", f"{pair.name}: {system} k={k} T={temperature} batch={batch}"))
                            count = max(plan.min_prompts, batch)
                            row = run_setting(llm, setting_prompts[:count], batch, temperature, plan.max_tokens,
                                               plan.repeats, usd=system.startswith("usd"),
                                               want_logprobs=temperature > 0)
                            row.update(pair=pair.name, system=system, k=k, temperature=temperature, batch=batch,
                                       status="ok", num_prompts=count)
                            rows.append(row)
                peak = mem.peak
                for row in rows:
                    if row["pair"] == pair.name and row["system"] == system and row["k"] == k:
                        row["peak_memory_mib"] = peak / 2**20
            except Exception as exc:  # noqa: BLE001 - a system that cannot start is a result, not a crash
                message = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
                report(f"{pair.name}: {system} k={k} failed: {message}")
                done = {(r["temperature"], r["batch"]) for r in rows
                        if r["pair"] == pair.name and r["system"] == system and r["k"] == k}
                for temperature in temps:
                    for batch in plan.batch_sizes:
                        if (temperature, batch) in done:
                            continue
                        rows.append({"pair": pair.name, "system": system, "k": k, "temperature": temperature,
                                     "batch": batch, "status": "failed", "error": message})
            save()
        if any(s in plan.systems for s in HF_SYSTEMS):
            try:
                with PeakMemory() as mem:
                    hf = hf_rows(pair, plan, texts[: plan.hf_prompts], emit)
                for row in hf:
                    row["peak_memory_mib"] = mem.peak / 2**20
                rows += hf
            except Exception as exc:  # noqa: BLE001
                message = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
                report(f"{pair.name}: transformers assisted generation failed: {message}")
                rows.append({"pair": pair.name, "system": "hf_assisted", "k": None, "temperature": None,
                             "batch": 1, "status": "failed", "error": message})
            save()
    return result(final=True)
