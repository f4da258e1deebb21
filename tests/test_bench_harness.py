"""vllm_usd.bench without an engine: prompts, ratios, the engine-log root cause, the tables, the targets."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from pathlib import Path

from benchmarks import targets
from vllm_usd.bench import metrics, plan, report, vllm_systems

REPO = Path(__file__).resolve().parents[1]


def test_builtin_prompts_are_64_in_three_groups_interleaved():
    prompts, meta = plan.load_prompts()
    assert len(prompts) == 64 and meta["version"] == 1 and "CC0" in meta["source"]
    groups = [p["group"] for p in prompts]
    assert {g: groups.count(g) for g in set(groups)} == {"chat": 24, "code": 20, "summarise": 20}
    assert groups[:3] == ["chat", "code", "summarise"], "any prefix mixes the groups"
    assert len({p["text"] for p in prompts}) == 64


def test_user_prompt_files(tmp_path):
    lines = tmp_path / "p.txt"
    lines.write_text("first prompt\n\n42\nthird\n")
    assert [p["text"] for p in plan.load_prompts(lines)[0]] == ["first prompt", "42", "third"]
    js = tmp_path / "p.json"
    js.write_text(json.dumps(["a", "b"]))
    assert [p["text"] for p in plan.load_prompts(js)[0]] == ["a", "b"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prompts": ["a"]}))
    with pytest.raises(ValueError, match="expected a JSON list of strings"):
        plan.load_prompts(bad)


def test_root_cause_is_read_from_the_engine_log(tmp_path):
    log = tmp_path / "engine.log"
    code = ("import sys; print('(Worker) ERROR AssertionError: All drafting layers should belong to the same "
            "kv cache group', file=sys.stderr); print('RuntimeError: Engine core initialization failed. See root "
            "cause above.', file=sys.stderr)")
    with vllm_systems.stderr_copied_to(log) as drain:
        subprocess.run([sys.executable, "-c", code], check=True)
    drain()  # tee may not have written it yet
    text = log.read_text()
    assert vllm_systems.root_cause(text) == "AssertionError: All drafting layers should belong to the same kv cache group"
    assert vllm_systems.root_cause("nothing went wrong") is None


def _row(system, tok_s, k=None, temperature=0.0, batch=8, **extra):
    return {"pair": "p", "system": system, "k": k, "temperature": temperature, "batch": batch, "status": "ok",
            "tok_s": tok_s, "tok_s_runs": [tok_s], **extra}


def test_ratios_equality_and_quality_against_the_target_alone():
    rows = [_row("plain", 100.0, greedy_outputs=[[1, 2]]),
            _row("usd_greedy", 50.0, k=2, greedy_outputs=[[1, 2]]),
            _row("native", 25.0, k=2, greedy_outputs=[[1, 3]]),
            _row("plain", 80.0, temperature=0.8, mean_logprob_per_seq=[-1.0, -1.2, -0.9, -1.1]),
            _row("usd_sampled", 40.0, k=2, temperature=0.8, mean_logprob_per_seq=[-1.1, -1.0, -0.95, -1.05]),
            {"pair": "p", "system": "native", "k": 4, "temperature": 0.0, "batch": 8, "status": "failed",
             "error": "AssertionError: x"}]
    metrics.add_ratios(rows)
    assert rows[1]["ratio_vs_plain"] == 0.5 and rows[1]["greedy_equal_plain"] is True
    assert rows[2]["greedy_equal_plain"] is False
    q = rows[4]["quality"]
    assert math.isclose(q["plain_mean_logprob"], -1.05) and 0 <= q["mannwhitney_p"] <= 1
    assert all("greedy_outputs" not in r for r in rows)
    table = report.markdown_table({"rows": rows})
    assert "| p | usd_greedy | 2 | 0.0 | 8 |" in table and "0.50x" in table and "failed: AssertionError: x" in table


def _step_split(overhead):
    return {"target_and_vllm": 0.6, "drafter_forward": 0.4 - overhead, "proposer_overhead": overhead}


def test_projection_uses_the_measured_acceptance_and_k():
    row = _row("usd_greedy", 10.0, k=4, acceptance_length=2.4, step_split=_step_split(0.0))
    metrics.add_projection(row)
    assert math.isclose(row["projected_speedup"], 2.4 / (1 + 4 * metrics.PROJECTION_COST_RATIO))
    assert math.isclose(row["measured_cost_ratio"], 0.4 / (4 * 0.6))
    plain = _row("plain", 10.0)
    metrics.add_projection(plain)
    assert "projected_speedup" not in plain


def test_targets_are_judged_from_the_rows():
    rows = [
        # tiny-like pair: native runs
        _row("native", 1.0, k=2, acceptance_length=2.0),
        _row("usd_greedy", 1.0, k=2, acceptance_length=2.4, step_split=_step_split(0.04)),
        _row("usd_greedy", 1.0, k=2, acceptance_length=1.5, temperature=0.8, step_split=_step_split(0.12)),
        _row("usd_sampled", 1.0, k=2, acceptance_length=1.9, temperature=0.8, step_split=_step_split(0.05)),
        _row("usd_greedy", 1.0, k=2, batch=1, acceptance_length=2.2),
        _row("hf_assisted", 1.0, k=2, batch=1, acceptance_length=2.5),
        # real-like pair: native cannot start
        {"pair": "q", "system": "native", "k": 2, "temperature": 0.0, "batch": 8, "status": "failed",
         "error": "AssertionError: kv cache group"},
        {**_row("usd_greedy", 1.0, k=2, acceptance_length=2.0), "pair": "q"},
        {**_row("usd_greedy", 1.0, k=2, batch=1, acceptance_length=2.0), "pair": "q"},
        {"pair": "q", "system": "native", "k": 2, "temperature": 0.0, "batch": 1, "status": "failed",
         "error": "AssertionError: kv cache group"},
    ]
    checks = targets.check_targets({"rows": rows})
    by = {(c["target"], c["what"].split(":")[0]): c for c in checks}
    assert by[("vs_native", "p k=2 batch=8")]["met"] is True  # 2.4 / 2.0 = 1.2
    assert math.isclose(by[("vs_native", "p k=2 batch=8")]["value"], 1.2)
    assert by[("vs_native", "q")]["met"] is None
    assert "kv cache group" in by[("vs_native", "q")]["detail"]
    assert sum(c["target"] == "vs_native" and c["what"].startswith("q") for c in checks) == 1
    assert by[("vs_transformers", "p k=2 batch=1")]["met"] is False  # 2.2 < 2.5
    assert by[("sampled_beats_greedy", "p k=2 T=0.8 batch=8")]["met"] is True
    overhead = {c["what"].split(":")[0]: c["met"] for c in checks if c["target"] == "overhead"}
    assert overhead == {"p usd_greedy k=2 T=0.0 batch=8": True, "p usd_greedy k=2 T=0.8 batch=8": False,
                        "p usd_sampled k=2 T=0.8 batch=8": True}
    text = targets.targets_markdown(checks)
    assert "**missed**" in text and "not measurable" in text


def test_report_regenerates_table_projection_and_targets_from_json(tmp_path):
    rows = [_row("plain", 100.0, greedy_outputs=[[1]]),
            _row("usd_greedy", 50.0, k=2, acceptance_length=2.5, greedy_outputs=[[1]], step_split=_step_split(0.03))]
    metrics.add_ratios(rows)
    for r in rows:  # as an older harness wrote them
        r.pop("projected_speedup", None)
        r.pop("measured_cost_ratio", None)
    result = {"command": "x", "cpu": "c", "cpus": 2, "versions": {}, "rows": rows}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    out = subprocess.run([sys.executable, "benchmarks/report.py", str(path)], capture_output=True, text=True,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    saved = json.loads(path.read_text())
    assert math.isclose(saved["rows"][1]["projected_speedup"], 2.5 / 1.1)
    assert saved["targets"] and saved["targets"][0]["target"] == "overhead"
    md = path.with_suffix(".md").read_text()
    assert "2.27x" in md and "| yes |" in md and "### Targets" in md
    assert path.with_suffix(".png").stat().st_size > 1000


def test_summary_table_has_one_line_per_system_with_every_batch():
    rows = [_row("plain", 100.0, batch=1), _row("plain", 200.0, batch=8),
            _row("usd_greedy", 50.0, k=2, batch=1, acceptance_length=2.5),
            _row("usd_greedy", 150.0, k=2, batch=8, acceptance_length=2.25),
            {"pair": "p", "system": "native", "k": 2, "temperature": 0.0, "batch": 1, "status": "failed",
             "error": "AssertionError: group"},
            {"pair": "p", "system": "native", "k": 2, "temperature": 0.0, "batch": 8, "status": "failed",
             "error": "AssertionError: group"}]
    metrics.add_ratios(rows)
    lines = report.summary_table({"rows": rows}).splitlines()
    assert len(lines) == 4  # header, rule, usd_greedy, native
    assert lines[2].startswith("| p | 0.0 | usd_greedy | 2 | 2.50 | 2.25 | 0.50x | 0.75x |")
    assert "2.05-2.27x" in lines[2]
    assert "failed: AssertionError: group" in lines[3]


def test_transformers_rows_get_no_projection():
    row = _row("hf_assisted", 1.0, k=4, batch=1, acceptance_length=2.4)
    metrics.add_projection(row)
    assert "projected_speedup" not in row  # transformers' k counts drafter tokens


def test_targets_survive_rows_without_drafts_and_cells_escape_pipes():
    rows = [_row("native", 1.0, k=2, acceptance_length=2.0),
            _row("usd_greedy", 1.0, k=2, acceptance_length=None),
            _row("usd_greedy", 1.0, k=2, batch=1, acceptance_length=None),
            _row("hf_assisted", 1.0, k=2, batch=1, acceptance_length=2.5),
            {"pair": "p", "system": "native", "k": 4, "temperature": 0.0, "batch": 8, "status": "failed",
             "error": "ValueError: a | b"}]
    assert [c["target"] for c in targets.check_targets({"rows": rows})] == []
    table = report.markdown_table({"rows": rows})
    failed = next(line for line in table.splitlines() if "failed" in line)
    assert "a \\| b" in failed
    assert failed.replace("\\|", "").count("|") == table.splitlines()[0].count("|")


def test_cells_keep_the_root_cause_of_a_worker_failure():
    text = ("EngineStartError: RuntimeError: Worker failed with error 'All drafting layers should belong to the "
            "same kv cache group', please check the stack trace above for the root cause")
    assert report.cell(text) == "All drafting layers should belong to the same kv cache group"
    assert report.cell("ValueError: x") == "ValueError: x"


def test_report_replaces_the_readme_block_only(tmp_path):
    rows = [_row("plain", 100.0), _row("usd_greedy", 50.0, k=2, acceptance_length=2.5, step_split=_step_split(0.03))]
    metrics.add_ratios(rows)
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"command": "python run.py", "cpu": "c", "cpus": 2, "versions": {}, "rows": rows,
                                "seconds": 600}))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- bench:begin -->\nold table\n<!-- bench:end -->\noutro\n")
    out = subprocess.run([sys.executable, "benchmarks/report.py", str(path), "--readme", str(readme)],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    text = readme.read_text()
    assert text.startswith("intro\n<!-- bench:begin -->") and text.endswith("<!-- bench:end -->\noutro\n")
    assert "old table" not in text and "| p | 0.0 | usd_greedy | 2 | 2.50 |" in text and "10 minutes" in text
    readme.write_text("no markers\n")
    out = subprocess.run([sys.executable, "benchmarks/report.py", str(path), "--readme", str(readme)],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 1 and "markers" in out.stderr


def test_settings_are_counted_as_the_runner_reports_them():
    """The CLI's progress bar totals count_settings(plan) and advances on each "setting" event."""
    p = plan.BenchPlan(pairs=[plan.PairSpec("a", "t", "d"), plan.PairSpec("b", "t", "d")],
                       systems=("plain", "usd_greedy", "usd_sampled", "hf_assisted"), ks=(2, 4),
                       temperatures=(0.0, 0.8), batch_sizes=(1, 8))
    # per pair: plain 2 T x 2 b; usd_greedy 2 k x 2 T x 2 b; usd_sampled 2 k x 1 T x 2 b; hf_assisted 2 k x 2 T
    assert plan.count_settings(p) == 2 * (4 + 8 + 4 + 4)


