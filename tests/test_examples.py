"""Every example, and the `vllm-usd bench` front, run on the tiny fixtures as a user would run them.

The real-pair defaults are exercised by `scripts/demo.sh` (the README's main
command) and by test_real_pair; here each script must exit 0 and print what it
promises.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair():
    from tests.fixtures import tiny

    return tiny.build_distribution_pair()


def _run(cmd: list[str], timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    """Run an example in its own process group; on a timeout the whole group (vLLM's engine too) is killed."""
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PY": sys.executable, **env}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd[1]} did not finish in {timeout} s:\n{out[-2000:]}\n{err[-3000:]}")
    res = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def test_analyze_pair_example(pair):
    from vllm_usd.core import VocabMapping

    res = _run(["bash", "examples/analyze_pair.sh", *pair, "--json"])
    report = json.loads(res.stdout)
    from transformers import AutoTokenizer

    mapping = VocabMapping.build(AutoTokenizer.from_pretrained(pair[0]), AutoTokenizer.from_pretrained(pair[1]))
    assert report["intersection"] == mapping.size


@pytest.mark.engine
def test_offline_batch_example(pair):
    res = _run([sys.executable, "examples/offline_batch.py", "--target", pair[0], "--drafter", pair[1],
                "--max-tokens", "16"])
    assert "acceptance" in res.stdout.lower(), res.stdout[-2000:]


def _demo_rows(stdout: str) -> list[dict[str, str]]:
    """The demo's closing table, a dict per row by column name."""
    rows, header = [], None
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| prompts | scenario"):
            header = [c.split(" (")[0] for c in cells]
        elif header and line.startswith("| ") and not line.startswith("|---"):
            rows.append(dict(zip(header, cells)))
        elif header and not line.startswith("|"):
            header = None
    return rows


@pytest.mark.engine
def test_demo_on_the_tiny_pair(pair):
    """examples/demo.py: one table, a row per kind of prompt (code and prose nobody here wrote, our chat)
    and scenario (batch 1, then 8 at once), and the greedy-equality line last (it exits non-zero when
    greedy output differs from the target alone).

    The tiny pair's drafter costs as much as its target, so the draft-length controller rarely drafts;
    --fixed-length makes every step draft, so the equality is one with drafts.
    """
    res = _run([sys.executable, "examples/demo.py", "--target", pair[0], "--drafter", pair[1], "--max-tokens", "16",
                "--fixed-length", "--rounds", "1"])
    assert res.stdout.rstrip().endswith("greedy outputs identical to the target alone: 36/36"), res.stdout[-2000:]
    rows = _demo_rows(res.stdout)
    assert [(r["prompts"], r["scenario"]) for r in rows] == [
        (kind, scenario) for kind in ("code", "prose", "chat") for scenario in ("one request at a time",
                                                                             "8 requests at once")], res.stdout[-2000:]
    for row in rows:
        assert int(row["drafts"]) > 0 and float(row["acceptance length"]) > 1, row
        assert row["greedy = target alone"] == ("4/4" if row["scenario"] == "one request at a time" else "8/8"), row
    assert "code from " in res.stdout and ".py:" in res.stdout, "the prompts' sources are named"


@pytest.mark.engine
def test_serve_and_query_example(pair):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = _run(["bash", "examples/serve_and_query.sh", *pair], PORT=str(port))
    assert "completion:" in res.stdout and "vllm:spec_decode_num_accepted_tokens_total" in res.stdout, res.stdout
    assert "equivalent plain vLLM command" in res.stdout + res.stderr


@pytest.mark.engine
def test_vllm_usd_bench_front(pair, tmp_path):
    out = tmp_path / "bench.json"
    res = _run([sys.executable, "-m", "vllm_usd.cli", "bench", *pair, "-k", "2", "--systems", "plain", "usd_greedy",
                "--temperatures", "0", "--batch-sizes", "2", "--repeats", "1", "--max-tokens", "8", "--out", str(out)])
    assert "| pair | usd_greedy | 2 | 0.0 | 2 |" in res.stdout, res.stdout[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["system"] for r in rows] == ["plain", "usd_greedy"] and rows[1]["acceptance_length"] > 1
