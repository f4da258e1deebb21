"""Turn drafted text into the target tokens it fully determines (string-level drafting).

The drafter writes bytes in its own vocabulary. The target tokenizer then
re-encodes a short window of committed target tokens plus those bytes. The
tokens after the committed boundary are the draft, except the last one: more
text could still grow it, so it is held back unless the text is final (the
drafter ended it with a special token the target shares). If the re-encoding
would put a token across the committed boundary, or would not reproduce the
last committed token, the target tokenizer would rewrite what is committed:
nothing is proposed then.

Proposals need not be right to be safe: the target verifies every one.
What this module decides is only how many get accepted.
"""

from __future__ import annotations

from typing import Sequence

from vllm_usd.core.token_bytes import TokenTable
from vllm_usd.core.translate import FragmentEncoder, complete_utf8_prefix

#: committed target tokens re-encoded with the draft (the window is short: the work per step stays bounded)
WINDOW_TOKENS = 8
#: bytes that begin a new word or line in most tokenizers' pre-tokenization; a window starts at one if it can
_WORD_STARTS = (b" ", b"\n", b"\t")


class TargetRetokenizer:
    """Re-encodes drafted text with the target's tokenizer, mid-sequence."""

    def __init__(self, target_tokenizer, table: TokenTable, window_tokens: int = WINDOW_TOKENS) -> None:
        self._encoder = FragmentEncoder(target_tokenizer, table)
        self._bytes = table.token_bytes
        self._window = max(int(window_tokens), 1)

    def _bytes_of(self, tid: int) -> bytes:
        return self._bytes[tid] if 0 <= tid < len(self._bytes) else b""

    def window(self, committed_tail: Sequence[int]) -> list[int]:
        """The committed tokens to re-encode with a draft: the last few, after the last special token.

        ``committed_tail``: the request's last committed target ids (at least ``2 * window_tokens``
        of them where it has that many). The window starts where a word starts if one is near, so
        re-encoding it out of its left context reproduces it.
        """
        tail = list(committed_tail)
        start = len(tail)
        while start > 0 and self._bytes_of(tail[start - 1]):  # a special token (no bytes) is a hard boundary
            start -= 1
        tail = tail[start:]
        if len(tail) <= self._window:
            return tail
        for i in range(len(tail) - self._window, len(tail) - 1):
            if self._bytes_of(tail[i]).startswith(_WORD_STARTS):
                return tail[i:]
        return tail[-self._window:]

    def continuation(self, window: Sequence[int], text: bytes, final: bool) -> list[int] | None:
        """The target ids that ``text`` determines after ``window``; None when the committed ones would change.

        ``final``: nothing follows ``text`` (the drafter ended it), so its last token is kept.
        An incomplete UTF-8 character at the end of ``text`` waits for the rest of its bytes.
        """
        upto = complete_utf8_prefix(text)
        if upto < len(text):
            final = False
        committed = b"".join(self._bytes_of(t) for t in window)
        encoded = self._encoder.encode(committed + text[:upto])
        # the committed boundary must fall between two re-encoded tokens, after the last committed token
        consumed, i = 0, 0
        while i < len(encoded) and consumed < len(committed):
            consumed += len(self._bytes_of(encoded[i]))
            i += 1
        if consumed != len(committed) or (window and (i == 0 or encoded[i - 1] != window[-1])):
            return None
        new = list(encoded[i:])
        if new and b"".join(self._bytes_of(t) for t in new) != text[:upto]:
            return None  # the tokenizer normalised the text: its tokens do not spell the draft
        return new if final else new[:-1]
