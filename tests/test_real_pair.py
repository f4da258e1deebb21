"""The real pair: SmolLM2-135M-Instruct (byte-level BPE, 49k) and Gemma-3-270m (SentencePiece, 262k).

Converted from PyPI GGUF packages on first use (a few minutes, then cached).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tests.engines import engine, proposer_stats, spec_counts, token_ids

pytestmark = pytest.mark.real_pair

PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "The three primary colors are",
    "Once upon a time, in a small village,", "def add(a, b):\n    return", "The largest planet in the solar system is",
    "To bake bread, you need", "The meaning of the word 'ephemeral' is", "import numpy as np\n\nx = np.",
    "In 1969, the first person to walk on the moon was", "A haiku about autumn:\n", "The French word for cat is",
    "Photosynthesis converts", "The quick brown fox", "SELECT name FROM users WHERE", "Dear Sir or Madam,\n\nI am writing to",
    "The speed of light is approximately", "Ingredients for pancakes:\n-", "for i in range(10):\n   ", "Tokyo is the capital of",
    "Shakespeare wrote", "The human heart has four", "<html>\n<head>\n<title>", "Q: What is 12 times 12?\nA:",
    "The Great Wall of China was built", "Machine learning is", "The recipe calls for two cups of", "café, naïve, façade:",
    "東京は", "The Pythagorean theorem states that", "Rain is caused by", "My favorite book is",
]


@pytest.fixture(scope="module")
def tokenizers(real_pair):
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(path) for name, path in real_pair.items()}


# -- vocabulary core on real tokenizers (no engine) ---------------------------------------
def test_overlap_counts(tokenizers):
    from vllm_usd.core import VocabMapping

    gemma, smol = tokenizers["gemma3"], tokenizers["smollm2"]
    start = time.perf_counter()
    m = VocabMapping.build(gemma, smol)
    seconds = time.perf_counter() - start
    print(f"\nGemma-3 target, SmolLM2 drafter: {m.size} shared of {m.target_vocab_size} / {m.draft_vocab_size}, "
          f"{m.byte_only_matches} by bytes only; built in {seconds:.1f} s")
    assert m.target_vocab_size == 262_144 and m.draft_vocab_size == 49_152
    assert 0.85 * m.draft_vocab_size < m.size < m.draft_vocab_size
    assert m.byte_only_matches > 10_000  # Ġ/▁ and Ċ/newline conventions differ everywhere
    assert m.target_to_draft[gemma.convert_tokens_to_ids("▁the")] == smol.convert_tokens_to_ids("Ġthe")
    newline_g = gemma("a\nb", add_special_tokens=False).input_ids[1]
    assert m.target_to_draft[newline_g] == smol.convert_tokens_to_ids("Ċ")
    assert m.target_to_draft[gemma.eos_token_id] == smol.eos_token_id
    reverse = VocabMapping.build(smol, gemma)
    assert reverse.size == m.size


def _real_text_lines() -> list[str]:
    """A few thousand lines of real prose and code: the fixture corpus plus Python stdlib modules."""
    corpus = (Path(__file__).parent / "fixtures" / "corpus.txt").read_text(encoding="utf-8")
    lines = corpus.splitlines(keepends=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "json/decoder.py", "difflib.py", "string.py", "csv.py"):
        lines += (stdlib / name).read_text(encoding="utf-8").splitlines(keepends=True)
    return lines


@pytest.mark.parametrize("target,drafter", [("gemma3", "smollm2"), ("smollm2", "gemma3")])
def test_translator_invariant_on_real_text(tokenizers, target, drafter):
    from vllm_usd.core import ContextTranslator, FragmentEncoder, VocabMapping

    t_tok, d_tok = tokenizers[target], tokenizers[drafter]
    m = VocabMapping.build(t_tok, d_tok)
    enc = FragmentEncoder(d_tok, m.draft_table)
    bos = d_tok.bos_token_id if d_tok("a").input_ids[:1] == [d_tok.bos_token_id] else None
    lines = _real_text_lines()
    assert len(lines) > 2000
    rng = random.Random(0)
    unk = d_tok.unk_token_id
    for start in range(0, len(lines), 40):  # documents of 40 lines
        ids = t_tok("".join(lines[start:start + 40])).input_ids
        tr = ContextTranslator(m, enc, bos)
        cut = rng.randint(0, min(30, len(ids)))
        tr.start(ids[:cut])
        pos = cut
        while pos < len(ids):
            step = rng.randint(1, 6)
            tr.feed(ids[pos:pos + step])
            pos += step
            want = m.target_table.bytes_of(ids[:pos])
            assert m.draft_table.bytes_of(tr.draft_ids) + tr.pending_bytes == want
        assert unk is None or unk not in tr.draft_ids


# -- inside vLLM ------------------------------------------------------------------------------
def _greedy(llm, n_tokens: int = 64, prompts: int = len(PROMPTS)):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)
    return token_ids(llm.generate(PROMPTS[:prompts], params, use_tqdm=False))


REAL_ENGINE = dict(max_model_len=1024, max_num_seqs=32)


SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


def _soak_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gemma_reference(real_pair):
    """Gemma-3 alone: greedy output on PROMPTS and on the soak's greedy requests, and how long its engine
    took to start."""
    from vllm import SamplingParams

    started = time.perf_counter()
    with engine(real_pair["gemma3"], **REAL_ENGINE) as llm:
        start_s = time.perf_counter() - started
        reqs = _soak_module().greedy_requests()
        params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
        soak = token_ids(llm.generate([r["prompt"] for r in reqs], params, use_tqdm=False))
        return {"start_s": start_s, "greedy": _greedy(llm), "soak": soak}


@pytest.mark.engine
def test_greedy_equal_gemma_target_smollm_drafter(real_pair, gemma_reference):
    """Both drafting modes: string-level (the default for greedy requests), then TLI for every request
    (planted in the same engine: ``tests.faults.TliForEveryRequest``)."""
    from vllm import SamplingParams

    from tests.faults import TliForEveryRequest, planted

    ref = gemma_reference["greedy"]
    with engine(real_pair["gemma3"], drafter=real_pair["smollm2"], k=3, **REAL_ENGINE) as llm:
        assert _greedy(llm) == ref
        string_counts = spec_counts(llm)
        string_proposed = proposer_stats(llm)["counters"]["string_proposed"]
        assert string_proposed > 0
        with planted(llm, TliForEveryRequest):
            outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                                use_tqdm=False)
        after = spec_counts(llm)
        assert proposer_stats(llm)["counters"]["string_proposed"] == string_proposed, "TLI drafted no text"
    counts = {key: after[key] - string_counts[key] for key in ("drafts", "draft_tokens", "accepted")}
    counts["acceptance_length"] = 1 + counts["accepted"] / counts["drafts"] if counts["drafts"] else 1.0
    got = token_ids(outs)
    assert got == ref
    print(f"\nGemma-3 <- SmolLM2, k=3: TLI {counts}, string {string_counts}")
    assert counts["accepted"] > 0 and counts["acceptance_length"] > 1.2
    assert string_counts["accepted"] > 0 and string_counts["acceptance_length"] > 1.2

    # `vllm-usd analyze --models` estimates TLI's acceptance offline: teacher-forced on the same
    # texts, it must land within 25% of what the engine measured.
    from transformers import AutoModelForCausalLM

    from vllm_usd.analysis.acceptance import estimate_acceptance
    from vllm_usd.drafter import load_drafter

    target = AutoModelForCausalLM.from_pretrained(real_pair["gemma3"]).eval()
    drafter, d_tok = load_drafter(real_pair["smollm2"])
    from transformers import AutoTokenizer

    sample = outs[:4]  # 4 x 64 generated positions
    est = estimate_acceptance(target, AutoTokenizer.from_pretrained(real_pair["gemma3"]), drafter, d_tok,
                              [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in sample],
                              [len(o.prompt_token_ids) for o in sample], ks=range(3, 4))
    print(f"estimated acceptance length at k=3: {est.greedy_length[3]:.2f} (engine: {counts['acceptance_length']:.2f})")
    assert abs(est.greedy_length[3] - counts["acceptance_length"]) <= 0.25 * counts["acceptance_length"]


@pytest.mark.engine
def test_native_faults_in_the_probe_leave_the_engine_up(real_pair, gemma_reference, tmp_path, capfd):
    """Planted (tests/native_faults/hang_then_crash.py): in the worker's native probe, llama.cpp's best
    setting hangs and the next one segfaults. The engine starts on the third (no extra buffer types)
    within the probe's time limit plus a start-up, says why in one line, drafts, and stays lossless."""
    from tests.faults import HangThenCrashProbeProposer

    started = time.perf_counter()
    # one weight type (auto would time two, each through the planted ladder)
    with engine(real_pair["gemma3"], drafter=real_pair["smollm2"], k=3, proposer=HangThenCrashProbeProposer,
                usd={"drafter_gguf_type": "file"}, env={"VLLM_USD_CACHE": str(tmp_path)}, **REAL_ENGINE) as llm:
        start_s = time.perf_counter() - started
        got = _greedy(llm, prompts=8)  # lossless after the probe's fallback (the other tests cover all prompts)
        stats = proposer_stats(llm)
    log = "".join(capfd.readouterr())  # vLLM's log handler writes to stdout
    line = stats["drafter_probe"]
    print(f"\nstarted in {start_s:.0f} s (the target alone: {gemma_reference['start_s']:.0f} s)\n{line}")
    assert got == gemma_reference["greedy"][:8]
    assert "hung (over 20 s)" in line and "crashed (SIGSEGV)" in line and "no extra buffer types" in line
    assert stats["drafter_runtime"] == "llama_cpp" and stats["native_settings"]["extra_buffer_types"] is False
    assert stats["counters"]["drafted_rows"] > 0
    assert line in log, "the worker logs the verdict"
    # the hang costs its time limit: the probe's other children load a small GGUF each (seconds)
    probed_s = float(re.search(r"probed in ([0-9.]+) s", line).group(1))
    assert probed_s < HangThenCrashProbeProposer.probe_timeout_s + 30
    # the rest is a start-up: loading and timing the drafter scale with the host as the target's start does
    # (on an AVX2-only EPYC, run alone: 141-145 s with a 31-32 s probe, against the target alone's 52-58 s)
    assert start_s < probed_s + 60 + 2 * gemma_reference["start_s"]


JSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
               "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20},
                              "population": {"type": "integer"}}}
JSON_PROMPTS = ["Give the largest city of Japan as JSON:", "A JSON record for Paris:", "City data in JSON. Berlin:"]


def _json(llm):
    """Structured output through vLLM's guided decoding (JSON schema), greedy."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    sp = SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=StructuredOutputsParams(json=JSON_SCHEMA))
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in llm.generate(JSON_PROMPTS, sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def smollm_reference(real_pair):
    with engine(real_pair["smollm2"], **REAL_ENGINE) as llm:
        return {"greedy": _greedy(llm), "json": _json(llm)}


@pytest.mark.engine
def test_greedy_equal_smollm_target_gemma_drafter(real_pair, smollm_reference):
    with engine(real_pair["smollm2"], drafter=real_pair["gemma3"], k=3, **REAL_ENGINE) as llm:
        got = _greedy(llm)
        counts = spec_counts(llm)
        structured = _json(llm)
        json_counts = spec_counts(llm)
    assert got == smollm_reference["greedy"]
    print(f"\nSmolLM2 <- Gemma-3, k=3: {counts}")
    assert counts["accepted"] > 0
    # structured output: vLLM rejects drafts the grammar forbids; output equal and valid
    assert structured == smollm_reference["json"]
    assert json_counts["accepted"] > counts["accepted"], "no drafts accepted under the JSON grammar"
    for text, finish in structured:
        if finish == "stop":
            record = json.loads(text)
            assert set(record) == {"city", "country", "population"} and isinstance(record["population"], int)
    assert any(finish == "stop" for _, finish in structured), structured


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.engine
def test_server_completions_chat_stream_and_metrics(real_pair, smollm_reference, tmp_path):
    """`vllm-usd serve` on 127.0.0.1: output equals offline greedy, /metrics shows accepted drafts."""
    import requests

    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    cmd = [sys.executable, "-m", "vllm_usd.cli", "serve", real_pair["smollm2"], "--drafter", real_pair["gemma3"],
           "-k", "3", "--usd", "adaptive_length=false",  # every step drafts: /metrics must show accepted drafts
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "1024", "--max-num-seqs", "8"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 400
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.time() < deadline, "server did not become healthy"
            time.sleep(2)
        model = real_pair["smollm2"]
        for i in (0, 5, 19):
            body = {"model": model, "prompt": PROMPTS[i], "max_tokens": 64, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            r = requests.post(f"{base}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["token_ids"] == smollm_reference["greedy"][i], (choice["text"], i)
            streamed = requests.post(f"{base}/v1/completions", json={**body, "stream": True}, timeout=120, stream=True)
            text = ""
            for line in streamed.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
            assert text == choice["text"]
        chat = {"model": model, "messages": [{"role": "user", "content": "Name three colors."}],
                "max_tokens": 32, "temperature": 0}
        r = requests.post(f"{base}/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["message"]["content"]
        streamed = requests.post(f"{base}/v1/chat/completions", json={**chat, "stream": True}, timeout=120, stream=True)
        parts = []
        for line in streamed.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                delta = json.loads(line[6:])["choices"][0].get("delta", {})
                parts.append(delta.get("content") or "")
        assert content and "".join(parts) == content
        metrics = requests.get(f"{base}/metrics", timeout=10).text
        accepted = [float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
        assert accepted and sum(accepted) > 0, "no accepted drafts in /metrics"
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
    assert server.returncode is not None


@pytest.mark.engine
def test_served_soak_two_minutes(real_pair, gemma_reference, tmp_path):
    """The served soak (benchmarks/soak.py) for 2 minutes: 16 concurrent streams, greedy and sampled, 10%
    aborted mid-stream. The script checks: no 5xx or transport errors, /health at the end, every completed
    greedy request equal to the target alone's (computed by this module's Gemma-3 engine), no drafter
    state left, flat memory. Fixed k (``adaptive_length=false``): every step drafts, so the load is on the
    drafting machinery; the draft-length controller would draft little at batch 16 on this CPU."""
    out, reference = tmp_path / "soak.json", tmp_path / "reference.json"
    reference.write_text(json.dumps(gemma_reference["soak"]))
    res = subprocess.run([sys.executable, str(SOAK), "--minutes", "2", "--streams", "16", "--abort-rate", "0.1",
                          "--target", real_pair["gemma3"], "--drafter", real_pair["smollm2"], "--reference",
                          str(reference), "--usd", "adaptive_length=false", "--out", str(out)],
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
