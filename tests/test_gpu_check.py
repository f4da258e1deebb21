"""scripts/gpu_check.sh, the vLLM-free check for a GPU machine, run on the CPU so that it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_and_reports_every_check_on_the_cpu():
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "cpu"], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and summary["ok"] is True, summary
    assert summary["device"] == "cpu"
    paged = summary["paged_vs_contiguous"]
    assert paged["ok"] and paged["greedy_equal"] and paged["max_abs_err"] < 1e-3
    assert summary["q_sums_to_one"]["ok"]
    # TLI: one host read a step (the drafts handed over); string drafting: one per drafter forward
    syncs = summary["draft_syncs"]
    assert syncs["ok"] and syncs["tli_host_reads"] == ["tolist"] and syncs["tli_cuda_syncs"] is None
    assert syncs["string_host_reads"] == syncs["string_forwards"] >= 2
    mem = summary["memory"]
    assert mem["ok"] and mem["blocks_free_after"] == mem["blocks"] > 0 and mem["q_buffer_bytes"] > 0
    rows = summary["step_ms"]["rows"]
    assert {(r["format"], r["batch"]) for r in rows} == {(f, b) for f in ("float32", "bfloat16", "int8") for b in (1, 8, 32)}
    assert all(r["step_ms"] > 0 and r["read_limit_ms"] > 0 for r in rows)
    # no CUDA graph on the CPU: the captured step's fixed shapes, replayed eagerly, against the exact step
    graphs = summary["graph_replay"]
    assert graphs["ok"] and graphs["capture"].startswith("capture_recorded")
    # tokens per row 1 and k + 1 = 4 x buckets 1, 2, 4 (max 4 requests) x widths 1..16 blocks (max_len 256),
    # all before the first decode
    assert graphs["captured_at_start"] == graphs["expected"] == 2 * 3 * 5
    assert graphs["captured_while_serving"] == 0 and graphs["eager_decodes"] == 0
    assert graphs["max_abs_err"] < 1e-3 and graphs["decode_ms"] is None
