"""TargetRetokenizer: drafted text becomes the target tokens it determines. No vLLM.

The expected tokens come from the target tokenizer's own encoding of the whole
text (prompt and continuation together), never from the code under test.
"""

from __future__ import annotations

import pytest

from vllm_usd.core.retokenize import TargetRetokenizer
from vllm_usd.core.token_bytes import build_token_table
from vllm_usd.core.translate import complete_utf8_prefix

TEXTS = [
    "The keeper of the lighthouse walked down to the boat, and it was cold.",
    "def f(x):\n\tif x:\n\t\treturn {'k': [1, 2]}  # done\n",
    "café, naïve, façade: 東京 😀 ok",
    "  two  spaces\n\nand lines\r\n",
]


@pytest.fixture(scope="module", params=["bpe", "sp"])
def target(request, tiny_tokenizers):
    tok = tiny_tokenizers[request.param]
    table = build_token_table(tok)
    return tok, table, TargetRetokenizer(tok, table)


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("text", TEXTS)
def test_final_text_gives_the_tokenizers_own_tokens(target, text):
    """At every cut of a canonical encoding, the rest of the text re-encodes to the rest of the ids."""
    tok, table, rt = target
    ids = _encode(tok, text)
    for cut in range(1, len(ids)):
        got = rt.continuation(rt.window(ids[:cut]), table.bytes_of(ids[cut:]), final=True)
        assert got == ids[cut:], (cut, got, ids[cut:])


@pytest.mark.parametrize("text", TEXTS)
def test_unfinished_text_holds_back_its_last_token(target, text):
    """Without the end of the text, at least the last token is held back, and what is proposed
    is almost always what the whole text encodes to (more text can rarely re-merge earlier tokens)."""
    tok, table, rt = target
    ids = _encode(tok, text)
    checked = agree = 0
    for cut in range(1, len(ids) - 1):
        window = rt.window(ids[:cut])
        rest = table.bytes_of(ids[cut:])
        for n in range(1, len(rest)):
            got = rt.continuation(window, rest[:n], final=False)
            if got is None:
                continue
            full = rt.continuation(window, rest[:n], final=True)
            complete = complete_utf8_prefix(rest[:n]) == n
            assert full is not None and got == (full[:-1] if complete else full), (got, full)
            checked += 1
            agree += got == ids[cut:cut + len(got)]
    assert checked > 50
    assert agree / checked > 0.9, (agree, checked)


def test_incomplete_utf8_waits_for_its_character(target):
    tok, table, rt = target
    head = _encode(tok, "ok")
    char = "東".encode()
    whole = _encode(tok, "ok x東")
    assert whole[:len(head)] == head
    for cut in (1, 2):
        partial = rt.continuation(head, b" x" + char[:cut], final=True)
        assert partial == rt.continuation(head, b" x", final=False), "the partial character is not encoded"
        assert partial == whole[len(head):len(head) + len(partial)]
    assert rt.continuation(head, b" x" + char, final=True) == whole[len(head):]


def test_a_draft_that_would_rewrite_committed_tokens_proposes_nothing(target):
    """Committed tokens whose text merges with the draft's first bytes: the target tokenizer would
    have cut the text differently, so nothing follows them."""
    tok, table, rt = target
    found = 0
    for tid, data in enumerate(table.token_bytes):
        if len(data) < 3 or tid in table.special_ids:
            continue
        try:
            word = data.decode()
        except UnicodeDecodeError:
            continue
        head = _encode(tok, word[:-1])
        if _encode(tok, word) != [tid] or len(head) != 1:
            continue
        assert rt.continuation(head, word[-1].encode(), final=True) is None, (word, head)
        found += 1
        if found >= 20:
            break
    assert found >= 5, "the tokenizer has few merged words"


def test_the_window_stops_at_special_tokens(target):
    tok, table, rt = target
    eos = tok.eos_token_id
    ids = _encode(tok, "one two") + [eos] + _encode(tok, "three four")
    window = rt.window(ids)
    assert eos not in window and window == ids[ids.index(eos) + 1:]
    assert rt.window(ids[:ids.index(eos) + 1]) == []
    long = _encode(tok, " ".join(["word"] * 40))
    assert 1 <= len(rt.window(long)) <= 8
