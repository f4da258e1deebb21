"""vllm_usd.bench without an engine: prompts, ratios, the engine-log root cause, the table."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from vllm_usd import bench


def test_builtin_prompts_are_64_in_three_groups_interleaved():
    prompts, meta = bench.load_prompts()
    assert len(prompts) == 64 and meta["version"] == 1 and "CC0" in meta["source"]
    groups = [p["group"] for p in prompts]
    assert {g: groups.count(g) for g in set(groups)} == {"chat": 24, "code": 20, "summarise": 20}
    assert groups[:3] == ["chat", "code", "summarise"], "any prefix mixes the groups"
    assert len({p["text"] for p in prompts}) == 64


def test_user_prompt_files(tmp_path):
    lines = tmp_path / "p.txt"
    lines.write_text("first prompt\n\n42\nthird\n")
    assert [p["text"] for p in bench.load_prompts(lines)[0]] == ["first prompt", "42", "third"]
    js = tmp_path / "p.json"
    js.write_text(json.dumps(["a", "b"]))
    assert [p["text"] for p in bench.load_prompts(js)[0]] == ["a", "b"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prompts": ["a"]}))
    with pytest.raises(ValueError, match="expected a JSON list of strings"):
        bench.load_prompts(bad)


def test_root_cause_is_read_from_the_engine_log(tmp_path):
    log = tmp_path / "engine.log"
    code = ("import sys; print('(Worker) ERROR AssertionError: All drafting layers should belong to the same "
            "kv cache group', file=sys.stderr); print('RuntimeError: Engine core initialization failed. See root "
            "cause above.', file=sys.stderr)")
    with bench._stderr_copied_to(log):
        subprocess.run([sys.executable, "-c", code], check=True)
    text = log.read_text()
    assert bench._root_cause(text) == "AssertionError: All drafting layers should belong to the same kv cache group"
    assert bench._root_cause("nothing went wrong") is None


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
    bench._add_ratios(rows)
    assert rows[1]["ratio_vs_plain"] == 0.5 and rows[1]["greedy_equal_plain"] is True
    assert rows[2]["greedy_equal_plain"] is False
    q = rows[4]["quality"]
    assert math.isclose(q["plain_mean_logprob"], -1.05) and 0 <= q["mannwhitney_p"] <= 1
    assert all("greedy_outputs" not in r for r in rows)
    table = bench.markdown_table({"rows": rows})
    assert "| p | usd_greedy | 2 | 0.0 | 8 |" in table and "0.50x" in table and "failed: AssertionError: x" in table
