"""Keep the drafter's token sequence in step with the target's.

Shared target tokens reach the drafter through the 1:1 map. Runs of
non-shared target tokens are turned back into bytes and re-encoded with the
drafter's own tokenizer, over a bounded trailing window, so the drafter never
sees UNK and its text stays byte-identical to the target's.

With ``by_text`` every target token with bytes goes through the re-encoded
run, shared or not: the drafter reads the text cut as its own tokenizer cuts
it (what transformers' universal assisted generation gives its assistant).
String-level drafting uses it: a drafter that writes text continues its own
segmentation better (docs/performance.md, target 5).
"""

from __future__ import annotations

import json
from typing import Sequence

import torch

from vllm_usd.core.mapping import VocabMapping


def complete_utf8_prefix(data: bytes | bytearray) -> int:
    """Length of ``data`` without a trailing, still incomplete UTF-8 character."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b & 0xC0 != 0x80:  # a lead byte (or ASCII)
            need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 1
            return n if back >= need else n - back
    return n


class FragmentEncoder:
    """Encode a piece of text the way it reads in the middle of a sequence.

    A copy of the drafter's backend tokenizer with the start-of-text effects
    turned off: no post-processor (so no BOS), no prefix space added to the
    first word, and special-token text left as text.
    """

    def __init__(self, tokenizer, table) -> None:
        backend = getattr(tokenizer, "backend_tokenizer")
        spec = json.loads(backend.to_str())
        spec["post_processor"] = None
        spec["normalizer"] = _drop_prepend(spec.get("normalizer"))
        spec["pre_tokenizer"] = _no_prefix_space(spec.get("pre_tokenizer"))
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_str(json.dumps(spec))
        self._tok.no_truncation()
        self._tok.no_padding()
        try:
            self._tok.encode_special_tokens = True
        except AttributeError:  # older tokenizers
            pass
        self._table = table
        # drafter id of each single byte, where the drafter has one (byte-level
        # BPE glyphs, SentencePiece <0xNN>): lets incomplete UTF-8 pass through.
        self.byte_ids: dict[int, int] = {}
        for tid, b in enumerate(table.token_bytes):
            if len(b) == 1 and b[0] not in self.byte_ids:
                self.byte_ids[b[0]] = tid

    def encode(self, data: bytes) -> list[int]:
        """Drafter ids that stand for exactly ``data`` where the drafter has byte tokens: bytes that are not
        valid UTF-8 go through them, and so does a character the tokenizer does not give back byte for byte
        (a literal "▁" to a SentencePiece drafter, which reads it as its space mark; a normalised one)."""
        ids = self._encode(data)
        if not self.byte_ids or self._table.bytes_of(ids) == data:
            return ids
        exact: list[int] = []
        for ch in data.decode("utf-8", errors="surrogateescape"):
            raw = ch.encode("utf-8", errors="surrogateescape")
            piece = self._encode(raw)
            if self._table.bytes_of(piece) != raw and all(b in self.byte_ids for b in raw):
                piece = [self.byte_ids[b] for b in raw]
            exact.extend(piece)
        return exact

    def _encode(self, data: bytes) -> list[int]:
        """The tokenizer's ids for ``data``; bytes that are not valid UTF-8 go through byte tokens."""
        ids: list[int] = []
        text = data.decode("utf-8", errors="surrogateescape")
        chunk: list[str] = []

        def flush() -> None:
            if chunk:
                ids.extend(self._tok.encode("".join(chunk), add_special_tokens=False).ids)
                chunk.clear()

        for ch in text:
            if 0xDC80 <= ord(ch) <= 0xDCFF:  # a raw byte that is not UTF-8
                flush()
                tid = self.byte_ids.get(ord(ch) - 0xDC00)
                if tid is not None:
                    ids.append(tid)
            else:
                chunk.append(ch)
        flush()
        return ids


def _drop_prepend(node):
    if node is None:
        return None
    if node.get("type") == "Prepend":
        return None
    if node.get("type") == "Sequence":
        kept = [c for c in (_drop_prepend(c) for c in node["normalizers"]) if c is not None]
        return {**node, "normalizers": kept}
    return node


def _no_prefix_space(node):
    if node is None:
        return None
    kind = node.get("type")
    if kind == "Metaspace":
        node = {**node, "prepend_scheme": "never"}
        node.pop("add_prefix_space", None)
        return node
    if kind == "ByteLevel":
        return {**node, "add_prefix_space": False}
    if kind == "Sequence":
        return {**node, "pretokenizers": [_no_prefix_space(c) for c in node["pretokenizers"]]}
    return node


