"""The benchmark harness behind ``vllm-usd bench`` and ``benchmarks/run.py``.

plan.py (systems, settings, prompts, events) -> vllm_systems.py / hf_systems.py (run one
setting) -> runner.py (``run_plan``) -> metrics.py (ratios, split, projection) -> report.py
(tables, plot, files). The project's own verdicts on the numbers live in benchmarks/targets.py.
"""

from vllm_usd.bench.plan import (
    ALL_SYSTEMS, HF_SYSTEMS, VLLM_SYSTEMS, BenchEvent, BenchPlan, PairSpec, count_settings, load_prompts,
)
from vllm_usd.bench.report import markdown_table, quality_table, summary_table, write_outputs
from vllm_usd.bench.runner import run_plan
from vllm_usd.bench.vllm_systems import spec_counters

__all__ = [
    "ALL_SYSTEMS", "HF_SYSTEMS", "VLLM_SYSTEMS", "BenchEvent", "BenchPlan", "PairSpec", "count_settings",
    "load_prompts", "markdown_table", "quality_table", "run_plan", "spec_counters", "summary_table", "write_outputs",
]
