"""The benchmark harness on its smallest plan: every field present, every ratio finite.

No speed assertions: this only guards the harness against rot.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bench_smoke, pytest.mark.engine]

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"
TOP_FIELDS = {"created", "command", "host", "cpu", "cpu_flags", "cpus", "versions", "seconds", "plan",
              "engine_settings", "rows", "prompts"}
ROW_FIELDS = {"pair", "system", "k", "temperature", "batch", "status", "tok_s", "tok_s_runs", "acceptance_length",
              "per_position_acceptance", "draft_tokens_per_step", "ratio_vs_plain", "peak_memory_mib", "num_prompts"}


def test_smoke_plan_writes_complete_results(tmp_path):
    out = tmp_path / "smoke.json"
    res = subprocess.run([sys.executable, str(RUN), "--smoke", "--out", str(out)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    result = json.loads(out.read_text())
    assert TOP_FIELDS <= set(result), TOP_FIELDS - set(result)
    rows = result["rows"]
    assert {r["system"] for r in rows} == {"plain", "usd_greedy", "hf_plain", "hf_assisted"}
    assert all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
    for r in rows:
        assert ROW_FIELDS <= set(r), (r["system"], ROW_FIELDS - set(r))
        assert math.isfinite(r["tok_s"]) and r["tok_s"] > 0
        assert r["ratio_vs_plain"] is not None and math.isfinite(r["ratio_vs_plain"]) and r["ratio_vs_plain"] > 0
        if r["system"] in ("usd_greedy", "hf_assisted"):
            assert math.isfinite(r["acceptance_length"]) and r["acceptance_length"] >= 1.0
        if r["system"] == "hf_assisted":  # k = 2: at most 3 tokens a step, from the second token on too
            assert 1.0 <= r["acceptance_length_after_first"] <= 3.0
        if r["system"] == "usd_greedy":
            split = r["step_split"]
            parts = (split["target_and_vllm"], split["drafter_forward"], split["proposer_overhead"])
            assert all(math.isfinite(p) and 0 < p < 1 for p in parts), split
            assert split["proposer_phases_s"]["drafter_forward"] > 0 and split["proposer_phases_s"]["translate"] > 0
            assert len(r["per_position_acceptance"]) == 2
            if r["temperature"] == 0:
                assert r["greedy_equal_plain"] is True
            else:
                assert {"plain_mean_logprob", "spec_mean_logprob"} <= set(r["quality"])
    assert out.with_suffix(".md").read_text().count("\n") >= len(rows) + 2
    assert out.with_suffix(".png").stat().st_size > 1000


def test_interleaved_check_reports_each_kind_of_prompt_with_its_sources(tmp_path):
    """benchmarks/interleaved_check.py (the side-by-side check of issue 40's targets) on its smallest plan:
    a row per (kind, length, temperature, batch), paired ratios, and where every prompt came from."""
    out = tmp_path / "interleaved.json"
    res = subprocess.run([sys.executable, str(RUN.with_name("interleaved_check.py")), "--pair", "tiny", "--rounds", "1",
                          "--batch-sizes", "1", "--temperatures", "0", "--max-tokens", "8", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    result = json.loads(out.read_text())
    assert [(r["workload"], r["max_tokens"]) for r in result["rows"]] == [("code", 8), ("prose", 8), ("chat", 8)]
    assert all(r["usd_ratio"] > 0 and len(r["usd_paired_ratios"]) == 1 for r in result["rows"])
    # batch 1 takes four prompts, each on both engines in turn: four timed generate calls per engine and round
    assert all([len(x) for x in r[f"{n}_group_seconds"]] == [4] for r in result["rows"] for n in ("plain", "usd"))
    sources = result["workloads"]["prompts"]
    assert all(".py:" in s for s in sources["code"]) and all("#" in s for s in sources["prose"]), sources
    assert result["host"]["cpu"] and result["workloads"]["python"]
    assert "| code | 8 | 0.0 | 1 |" in res.stdout, res.stdout[-2000:]