class ContextTranslator:
    """One request's drafter context, fed with the target's accepted tokens.

    ``feed`` returns ``(rollback, append)``: drop the last ``rollback`` drafter
    tokens, then append ``append``. Shared tokens cost one table lookup
    (with ``by_text``, only tokens without bytes do: specials shared by role).
    Non-shared tokens open a *run* of text that is re-encoded as a whole each
    time it grows (it may change the run's last drafter tokens); the run is
    closed by the next shared token, and trimmed to ``window`` bytes so the
    work per step stays bounded.
    """

    def __init__(
        self,
        mapping: VocabMapping,
        encoder: FragmentEncoder,
        draft_bos_id: int | None = None,
        window: int = 64,
        by_text: bool = False,
    ) -> None:
        self._t2d: list[int] = mapping.target_to_draft.tolist()
        self._t_bytes = mapping.target_table.token_bytes
        self._d_bytes = mapping.draft_table.token_bytes
        self._encoder = encoder
        self._bos = draft_bos_id
        self._window = window
        self._by_text = by_text
        self.draft_ids: list[int] = []
        self.num_target_tokens = 0
        self._run_start: int | None = None  # drafter index where the open run begins
        self._run = bytearray()  # the open run's bytes (encoded: all but an incomplete tail)

    # -- public -----------------------------------------------------------------
    def start(self, target_ids: Sequence[int]) -> list[int]:
        """Translate a whole prompt (or a resumed history); returns the drafter ids."""
        self.draft_ids = []
        self.num_target_tokens = 0
        self._run_start, self._run = None, bytearray()
        ids = list(target_ids)
        if self._bos is not None:
            if ids and self._t2d_at(ids[0]) == self._bos:
                ids = ids[1:]
                self.num_target_tokens += 1
            self.draft_ids.append(self._bos)
        elif ids and self._t2d_at(ids[0]) >= 0 and self._t_bytes_at(ids[0]) == b"":
            # target BOS mapped to a drafter special that the drafter would not add
            ids = ids[1:]
            self.num_target_tokens += 1
        self.feed(ids)
        return self.draft_ids

    def feed(self, target_ids: Sequence[int]) -> tuple[int, list[int]]:
        old_len = len(self.draft_ids)
        self._lowest = old_len
        dirty = False
        for tid in target_ids:
            self.num_target_tokens += 1
            did = self._t2d_at(tid)
            data = self._t_bytes_at(tid)
            if did >= 0 and not (self._by_text and data):
                if self._run_start is not None:
                    self._encode_run(final=True)
                self.draft_ids.append(did)
                continue
            if not data:  # a special token the drafter has no role for: invisible
                continue
            if self._run_start is None:
                self._run_start = len(self.draft_ids)
                self._run = bytearray()
            self._run += data
            dirty = True
        if dirty and self._run_start is not None:
            self._encode_run(final=False)
        lowest = min(self._lowest, old_len)
        return old_len - lowest, self.draft_ids[lowest:]

    @property
    def pending_bytes(self) -> bytes:
        """Target bytes not yet in the drafter's context (an incomplete character)."""
        if self._run_start is None:
            return b""
        encoded = sum(len(self._d_bytes[i]) for i in self.draft_ids[self._run_start:])
        return bytes(self._run[encoded:])

    # -- internals --------------------------------------------------------------
    def _t2d_at(self, tid: int) -> int:
        return self._t2d[tid] if 0 <= tid < len(self._t2d) else -1

    def _t_bytes_at(self, tid: int) -> bytes:
        return self._t_bytes[tid] if 0 <= tid < len(self._t_bytes) else b""

    def _encode_run(self, final: bool) -> None:
        start = self._run_start
        assert start is not None
        run = bytes(self._run)
        upto = len(run) if final else complete_utf8_prefix(run)
        new = self._encoder.encode(run[:upto])
        old = self.draft_ids[start:]
        common = 0
        for a, b in zip(old, new):
            if a != b:
                break
            common += 1
        self._lowest = min(self._lowest, start + common)
        self.draft_ids[start:] = new
        if final:
            self._run_start, self._run = None, bytearray()
        elif len(run) > self._window:
            self._trim_run(new, upto)

    def _trim_run(self, new: list[int], upto: int) -> None:
        """Freeze the run's head, keeping about half the window open."""
        keep_from = len(self._run) - self._window // 2
        consumed, j = 0, 0
        while j < len(new) and consumed + len(self._d_bytes[new[j]]) <= keep_from:
            consumed += len(self._d_bytes[new[j]])
            j += 1
        if j == 0:
            return
        if bytes(self._run[:consumed]) != b"".join(self._d_bytes[i] for i in new[:j]):
            # the drafter's tokenizer changed the text (a normalizer): close the run
            self._run_start, self._run = None, bytearray()
            return
        self._run_start = self._run_start + j  # type: ignore[operator]
        del self._run[:consumed]
