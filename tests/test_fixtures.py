"""The fixtures have the properties the other tests rely on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from tests.fixtures import tiny


def test_tiny_tokenizers_properties(tiny_tokenizers):
    bpe, sp = tiny_tokenizers["bpe"], tiny_tokenizers["sp"]
    assert not tiny.vocab_dict_is_ascending(sp) and not tiny.vocab_dict_is_ascending(bpe)
    assert tiny.has_byte_fallback(sp) and not tiny.has_byte_fallback(bpe)
    assert "Ġ" in "".join(bpe.convert_ids_to_tokens(bpe("a b").input_ids))
    assert "Ċ" in bpe.convert_ids_to_tokens(bpe("a\nb").input_ids)
    assert "<0x0A>" in sp.convert_ids_to_tokens(sp("a\nb").input_ids)
    assert len(bpe) != len(sp)
    specials = lambda t: {t.bos_token, t.eos_token, t.pad_token}  # noqa: E731
    assert specials(bpe).isdisjoint(specials(sp)), "special tokens differ between the two"
    assert sp("a").input_ids[0] == sp.bos_token_id and bpe("a").input_ids[0] != bpe.bos_token_id


def test_tiny_models_padded_vocab_and_safetensors():
    bpe = tiny.build_model("bpe")
    cfg = AutoConfig.from_pretrained(bpe)
    assert cfg.vocab_size > len(AutoTokenizer.from_pretrained(bpe))
    assert (Path(bpe) / "model.safetensors").exists()
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert head_dim in (32, 64), "vLLM's CPU attention supports only some head sizes"


def test_tiny_fixtures_are_cached_and_deterministic():
    assert tiny.build_model("sp", seed=1) == tiny.build_model("sp", seed=1)
    t, d = tiny.build_distribution_pair()
    token_map = json.loads((Path(d) / "token_map.json").read_text())
    assert len(token_map["draft_to_target"]) > 150


@pytest.mark.real_pair
def test_real_pair_tokenizers(real_pair):
    gemma = AutoTokenizer.from_pretrained(real_pair["gemma3"])
    smol = AutoTokenizer.from_pretrained(real_pair["smollm2"])
    assert gemma("Hello").input_ids[0] == gemma.bos_token_id, "Gemma-3 must add <bos> (GGUF conversion loses it)"
    assert len(gemma) == 262_144 and len(smol) == 49_152
    assert AutoConfig.from_pretrained(real_pair["gemma3"]).architectures == ["Gemma3ForCausalLM"]
    assert AutoConfig.from_pretrained(real_pair["smollm2"]).architectures == ["LlamaForCausalLM"]
