"""The native probe: llama.cpp runs in a worker only with settings a child process ran correctly
on this host first (vllm_usd/drafter/native_probe.py). Planted faults (tests/native_faults/)
crash, hang, or compute noise in the child; the verdict must step past each, say why in one line,
and never let the fault reach this process. The real runs use the demo pair's SmolLM2 GGUF."""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest

from vllm_usd.drafter import native_probe
from vllm_usd.drafter.llama_cpp_runtime import NativeSettings, llama_cpp_available


def test_agreement_is_perfect_on_itself_and_poor_on_noise():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(20, 300)) * 4
    top1, gap = native_probe.agreement(logits, logits)
    assert top1 == 1.0 and gap < 1e-9
    top1, gap = native_probe.agreement(logits + 5.0, logits)  # a constant shift is the same distribution
    assert top1 == 1.0 and gap < 1e-9
    top1, gap = native_probe.agreement(rng.normal(size=(20, 300)) * 4, logits)
    assert top1 < native_probe.TOP1_MIN and gap > native_probe.LOGPROB_GAP_MAX
    bad = logits.copy()
    bad[3, 7] = np.nan
    assert native_probe.agreement(bad, logits) == (0.0, float("inf"))


def test_the_settings_are_tried_best_first_then_without_extra_buffers():
    scores = {"libggml-cpu-x64.so": 1, "libggml-cpu-haswell.so": 20, "libggml-cpu-sapphirerapids.so": 0,
              "libggml-cpu-icelake.so": 40}
    assert native_probe.candidates(scores) == [
        NativeSettings("libggml-cpu-icelake.so", True), NativeSettings("libggml-cpu-haswell.so", True),
        NativeSettings("libggml-cpu-icelake.so", False)]
    assert native_probe.candidates({}) == [NativeSettings(None, True), NativeSettings(None, False)]  # native build


def test_the_rows_follow_the_drafting_with_its_rollback():
    calls, prefixes = native_probe.probe_calls(list(range(10, 20)), list(range(30, 38)))
    assert calls[0] == (["a", "b"], [0, 0], [[10, 11, 12, 13, 14], [30, 31, 32, 33]])
    assert calls[1] == (["a"], [5], [[30, 31, 32]])  # three drafts ...
    assert prefixes[2] == [10, 11, 12, 13, 14, 30, 31, 32]
    assert prefixes[3] == [10, 11, 12, 13, 14, 15]  # ... rolled back before the next token
    assert len(prefixes) == sum(len(rows) for rows, _, _ in calls) and len(prefixes) >= 10


def test_a_child_that_dies_is_described_not_raised():
    result = native_probe.run_child({"call": "scan"}, module="tests.native_faults.no_such_module")
    assert not result.ok and result.outcome.startswith("failed (")


needs_llama = pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed")


@pytest.fixture(scope="module")
def smollm(real_pair):
    from transformers import AutoTokenizer

    from vllm_usd.drafter.select import find_gguf

    folder = real_pair["smollm2"]
    return folder, find_gguf(folder, None), AutoTokenizer.from_pretrained(folder)


def _prove(smollm, cache, **kw):
    folder, gguf, tok = smollm
    return native_probe.prove_native(gguf, folder, vocab_size=49_152, tokenizer=tok, threads=2, cache_root=str(cache),
                                     **kw)


@needs_llama
@pytest.mark.real_pair
def test_a_sound_host_keeps_its_best_kernels_and_caches_the_verdict(smollm, tmp_path, monkeypatch):
    started = time.perf_counter()
    verdict = _prove(smollm, tmp_path)
    cold = time.perf_counter() - started
    first = verdict.attempts[0]
    print(f"\n{verdict.summary()}\ncold probe {cold:.1f} s; {first}")
    assert verdict.settings is not None and verdict.settings.extra_buffer_types and len(verdict.attempts) == 1
    assert first["outcome"] == "ok" and first["top1"] >= native_probe.TOP1_MIN
    assert first["logprob_gap"] <= native_probe.LOGPROB_GAP_MAX and not verdict.cached

    def no_child(*_args, **_kw):
        raise AssertionError("a cached verdict runs no child")

    monkeypatch.setattr(native_probe, "run_child", no_child)
    started = time.perf_counter()
    again = _prove(smollm, tmp_path)
    print(f"cached: {time.perf_counter() - started:.2f} s")
    assert again.cached and again.settings == verdict.settings and again.cache_file == verdict.cache_file

    # another GGUF (here: the same bytes and one more) is another key: probed afresh
    folder, gguf, tok = smollm
    other = tmp_path / "other.gguf"
    shutil.copyfile(gguf, other)
    with open(other, "ab") as f:
        f.write(b"\0")
    with pytest.raises(AssertionError, match="runs no child"):
        native_probe.prove_native(str(other), folder, vocab_size=49_152, tokenizer=tok, threads=2,
                                  cache_root=str(tmp_path))


