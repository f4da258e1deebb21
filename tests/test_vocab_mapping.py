"""VocabMapping: byte-exact, sorted, deterministic, role-aware. No vLLM."""

from __future__ import annotations

import json
import random

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.fixtures import tiny
from vllm_usd.core import VocabMapping, build_token_table

PAIRS = [("bpe", "sp"), ("sp", "bpe")]


def _word_level(words: list[str], **special) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=special.get("unk_token", words[0])))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def _reordered(tokenizer, seed: int) -> PreTrainedTokenizerFast:
    """Same ids, but the vocab dict stored (and so iterated) in a shuffled order."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    items = list(spec["model"]["vocab"].items())
    random.Random(seed).shuffle(items)
    spec["model"]["vocab"] = dict(items)
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token, unk_token=tokenizer.unk_token,
    )


@pytest.fixture(scope="module")
def mappings(tiny_tokenizers):
    return {(t, d): VocabMapping.build(tiny_tokenizers[t], tiny_tokenizers[d]) for t, d in PAIRS}


# -- the HF AssistantToTargetTranslator cases, with our own code ------------------------
def test_mapping_vector_and_unmappable_ids():
    target = _word_level(["hello", "world", "foo", "baz"])
    draft = _word_level(["world", "hello", "bar"])
    m = VocabMapping.build(target, draft, min_share=0.0)
    assert m.draft_to_target.tolist() == [1, 0, -1]
    assert m.target_to_draft.tolist() == [1, 0, -1, -1]
    assert m.draft_ids.tolist() == [0, 1]
    assert m.target_ids.tolist() == [1, 0]


def test_scatter_into_padded_target_size():
    target = _word_level(["hello", "world", "foo"])
    draft = _word_level(["world", "hello", "bar"])
    m = VocabMapping.build(target, draft, target_vocab_size=8, draft_vocab_size=5, min_share=0.0)
    assert m.target_to_draft.shape == (8,) and m.draft_to_target.shape == (5,)
    assert m.target_to_draft[3:].eq(-1).all() and m.draft_to_target[3:].eq(-1).all()
    p = torch.tensor([[0.25, 0.75]])  # over draft_ids [0 ("world"), 1 ("hello")]
    q = m.scatter_to_target(p)
    assert q.shape == (1, 8)
    assert q[0].tolist() == [0.75, 0.25, 0, 0, 0, 0, 0, 0]


# -- invariants on the tiny fixtures ----------------------------------------------------
@pytest.mark.parametrize("pair", PAIRS)
def test_sorted_consistent_and_byte_exact(mappings, pair):
    m = mappings[pair]
    d = m.draft_ids
    assert d.dtype == torch.long and bool((d[1:] > d[:-1]).all()), "draft_ids must be strictly ascending"
    assert torch.equal(m.draft_to_target[m.draft_ids], m.target_ids)
    assert torch.equal(m.target_to_draft[m.target_ids], m.draft_ids)
    assert int((m.draft_to_target >= 0).sum()) == m.size == int((m.target_to_draft >= 0).sum())
    specials = set(m.draft_table.roles.values())
    for did, tid in zip(m.draft_ids.tolist(), m.target_ids.tolist()):
        if did in specials:
            continue
        assert m.draft_table.token_bytes[did] == m.target_table.token_bytes[tid] != b""


@pytest.mark.parametrize("pair", PAIRS)
def test_independent_of_vocab_dict_order(tiny_tokenizers, mappings, pair):
    t, d = pair
    assert not tiny.vocab_dict_is_ascending(tiny_tokenizers["sp"]), "fixture must have a non-ascending dict"
    ref = mappings[pair]
    for seed in range(3):
        m = VocabMapping.build(_reordered(tiny_tokenizers[t], seed), _reordered(tiny_tokenizers[d], seed + 10))
        for name in ("draft_ids", "target_ids", "draft_to_target", "target_to_draft"):
            assert torch.equal(getattr(m, name), getattr(ref, name)), name


def test_newline_and_half_utf8_bytes_match(tiny_tokenizers, mappings):
    bpe, sp = tiny_tokenizers["bpe"], tiny_tokenizers["sp"]
    m = mappings[("bpe", "sp")]
    nl_t, nl_d = bpe.convert_tokens_to_ids("Ċ"), sp.convert_tokens_to_ids("<0x0A>")
    assert m.target_to_draft[nl_t] == nl_d
    # "Ã" is the byte 0xC3 alone: half of "é". It must match <0xC3>, never U+FFFD.
    half_t, half_d = bpe.convert_tokens_to_ids("Ã"), sp.convert_tokens_to_ids("<0xC3>")
    assert m.target_table.token_bytes[half_t] == b"\xc3"
    assert m.target_to_draft[half_t] == half_d
    assert all(b"\xef\xbf\xbd" not in b for b in m.target_table.token_bytes)
    # word-initial space kept: "Ġthe" and "▁the" are both b" the"
    the_t, the_d = bpe.convert_tokens_to_ids("Ġthe"), sp.convert_tokens_to_ids("▁the")
    assert the_t != bpe.unk_token_id and the_d != sp.unk_token_id
    assert m.target_to_draft[the_t] == the_d
    assert m.byte_only_matches > 0


def test_duplicates_pick_one_id_deterministically(tiny_tokenizers, mappings):
    """Several ids with the same bytes: the real piece beats its byte fallback, else the lowest id."""
    sp = tiny_tokenizers["sp"]
    table = build_token_table(sp)
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(table.token_bytes):
        if b:
            by_bytes.setdefault(b, []).append(i)
    dups = {b: ids for b, ids in by_bytes.items() if len(ids) > 1}
    assert dups, "the SentencePiece fixture has byte-fallback duplicates (e.g. 'a' and <0x61>)"
    m = mappings[("bpe", "sp")]
    shared = set(m.draft_ids.tolist())
    checked = 0
    for b, ids in dups.items():
        pieces = [i for i in ids if i not in table.fallback_ids]
        expected = min(pieces) if pieces else min(ids)
        assert not (set(ids) - {expected}) & shared, f"{b!r}: matched {sorted(set(ids) & shared)}, want {expected}"
        checked += expected in shared
    assert checked > 0
    # a byte-fallback id sits below its piece in this fixture for some byte, so
    # "lowest id" alone would have picked the fallback piece
    assert any(min(ids) in table.fallback_ids for ids in dups.values())


def test_duplicates_lowest_id_among_equals():
    target = _word_level(["x", "ab", "cd"])
    draft = _word_level(["cd", "ab", "ab2", "x"])
    # make two drafter ids decode to "ab": a WordLevel vocab cannot, so use tables
    from dataclasses import replace

    d_table = build_token_table(draft)
    d_table = replace(d_table, token_bytes=(b"cd", b"ab", b"ab", b"x"))
    m = VocabMapping.from_tables(build_token_table(target), d_table, min_share=0.0)
    assert dict(zip(m.draft_ids.tolist(), m.target_ids.tolist())) == {0: 2, 1: 1, 3: 0}


def test_specials_match_only_by_role(tiny_tokenizers, mappings):
    bpe, sp = tiny_tokenizers["bpe"], tiny_tokenizers["sp"]
    m = mappings[("bpe", "sp")]
    assert m.target_to_draft[bpe.eos_token_id] == sp.eos_token_id
    assert m.target_to_draft[bpe.bos_token_id] == sp.bos_token_id
    assert m.target_to_draft[bpe.pad_token_id] == sp.pad_token_id
    im_start = bpe.convert_tokens_to_ids("<|im_start|>")
    assert m.target_to_draft[im_start] == -1
    # same string, different roles: never matched
    a = _word_level(["x", "<eos>", "y", "<bos>"], eos_token="<eos>", bos_token="<bos>")
    b = _word_level(["x", "<bos>", "y", "<eos>"], eos_token="<bos>", bos_token="<eos>")
    mm = VocabMapping.build(a, b, min_share=0.0)
    # by role: target eos (1, "<eos>") <-> drafter eos (1, "<bos>"); by text it would be 1 <-> 3
    assert mm.target_to_draft.tolist() == [0, 1, 2, 3]


def test_padded_vocab(tiny_tokenizers):
    bpe_model = tiny.build_model("bpe")
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(bpe_model)
    tok = tiny_tokenizers["bpe"]
    assert cfg.vocab_size > len(tok), "fixture must have a padded vocab"
    m = VocabMapping.build(tok, tiny_tokenizers["sp"], target_vocab_size=cfg.vocab_size)
    assert m.target_vocab_size == cfg.vocab_size
    assert m.target_to_draft[len(tok):].eq(-1).all()
    assert m.scatter_to_target(torch.full((2, m.size), 1.0 / m.size)).shape == (2, cfg.vocab_size)


def test_empty_or_tiny_intersection_is_a_clear_error(tiny_tokenizers):
    letters = _word_level(["a", "b", "c"])
    digits = _word_level(["1", "2", "3"])
    with pytest.raises(ValueError, match=r"share 0 tokens"):
        VocabMapping.build(letters, digits)
    with pytest.raises(ValueError, match=r"at least 90%"):
        VocabMapping.build(tiny_tokenizers["bpe"], tiny_tokenizers["sp"], min_share=0.9)


def test_distribution_pair_mapping_equals_its_construction():
    """The fixture records which drafter id it copied from which target id."""
    target_dir, draft_dir = tiny.build_distribution_pair()
    from pathlib import Path

    from transformers import AutoTokenizer

    truth = json.loads((Path(draft_dir) / "token_map.json").read_text())
    expected = {int(d): t for d, t in truth["draft_to_target"].items()}
    m = VocabMapping.build(AutoTokenizer.from_pretrained(target_dir), AutoTokenizer.from_pretrained(draft_dir),
                           target_vocab_size=256)
    got = dict(zip(m.draft_ids.tolist(), m.target_ids.tolist()))
    assert got == expected
