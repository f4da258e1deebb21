"""Choosing the drafter runtime and weight format, and what each format computes. No vLLM."""

from __future__ import annotations

import pytest
import torch

from tests.fakes import small_gguf
from vllm_usd.drafter import select
from vllm_usd.drafter.loading import DrafterLoadError


@pytest.fixture
def folder_with_gguf(tmp_path):
    folder = tmp_path / "with-gguf"
    folder.mkdir()
    small_gguf(folder / "model.gguf")
    return str(folder)


def test_auto_takes_llama_cpp_on_the_cpu_when_a_gguf_and_the_library_are_there(folder_with_gguf, monkeypatch):
    from vllm_usd.drafter import llama_cpp_runtime

    monkeypatch.setattr(llama_cpp_runtime, "llama_cpp_available", lambda: True)
    choice = select.choose(folder_with_gguf, device="cpu")
    assert choice.runtime == "llama_cpp" and choice.gguf.endswith("model.gguf")
    # on a GPU worker the drafter runs where the target runs, in transformers
    gpu = select.choose(folder_with_gguf, device="cuda:0")
    assert gpu.runtime == "transformers" and gpu.dtype == select.AUTO_DTYPE["cuda"] and gpu.device == "cuda:0"
    # without the library: transformers in the format measured fastest on the CPU
    monkeypatch.setattr(llama_cpp_runtime, "llama_cpp_available", lambda: False)
    fallback = select.choose(folder_with_gguf, device="cpu")
    assert fallback.runtime == "transformers" and fallback.dtype == select.AUTO_DTYPE["cpu"]


def test_auto_without_a_gguf_is_transformers(tmp_path, monkeypatch):
    from vllm_usd.drafter import llama_cpp_runtime

    monkeypatch.setattr(llama_cpp_runtime, "llama_cpp_available", lambda: True)
    assert select.choose(str(tmp_path), device="cpu").runtime == "transformers"
    small_gguf(tmp_path / "a.gguf")
    small_gguf(tmp_path / "b.gguf")
    assert select.choose(str(tmp_path), device="cpu").runtime == "transformers", "two GGUFs: not guessed"
    named = select.choose(str(tmp_path), gguf=str(tmp_path / "b.gguf"), device="cpu")
    assert named.runtime == "llama_cpp" and named.gguf.endswith("b.gguf")


def test_impossible_choices_are_one_line_errors(tmp_path, folder_with_gguf, monkeypatch):
    from vllm_usd.drafter import llama_cpp_runtime

    monkeypatch.setattr(llama_cpp_runtime, "llama_cpp_available", lambda: True)
    with pytest.raises(DrafterLoadError, match="no GGUF was found: set usd.drafter_gguf"):
        select.choose(str(tmp_path), runtime="llama_cpp", device="cpu")
    with pytest.raises(DrafterLoadError, match="CPU only"):
        select.choose(folder_with_gguf, runtime="llama_cpp", device="cuda:0")
    with pytest.raises(DrafterLoadError, match="is not a file"):
        select.choose(str(tmp_path), gguf=str(tmp_path / "missing.gguf"), device="cpu")
    with pytest.raises(DrafterLoadError, match="int8.*CPU only"):
        select.choose(str(tmp_path), dtype="int8", device="cuda:0")
    monkeypatch.setattr(llama_cpp_runtime, "llama_cpp_available", lambda: False)
    with pytest.raises(DrafterLoadError, match=r"pip install 'vllm-usd\[llamacpp\]'"):
        select.choose(folder_with_gguf, runtime="llama_cpp", device="cpu")
    with pytest.raises(DrafterLoadError) as info:
        select.choose(str(tmp_path), runtime="llama_cpp", device="cpu")
    assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def tiny_drafter():
    from tests.fixtures import tiny

    return tiny.build_distribution_pair()[1]


@pytest.mark.parametrize("dtype,tolerance", [("bfloat16", 0.15), ("int8", 0.25)])
def test_each_format_drafts_what_float32_drafts_up_to_its_precision(tiny_drafter, dtype, tolerance):
    """bfloat16 and int8 change the logits a little (q is then the format's own distribution, so lossless)."""
    opened = {d: select.open_drafter(tiny_drafter, select.DrafterChoice("transformers", d, "cpu"), max_len=256,
                                     max_requests=4, kv_budget_bytes=1 << 28) for d in ("float32", dtype)}
    prompt = [[5, 17, 42, 9, 33, 8, 21], [60, 2, 2, 71]]
    logits = {}
    for d, o in opened.items():
        for r in ("a", "b"):
            o.runtime.add(r)
        logits[d] = o.runtime.forward(["a", "b"], [0, 0], prompt)
    ref, got = logits["float32"], logits[dtype]
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert not torch.equal(got, ref), f"{dtype} must actually run in {dtype}"
    assert (got - ref).abs().max() < tolerance * ref.abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    fp32, small = opened["float32"].runtime.param_bytes, opened[dtype].runtime.param_bytes
    assert small < 0.75 * fp32, (fp32, small)