@needs_llama
@pytest.mark.real_pair
def test_a_crash_with_extra_buffers_falls_back_to_none(smollm, tmp_path):
    verdict = _prove(smollm, tmp_path, child="tests.native_faults.crash_with_extra_buffers")
    assert verdict.settings is not None and not verdict.settings.extra_buffer_types
    assert [a["outcome"] for a in verdict.attempts[:-1]] == ["crashed (SIGSEGV)"] * (len(verdict.attempts) - 1)
    assert verdict.attempts[-1]["outcome"] == "ok" and len(verdict.attempts) >= 2
    line = verdict.summary()
    assert "crashed (SIGSEGV)" in line and "no extra buffer types" in line and "\n" not in line


@needs_llama
@pytest.mark.real_pair
def test_a_hang_is_cut_at_the_time_limit(smollm, tmp_path):
    started = time.perf_counter()
    verdict = _prove(smollm, tmp_path, child="tests.native_faults.hang_then_crash", timeout_s=15)
    seconds = time.perf_counter() - started
    assert verdict.attempts[0]["outcome"] == "hung (over 15 s)" and verdict.settings is not None
    assert not verdict.settings.extra_buffer_types
    assert seconds < 15 + 60, f"the probe took {seconds:.0f} s"


@needs_llama
@pytest.mark.real_pair
def test_wrong_logits_mean_transformers(smollm, tmp_path):
    verdict = _prove(smollm, tmp_path, child="tests.native_faults.wrong_logits")
    assert verdict.settings is None
    assert all(a["outcome"].startswith("disagreed with transformers") for a in verdict.attempts)
    assert "the drafter runs on transformers" in verdict.summary()


@needs_llama
@pytest.mark.real_pair
def test_open_drafter_never_loads_what_failed(smollm, tmp_path, monkeypatch):
    """The whole path a worker takes: a planted crash with extra buffers, then llama.cpp without them
    drafts in this process; a probe that cannot run at all gives the transformers runtime."""
    from vllm_usd.drafter.select import choose, open_drafter

    folder, _, _ = smollm
    monkeypatch.setenv("VLLM_USD_CACHE", str(tmp_path))
    kw = dict(max_len=256, max_requests=2, kv_budget_bytes=1 << 28)
    opened = open_drafter(folder, choose(folder), probe_child="tests.native_faults.crash_with_extra_buffers", **kw)
    assert opened.choice.runtime == "llama_cpp" and opened.choice.native.extra_buffer_types is False
    assert "crashed (SIGSEGV)" in opened.choice.probe
    opened.runtime.add("r")
    assert opened.runtime.forward(["r"], [0], [[1, 2, 3]]).isfinite().any()
    opened.runtime.free("r")
    fallback = open_drafter(folder, choose(folder), probe_child="tests.native_faults.no_such_module", **kw)
    assert fallback.choice.runtime == "transformers" and "failed (" in fallback.choice.probe


@needs_llama
@pytest.mark.real_pair
def test_under_tensor_parallelism_every_rank_runs_rank_0s_verdict(smollm, tmp_path, monkeypatch):
    """``probe_on`` is where the probe runs: the proposer passes compat.computed_on_tp_rank0, which runs it on
    rank 0 and hands its choice to every rank. Another rank runs no child and loads what rank 0 chose."""
    import dataclasses

    from vllm_usd.drafter.select import choose, open_drafter

    folder, _, _ = smollm
    monkeypatch.setenv("VLLM_USD_CACHE", str(tmp_path))
    kw = dict(max_len=256, max_requests=2, kv_budget_bytes=1 << 28)
    on_rank0 = []
    rank0 = open_drafter(folder, choose(folder), probe_on=lambda compute: on_rank0.append(1) or compute(), **kw)
    assert on_rank0 == [1] and rank0.choice.native is not None

    def no_child(*_args, **_kw):
        raise AssertionError("only rank 0 probes")

    monkeypatch.setattr(native_probe, "run_child", no_child)
    sent = dataclasses.replace(rank0.choice, native=NativeSettings(rank0.choice.native.cpu_variant, False))
    rank1 = open_drafter(folder, choose(folder), probe_on=lambda compute: sent, **kw)
    assert rank1.choice == sent and rank1.runtime.settings == sent.native
