"""The llama.cpp drafter's weight type: which GGUFs are requantized, to what, once. The real-pair
tests requantize SmolLM2's Q4_1 GGUF (about a second) into a temporary cache."""

from __future__ import annotations

import pytest
import torch

from vllm_usd import config
from vllm_usd.drafter import gguf_types
from vllm_usd.drafter.llama_cpp_runtime import llama_cpp_available

Q4_0, Q4_1, Q8_0, Q4_K_M, IQ4_NL, F16 = 2, 3, 7, 15, 25, 1


@pytest.mark.parametrize("setting,current,expected", [
    ("file", Q4_1, None),
    ("q4_0", Q4_1, "q4_0"),
    ("q4_0", Q4_0, None),  # already that type
    ("q8_0", Q4_K_M, "q8_0"),
    ("bf16", Q4_1, "bf16"),
])
def test_which_ggufs_are_requantized_and_to_what(setting, current, expected):
    assert gguf_types.resolve(setting, current) == expected


@pytest.mark.parametrize("current,timed", [
    (Q4_1, [None, "q8_0"]),  # a 4-bit file: as it is, or widened; never rounded to 4 bits again
    (Q4_0, [None, "q8_0"]),
    (Q4_K_M, [None, "q8_0"]),
    (IQ4_NL, [None, "q8_0"]),
    (Q8_0, [None, "q4_0"]),
    (F16, ["q8_0", "q4_0"]),  # 16-bit (a converted folder): its 8- and 4-bit copies, not itself
])
def test_what_auto_times_for_each_file_type(current, timed):
    assert gguf_types.auto_types(current) == timed


def test_an_unknown_type_names_the_choices():
    with pytest.raises(ValueError, match=r"drafter_gguf_type = 'q2_k' is not one of auto, file, q4_0"):
        gguf_types.resolve("q2_k", Q4_1)


def test_the_settings_offer_exactly_the_types_the_runtime_knows():
    assert config._CHOICES["drafter_gguf_type"] == gguf_types.CHOICES


def test_the_cached_copy_is_keyed_by_the_source_and_the_type(tmp_path):
    src = tmp_path / "m.Q4_1.gguf"
    src.write_bytes(b"x" * 10)
    a = gguf_types.requantized_path(str(src), "iq4_nl", str(tmp_path / "cache"))
    assert a.parent == tmp_path / "cache" / "gguf" and a.name.endswith("-iq4_nl.gguf")
    assert gguf_types.requantized_path(str(src), "q4_0", str(tmp_path / "cache")) != a
    src.write_bytes(b"y" * 11)  # the source changed: a new copy
    assert gguf_types.requantized_path(str(src), "iq4_nl", str(tmp_path / "cache")) != a


real = pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed")


@real
@pytest.mark.real_pair
def test_a_gguf_is_requantized_once_and_drafts_like_the_file(real_pair, tmp_path, monkeypatch):
    from vllm_usd.drafter.select import choose, find_gguf, open_drafter

    folder = real_pair["smollm2"]
    src = find_gguf(folder, None)
    assert gguf_types.file_type(src) == Q4_1
    monkeypatch.setenv("VLLM_USD_CACHE", str(tmp_path))
    kw = dict(max_len=512, max_requests=2, kv_budget_bytes=1 << 28)
    opened = open_drafter(folder, choose(folder, gguf_type="q8_0"), **kw)
    assert opened.choice.dtype == "gguf/q8_0" and opened.choice.gguf.startswith(str(tmp_path / "gguf"))
    assert gguf_types.file_type(opened.choice.gguf) == Q8_0

    # the second start reuses the copy
    def no_second_requantize(*_args):
        raise AssertionError("requantized again")
    monkeypatch.setattr(gguf_types, "requantize", no_second_requantize)
    assert gguf_types.drafter_gguf(src, "q8_0", str(tmp_path)) == (opened.choice.gguf, "q8_0")
    as_is = open_drafter(folder, choose(folder, gguf_type="file"), **kw)
    assert as_is.choice.gguf == src and as_is.choice.dtype == "gguf"

    # the same model, rounded once more (to 8 bits, finer than its 4): next-token choices agree
    text = ("The capital of France is Paris. It is known for the Eiffel Tower, the Louvre and its cafes. "
            "def add(a, b):\n    return a + b\n")
    ids = opened.tokenizer(text).input_ids
    picks = []
    for o in (opened, as_is):
        o.runtime.add("t")
        picks.append([int(o.runtime.forward(["t"], [i], [[ids[i]]]).argmax(-1)) for i in range(len(ids))])
        o.runtime.free("t")
    agree = sum(a == b for a, b in zip(*picks)) / len(ids)
    assert agree >= 0.9, f"the requantized drafter agrees with its source on {agree:.0%} of next tokens"


def test_auto_leaves_out_a_type_that_fails_to_requantize(tmp_path, monkeypatch, caplog):
    """An unwritable cache must not stop an engine that never asked for a type: auto times what it has."""
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    monkeypatch.setattr(gguf_types, "file_type", lambda _path: Q4_1)

    def fail(*_args):
        raise OSError("read-only file system")
    monkeypatch.setattr(gguf_types, "requantize", fail)
    with caplog.at_level("WARNING", logger="vllm.usd"):
        assert gguf_types.candidates(str(src), "auto", str(tmp_path / "ro")) == [(str(src), "file")]
    assert "could not requantize" in caplog.text and "not timing it" in caplog.text
    with pytest.raises(OSError, match="read-only"):  # a type the user named: the error stands
        gguf_types.candidates(str(src), "q8_0", str(tmp_path / "ro"))