def test_extra_usd_settings_reach_every_vllm_usd_system_and_no_other():
    extra = {"drafter_runtime": "transformers", "drafter_dtype": "float32"}
    for system in ("usd_greedy", "usd_sampled", "usd_string", "usd_adaptive"):
        usd = vllm_systems.engine_args(system, "drafter-dir", 2, extra)["additional_config"]["usd"]
        assert usd["drafter_runtime"] == "transformers" and usd["drafter_dtype"] == "float32", system
    # the system's own choices stay unless the extra settings name them
    assert vllm_systems.engine_args("usd_string", "d", 2, extra)["additional_config"]["usd"]["draft_mode"] == "string"
    forced = vllm_systems.engine_args("usd_string", "d", 2, {"draft_mode": "tli"})["additional_config"]["usd"]
    assert forced["draft_mode"] == "tli"
    assert vllm_systems.engine_args("plain", "d", 2, extra) == {}
    assert "additional_config" not in vllm_systems.engine_args("native", "d", 2, extra)


def test_drafter_step_times_each_llama_decode_call_and_puts_the_call_back():
    from types import SimpleNamespace

    from benchmarks.drafter_step import DecodeCallTimer

    calls = []
    module = SimpleNamespace(llama_decode=lambda ctx, batch: calls.append((ctx, batch)) or 0)
    original = module.llama_decode
    runtime = SimpleNamespace(_ll=module)
    with DecodeCallTimer(runtime) as timer:
        assert module.llama_decode(1, 2) == 0 and module.llama_decode(3, 4) == 0
    assert calls == [(1, 2), (3, 4)] and len(timer.seconds) == 2 and all(t >= 0 for t in timer.seconds)
    assert module.llama_decode is original, "the module's own llama_decode is back after the block"
    with DecodeCallTimer(SimpleNamespace()) as none:  # a transformers runtime: nothing to time
        pass
    assert none.seconds == []
