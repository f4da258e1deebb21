"""``vllm-usd doctor``: the installed vLLM, a source tree (never imported), and the cached 0.33.0 release."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests import vllm_sources
from vllm_usd.vllm_adapter import fingerprints

PATCH_NAMES = {"runner_hook", "cpu_expand_fix", "cpu_empty_topk_fix", "cpu_drafted_rows_recovery", "no_draft_plain_sampling",
               "frontend_check", "drafts_with_sampled_tokens"}
# runs the CLI in a fresh interpreter, then says whether that interpreter ever imported vLLM
NO_IMPORT = ("import sys; from vllm_usd.cli import main; rc = main(sys.argv[1:]); "
             "print('IMPORTED_VLLM=' + str('vllm' in sys.modules), file=sys.stderr); sys.exit(rc)")


def _doctor(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "vllm_usd.cli", "doctor", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("VLLM_USD_SKIP_FINGERPRINTS", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _check_schema(report: dict) -> None:
    assert isinstance(report["vllm_version"], str) and isinstance(report["supported"], bool)
    assert {p["name"] for p in report["patches"]} == PATCH_NAMES
    for p in report["patches"]:
        assert set(p) >= {"name", "needs", "match", "functions"} and isinstance(p["match"], bool)
        assert [f["function"] for f in p["functions"]] == p["needs"]
        for f in p["functions"]:
            assert f["status"] in ("match", "changed", "missing") and (f["status"] == "match") == bool(f["matches_versions"])


def test_doctor_json_on_the_installed_vllm():
    res = _doctor("--json")
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(res.stdout)
    _check_schema(report)
    assert report["vllm_version"] == "0.32.0" and report["supported"] is True and report["active"] is True
    assert all(p["match"] for p in report["patches"])
    assert report["drafter_device"] == "cpu" and report["target_device"] == "cpu"
    assert [b["name"] for b in report["known_bugs"]][:1] == ["cpu_expand_bug"] and report["known_bugs"][0]["applies"]


def test_doctor_refuses_an_altered_source_tree_without_importing_it(tmp_path):
    tree = vllm_sources.copy_installed(tmp_path / "src")
    runner = tree / "vllm/v1/worker/gpu_model_runner.py"
    text = runner.read_text()
    old = "        self._draft_probs = None\n        self._draft_prob_req_ids = None\n        if spec_config.method == \"ngram\":"
    assert text.count(old) == 1
    runner.write_text(text.replace(old, old.replace("        self._draft_probs = None\n", "")))
    res = _doctor("doctor", "--json", "--vllm-source", str(tree), code=NO_IMPORT)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "IMPORTED_VLLM=False" in res.stderr
    report = json.loads(res.stdout)
    _check_schema(report)
    assert report["supported"] is False and report["active"] is False and report["vllm_version"] == "0.32.0"
    by_name = {p["name"]: p for p in report["patches"]}
    assert not by_name["runner_hook"]["match"] and by_name["cpu_expand_fix"]["match"]
    changed = [f["function"] for f in by_name["runner_hook"]["functions"] if f["status"] != "match"]
    assert changed == ["GPUModelRunner.propose_draft_token_ids"]
    text_out = _doctor("doctor", "--vllm-source", str(tree), code=NO_IMPORT).stdout
    assert "patch runner_hook: REFUSED: GPUModelRunner.propose_draft_token_ids changed" in text_out
    assert "vllm-usd: inactive" in text_out


def test_doctor_on_a_folder_without_vllm(tmp_path):
    res = _doctor("--json", "--vllm-source", str(tmp_path))
    report = json.loads(res.stdout)
    assert res.returncode == 1 and report["supported"] is False and report["vllm_version"] is None


@pytest.fixture(scope="module")
def vllm_033():
    root, why = vllm_sources.release_source("0.33.0")
    if root is None:
        print(f"\nSKIP: vLLM 0.33.0 sources unavailable: {why}")
        pytest.skip(f"vLLM 0.33.0 sources unavailable: {why}")
    return root


def test_vllm_033_from_the_cached_release(vllm_033):
    res = _doctor("doctor", "--json", "--vllm-source", str(vllm_033), code=NO_IMPORT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "IMPORTED_VLLM=False" in res.stderr
    report = json.loads(res.stdout)
    _check_schema(report)
    assert report["vllm_version"] == "0.33.0" and report["supported"] is True
    for p in report["patches"]:
        for f in p["functions"]:
            assert "0.33.0" in f["matches_versions"], f
    # what the table says changed between the two releases really did change
    table = fingerprints.known()
    changed = {k for k in fingerprints.FUNCTIONS if table["0.32.0"][k] != table["0.33.0"][k]}
    assert changed == {"GPUModelRunner.propose_draft_token_ids", "EngineArgs.create_engine_config",
                       "VllmConfig._get_v2_model_runner_unsupported_features", "rejection_sample"}


@pytest.mark.real_pair
def test_doctor_shows_the_drafters_probe_verdict(real_pair, tmp_path):
    """``--drafter``: the runtime, the settings tried with their buffer types and agreement, the cache entry;
    the first call probes, the second reads the cache."""
    from vllm_usd.drafter.llama_cpp_runtime import llama_cpp_available

    if not llama_cpp_available():
        pytest.fail("llama-cpp-python is not installed (scripts/setup-env.sh builds it)")
    env_cache = {"VLLM_USD_CACHE": str(tmp_path)}
    os.environ.update(env_cache)
    try:
        first = _doctor("--drafter", real_pair["smollm2"])
        second = _doctor("--json", "--drafter", real_pair["smollm2"])
    finally:
        os.environ.pop("VLLM_USD_CACHE")
    assert first.returncode == 0, first.stderr[-2000:]
    lines = first.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith(f"drafter {real_pair['smollm2']}: "))
    # the shipped Q4_1 file and its Q8_0 copy are timed here; the faster runs ("gguf": the file as it is)
    assert re.match(rf"drafter {re.escape(real_pair['smollm2'])}: llama_cpp \(gguf(/q8_0)?\), GGUF ", lines[head])
    assert re.match(r"  weight types timed at batch 1 here: file [\d.]+ ms, q8_0 [\d.]+ ms$", lines[head + 1])
    shown = dict(re.findall(r"(file|q8_0) ([\d.]+) ms", lines[head + 1]))
    # the text rounds to 0.1 ms, so two types can print alike; the JSON (from the cached verdicts) holds the
    # unrounded times the choice was made on
    report = json.loads(second.stdout)["drafter"]
    timed = report["types_timed"]
    assert shown == {name: f"{ms:.1f}" for name, ms in timed.items()}, (shown, timed)
    assert f"({report['format']})" in lines[head], (lines[head], report["format"])
    assert (report["format"] == "gguf/q8_0") == (timed["q8_0"] < timed["file"]), timed
    # SmolLM2-135M: 30 layers x (k, v) x 3 KV heads x 64 dims x 2 B (llama.cpp's f16 cache) = 22.5 KiB a token
    assert lines[head + 2].startswith("  memory, allocated at start-up: KV cache 22.5 KiB per token")
    assert lines[head + 3].startswith("  probe: llama.cpp (") and ": ok: top-1 agreement " in lines[head + 3]
    assert "verdict probed now in" in lines[-1] and str(tmp_path / "native-probe") in lines[-1]
    assert report["probe"]["cached"] is True and report["probe"]["settings"]["extra_buffer_types"] is True
    assert report["probe"]["attempts"][0]["buffer_types"] is not None
    assert report["probe"]["cache_file"] in lines[-1]


@pytest.mark.engine
def test_doctor_text_with_a_target_prints_the_startup_measurements():
    """The text report; with ``--target``, vLLM starts with the pair, and the proposer's start-up line comes back: the drafter's
    step, a batch-1 cycle with and without drafts (timed, so drafting 3 costs more than not drafting),
    and one verdict per batch-size bucket up to --max-num-seqs (4: buckets 1, 2-3, 4-7)."""
    from tests.fixtures import tiny

    target, drafter = tiny.tiny_pair("bpe", "sp")
    res = _doctor("--drafter", drafter, "--target", target, "-k", "3", "--max-num-seqs", "4")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    lines = res.stdout.splitlines()
    # the installed vLLM's report, as without --drafter and --target (after vLLM's own warnings)
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("vLLM: 0.32.0 (installed")):]
    assert "patch runner_hook: matches vLLM 0.32.0" in lines and "patch frontend_check: matches vLLM 0.32.0" in lines
    assert any(line.startswith("vllm-usd: active") for line in lines)
    assert any(line.startswith("drafter device: cpu") for line in lines)
    assert any(line.startswith("known bug cpu_expand_bug: measured") for line in lines)
    head = lines.index(f"with target {target} (float32, eager, up to 4 sequences):")
    m = re.fullmatch(r"  vllm-usd: drafter on (\w+) \(([\w/]+)\), a step at batch 1: ([\d.]+) ms; a cycle at batch 1: "
                     r"([\d.]+) ms without drafts, ([\d.]+) ms with 3 \(start-up timing\); at acceptance "
                     r"[\d.]+/[\d.]+/[\d.]+ until measured, drafting pays at batch (.+)", lines[head + 1])
    assert m, lines[head + 1]
    drafter_ms, plain_ms, drafted_ms = (float(m.group(i)) for i in (3, 4, 5))
    assert 0 < drafter_ms and 0 < plain_ms < drafted_ms, lines[head + 1]
    verdicts = m.group(6).split("; ")
    assert [v.split(": ")[0] for v in verdicts] == ["1", "2-3", "4-7"], verdicts
    assert all(re.fullmatch(r"[\d-]+: (yes, [123] drafts [\d.]+x|no \([123] drafts [\d.]+x\))", v) for v in verdicts)


def test_doctor_target_needs_a_drafter():
    res = _doctor("--target", "some/model")
    assert res.returncode == 2 and "doctor --target needs --drafter" in res.stderr, res.stderr[-1000:]
