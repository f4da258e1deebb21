"""The served soak (benchmarks/soak.py) for 2 minutes on the real pair.

16 concurrent streams, greedy and sampled, 10% aborted mid-stream. The script
checks: no 5xx or transport errors, /health at the end, every completed greedy
request equal to the offline reference, no drafter state left, flat memory.
Fixed k (``adaptive_length=false``): every step drafts, so the load is on the
drafting machinery; the draft-length policy would draft little at batch 16 on
this CPU, where drafting does not pay.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.real_pair]

SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


def test_served_soak_two_minutes(real_pair, tmp_path):
    out = tmp_path / "soak.json"
    res = subprocess.run([sys.executable, str(SOAK), "--minutes", "2", "--streams", "16", "--abort-rate", "0.1",
                          "--target", real_pair["gemma3"], "--drafter", real_pair["smollm2"],
                          "--usd", "adaptive_length=false", "--out", str(out)],
                         capture_output=True, text=True, timeout=1200)
    assert out.exists(), res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report.get("failure") is None, report["failure"]
    failed = [name for name, ok in report["checks"].items() if not ok]
    stats = report["stats"]
    server_log = out.with_suffix(".server.log")
    log_tail = server_log.read_text()[-4000:] if server_log.exists() else "(no server log)"
    assert not failed, {"failed": failed, "errors": stats["errors"], "mismatches": stats["mismatches"],
                        "proposer": report["proposer"], "memory": report["memory_verdict"],
                        "server_log_tail": log_tail}
    assert stats["served"] > 0 and stats["greedy_checked"] > 0 and stats["sampled"] > 0
    assert report["acceptance_length"] and report["acceptance_length"] > 1.0
    assert res.returncode == 0
