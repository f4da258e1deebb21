"""What a benchmark runs: systems, pairs, settings and prompts, and the events it reports."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Literal


VLLM_SYSTEMS = ("plain", "native", "usd_greedy", "usd_sampled", "usd_string", "usd_adaptive")
HF_SYSTEMS = ("hf_plain", "hf_assisted")
ALL_SYSTEMS = VLLM_SYSTEMS + HF_SYSTEMS
ENGINE_SETTINGS: dict[str, Any] = dict(dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
                                       disable_log_stats=False)


@dataclass
class PairSpec:
    name: str
    target: str
    drafter: str


@dataclass
class BenchPlan:
    pairs: list[PairSpec]
    systems: tuple[str, ...] = ALL_SYSTEMS
    ks: tuple[int, ...] = (2, 4)
    temperatures: tuple[float, ...] = (0.0, 0.8)
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    repeats: int = 3
    max_tokens: int = 32
    min_prompts: int = 8  # per setting: batch 1 runs this many prompts one after another
    hf_prompts: int = 4
    # install vllm-usd's fix of vLLM's CPU rejection-sampler bug (docs/cpu-expand-bug.md) in every engine,
    # vLLM's native drafter included; vllm-usd's own engines install it either way
    fix_cpu_sampler: bool = False
    # extra additional_config["usd"] settings for every vllm-usd system (drafter_runtime, drafter_dtype, ...)
    usd_settings: dict[str, Any] = field(default_factory=dict)
    prompts: list[dict[str, str]] = field(default_factory=list)  # {"group", "text"}


def load_prompts(path: str | os.PathLike | None = None) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """The built-in prompt set (64 prompts: chat, code, summarise) or a user's file.

    A user's file is JSON ``{"groups": {name: [text, ...]}}``, a JSON list of
    strings, or plain text with one prompt per line.
    """
    if path is None:
        raw = resources.files("vllm_usd").joinpath("data/bench_prompts.json").read_text(encoding="utf-8")
        data = json.loads(raw)
        meta = {"file": "vllm_usd/data/bench_prompts.json", "version": data["version"], "source": data["source"]}
    else:
        text = Path(path).read_text(encoding="utf-8")
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None
        if not isinstance(data, (list, dict)):  # plain text (even a line that parses as JSON)
            data = [line for line in text.splitlines() if line.strip()]
        meta = {"file": str(path)}
    if isinstance(data, list):
        data = {"groups": {"user": data}}
    if not (isinstance(data, dict) and isinstance(data.get("groups"), dict)
            and all(isinstance(v, list) and all(isinstance(t, str) for t in v) for v in data["groups"].values())):
        raise ValueError(f"{meta['file']}: expected a JSON list of strings, {{\"groups\": {{name: [text, ...]}}}}, "
                         "or plain text with one prompt per line")
    # interleave the groups, so any prefix of the list mixes them
    groups = list(data["groups"].items())
    prompts: list[dict[str, str]] = []
    for i in range(max((len(v) for _, v in groups), default=0)):
        for name, items in groups:
            if i < len(items):
                prompts.append({"group": name, "text": items[i]})
    if not prompts:
        raise ValueError(f"no prompts in {meta['file']}")
    return prompts, meta


@dataclass(frozen=True)
class BenchEvent:
    """What the harness reports while it runs: a finished setting, or a message."""

    kind: Literal["setting", "message"]
    text: str


EventSink = Callable[[BenchEvent], None]


def count_settings(plan: BenchPlan) -> int:
    """How many "setting" events ``run_plan`` reports for ``plan`` (per pair)."""
    temps, batches, ks = len(plan.temperatures), len(plan.batch_sizes), len(plan.ks)
    sampled = len([t for t in plan.temperatures if t > 0])
    per_system = {"plain": temps * batches, "native": ks * temps * batches, "usd_greedy": ks * temps * batches,
                  "usd_sampled": ks * sampled * batches, "usd_string": ks * temps * batches,
                  "usd_adaptive": ks * temps * batches,
                  "hf_plain": temps, "hf_assisted": ks * temps}
    return len(plan.pairs) * sum(per_system[s] for s in set(plan.systems))
