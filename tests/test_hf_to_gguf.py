"""A drafter given as a Hugging Face folder runs on llama.cpp: converted once by llama.cpp's own
converter, cached by the folder's content, probed like any GGUF; a folder that does not convert
stays on transformers with one log line. No vLLM."""

from __future__ import annotations

import logging
import os
import shutil
from importlib import metadata

import pytest
import torch

from tests.fixtures import tiny
from vllm_usd import envs
from vllm_usd.drafter import hf_to_gguf
from vllm_usd.drafter.llama_cpp_runtime import llama_cpp_available
from vllm_usd.drafter.select import choose, open_drafter

CONVERTER = hf_to_gguf.converter_dir(envs.cache_dir()) if llama_cpp_available() else None
needs_converter = pytest.mark.skipif(CONVERTER is None, reason="llama.cpp or its converter is not installed "
                                                                "(scripts/setup-env.sh installs both)")
OPEN = dict(max_len=256, max_requests=2, kv_budget_bytes=1 << 26)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A copy of the tiny drafter folder (no GGUF), and a cache of this test's own that sees the converter."""
    copy = tmp_path / "drafter"
    shutil.copytree(tiny.build_distribution_pair()[1], copy)
    cache = tmp_path / "cache"
    if CONVERTER is not None:
        (cache / "llama.cpp-convert").mkdir(parents=True)
        (cache / "llama.cpp-convert" / CONVERTER.name).symlink_to(CONVERTER)
    monkeypatch.setenv("VLLM_USD_CACHE", str(cache))
    return str(copy)


@needs_converter
def test_a_folder_is_converted_once_and_drafts_as_transformers_does(folder, monkeypatch, caplog):
    choice = choose(folder)
    assert choice.runtime == "llama_cpp" and choice.gguf is None, "auto should take the fast path for a folder"
    with caplog.at_level(logging.INFO, logger="vllm.usd"):
        opened = open_drafter(folder, choice, **OPEN)
    assert opened.choice.runtime == "llama_cpp", opened.choice.probe
    assert "passed the probe" in opened.choice.probe
    # written in 16 bits, then its Q8_0 and Q4_0 copies timed here: the faster one runs
    timed = [r.getMessage() for r in caplog.records if "types timed at batch 1" in r.getMessage()]
    assert len(timed) == 1 and "q8_0 " in timed[0] and "q4_0 " in timed[0], timed
    # "<type> <ms> ms" where it passed the probe, "<type> failed the probe" where not (the tiny model's 4-bit copy
    # may disagree with it): the fastest that passed runs
    ms = {name: float("inf") if timed[0].split(f"{name} ")[1].startswith("failed") else
          float(timed[0].split(f"{name} ")[1].split(" ms")[0]) for name in ("q8_0", "q4_0")}
    assert opened.choice.dtype == f"gguf/{min(ms, key=ms.get)}", (opened.choice.dtype, timed)
    # the same next tokens as the transformers runtime (float32) on ten contexts
    reference = open_drafter(folder, choose(folder, runtime="transformers", dtype="float32"), **OPEN).runtime
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(4, 200, (n,), generator=g).tolist() for n in range(5, 55, 5)]
    same = 0
    for i, ids in enumerate(contexts):
        for rt in (opened.runtime, reference):
            assert rt.add(f"c{i}")
        same += int(opened.runtime.forward([f"c{i}"], [0], [ids]).argmax()) == int(
            reference.forward([f"c{i}"], [0], [ids]).argmax())
        for rt in (opened.runtime, reference):
            rt.free(f"c{i}")
    assert same >= 8, f"the converted drafter agreed on the next token for {same} of 10 contexts"

    def no_converter(*args, **kwargs):
        raise AssertionError("the converter ran again")

    monkeypatch.setattr(hf_to_gguf.subprocess, "run", no_converter)
    again = open_drafter(folder, choose(folder), **OPEN)
    assert again.choice.gguf == opened.choice.gguf, "the cached GGUF should be used"
    with open(os.path.join(folder, "config.json"), "a") as f:
        f.write("\n")  # new content: a new key, so a new conversion
    assert str(hf_to_gguf.converted_path(folder, envs.cache_dir(), CONVERTER)) != opened.choice.gguf


@pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed")
def test_a_folder_that_does_not_convert_stays_on_transformers_with_one_line(folder, tmp_path, monkeypatch, caplog):
    """The converter fails (here a stand-in that fails as llama.cpp's does on an architecture it lacks)."""
    fake = tmp_path / "fake-cache" / "llama.cpp-convert" / metadata.version("llama_cpp_python")
    fake.mkdir(parents=True)
    (fake / "convert_hf_to_gguf.py").write_text(
        "import sys\nprint('NotImplementedError: Architecture \\'TinyForCausalLM\\' not supported!', file=sys.stderr)\n"
        "sys.exit(1)\n")
    monkeypatch.setenv("VLLM_USD_CACHE", str(tmp_path / "fake-cache"))
    choice = choose(folder)
    assert choice.runtime == "llama_cpp"
    with caplog.at_level(logging.WARNING, logger="vllm.usd"):
        opened = open_drafter(folder, choice, **OPEN)
    assert opened.choice.runtime == "transformers"
    lines = [r.getMessage() for r in caplog.records if "was not converted for llama.cpp" in r.getMessage()]
    assert len(lines) == 1 and "'TinyForCausalLM' not supported" in lines[0] and "runs on transformers" in lines[0]
    opened.runtime.add("r")
    assert opened.runtime.forward(["r"], [0], [[5, 6, 7]]).isfinite().all()


def test_a_transformers_format_named_by_the_user_is_not_converted(folder):
    assert choose(folder, dtype="float32").runtime == "transformers"
    assert choose(folder, runtime="transformers").runtime == "transformers"


def test_auto_runs_the_fastest_type_that_passed_the_probe(monkeypatch, tmp_path):
    """probe_verdict's choice among timed types, on stand-in verdicts: a faster type that failed the probe is
    never run, the fastest that passed is, and with none passing the first candidate's verdict (transformers)."""
    from vllm_usd.drafter import gguf_types, native_probe, select
    from vllm_usd.drafter.llama_cpp_runtime import NativeSettings

    results = {}

    def fake_prove(gguf, *args, **kwargs):
        ms, passed = results[gguf]
        return native_probe.NativeVerdict(NativeSettings("x", True) if passed else None,
                                          attempts=[{"outcome": "ok" if passed else "crashed", "step_ms": ms}])

    monkeypatch.setattr(native_probe, "prove_native", fake_prove)
    monkeypatch.setattr(gguf_types, "candidates", lambda gguf, t, c: [("a.gguf", "file"), ("b.gguf", "q8_0"),
                                                                       ("c.gguf", "q4_0")])
    choice = select.DrafterChoice("llama_cpp", "gguf", "cpu", "a.gguf", "auto")
    run = lambda: select.probe_verdict(choice, str(tmp_path), tokenizer=None, vocab_size=1, threads=1)  # noqa: E731
    results.update({"a.gguf": (9.0, True), "b.gguf": (7.0, True), "c.gguf": (3.0, False)})
    gguf, name, verdict, timed = run()
    assert (gguf, name) == ("b.gguf", "q8_0") and timed == {"file": 9.0, "q8_0": 7.0, "q4_0": None}
    results.update({"a.gguf": (9.0, False), "b.gguf": (7.0, False), "c.gguf": (3.0, False)})
    gguf, name, verdict, _ = run()
    assert (gguf, name) == ("a.gguf", "file") and verdict.settings is None
