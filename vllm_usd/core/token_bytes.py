"""What each token id stands for, as bytes.

Two tokenizers agree on a token only when the token contributes the same bytes
to the decoded text. Token *strings* are useless for that: byte-level BPE
writes a space as ``Ġ`` and a newline as ``Ċ``, SentencePiece writes ``▁`` and
``<0x0A>``. This module reads each tokenizer's own decoder pipeline (from its
``tokenizer.json``) and replays it on every token, in the middle of a text,
so that the word-initial space of ``▁Hello`` / ``ĠHello`` is kept.

No vLLM import here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

# The four roles a special token can have in both tokenizers. Special tokens
# match across tokenizers only through a shared role, never through text.
ROLES: tuple[str, ...] = ("eos", "bos", "unk", "pad")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """The ByteLevel glyph -> byte table, checked against `tokenizers` itself.

    The table is the one that defines the ByteLevel alphabet (printable bytes
    map to themselves, the rest to code points from 256 up). We verify it
    against the library's own ByteLevel pre-tokenizer on every byte that can
    occur in valid UTF-8, and against its alphabet, so that a future change in
    `tokenizers` fails loudly instead of silently mismatching tokens.
    """
    from tokenizers import pre_tokenizers

    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    glyphs = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in glyphs:
            glyphs[b] = chr(256 + extra)
            extra += 1
    decoder = {g: b for b, g in glyphs.items()}

    if set(decoder) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError("tokenizers' ByteLevel alphabet differs from the expected one")
    probe = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    # Code points whose UTF-8 forms use every byte that valid UTF-8 can hold.
    points = [*range(1, 0x801), *(k * 0x1000 for k in range(1, 16))]
    points += [0x10000, 0x40000, 0x80000, 0xC0000, 0x100000]
    sample = "".join(chr(c) for c in points)
    (glyph_text, _), = probe.pre_tokenize_str(sample)
    if bytes(decoder[g] for g in glyph_text) != sample.encode("utf-8"):
        raise RuntimeError("tokenizers' ByteLevel mapping differs from the expected one")
    return decoder


def _flatten(node: dict[str, Any] | None) -> list[dict[str, Any]]:
    if node is None:
        return []
    if node.get("type") == "Sequence":
        out: list[dict[str, Any]] = []
        for child in node.get("decoders", node.get("pretokenizers", [])):
            out.extend(_flatten(child))
        return out
    return [node]


# One token while it passes through the decoder: a list of pieces, each still
# text (str) or already raw bytes.
_Pieces = list[str | bytes]


def _on_text(pieces: _Pieces, fn) -> _Pieces:
    return [fn(p) if isinstance(p, str) else p for p in pieces]


def _decode_step(step: dict[str, Any], pieces: _Pieces, fused: bool) -> _Pieces:
    kind = step.get("type")
    if kind == "ByteLevel":
        table = _byte_level_decoder()
        out: _Pieces = []
        for p in pieces:
            if isinstance(p, bytes):
                out.append(p)
            elif all(c in table for c in p):
                out.append(bytes(table[c] for c in p))
            else:  # not a byte-level glyph string (an added token): keep as text
                out.append(p)
        return out
    if kind == "Metaspace":
        repl = step.get("replacement", "▁")
        return _on_text(pieces, lambda s: s.replace(repl, " "))
    if kind == "Replace":
        pattern, content = step["pattern"], step["content"]
        if "String" in pattern:
            return _on_text(pieces, lambda s: s.replace(pattern["String"], content))
        regex = re.compile(pattern["Regex"])
        return _on_text(pieces, lambda s: regex.sub(content, s))
    if kind == "ByteFallback":
        out = []
        for p in pieces:
            m = _BYTE_FALLBACK.match(p) if isinstance(p, str) else None
            out.append(bytes([int(m.group(1), 16)]) if m else p)
        return out
    if kind == "Strip":
        if fused:  # after Fuse, Strip acts on the text's ends only, not mid-text
            return pieces
        start, stop, content = step.get("start", 0), step.get("stop", 0), step.get("content", " ")

        def strip(s: str) -> str:
            for _ in range(start):
                if s.startswith(content):
                    s = s[len(content):]
            for _ in range(stop):
                if s.endswith(content):
                    s = s[: -len(content)]
            return s

        return _on_text(pieces, strip)
    if kind == "WordPiece":
        prefix = step.get("prefix", "##")

        def wordpiece(s: str) -> str:
            return s[len(prefix):] if s.startswith(prefix) else " " + s

        return _on_text(pieces, wordpiece)
    if kind == "BPEDecoder":
        suffix = step.get("suffix", "</w>")
        return _on_text(pieces, lambda s: s[: -len(suffix)] + " " if s.endswith(suffix) else s)
    # Fuse joins tokens (no-op for one token); CTC and unknown steps: keep text.
    return pieces


@dataclass(frozen=True)
class TokenTable:
    """Per-id bytes and special-token roles of one tokenizer.

    ``token_bytes[i]`` is what id ``i`` adds to a decoded text mid-sequence;
    ``b""`` for special tokens and ids past the tokenizer (padded vocab).
    """

    name: str
    token_bytes: tuple[bytes, ...]
    special_ids: frozenset[int]
    fallback_ids: frozenset[int]  # byte-fallback pieces (<0xNN>) the decoder turned into raw bytes
    roles: dict[str, int]

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    def bytes_of(self, ids) -> bytes:
        table = self.token_bytes
        return b"".join(table[i] if 0 <= i < len(table) else b"" for i in ids)


def _backend(tokenizer):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(
            f"{type(tokenizer).__name__} has no fast (Rust) tokenizer; vllm-usd needs "
            "a tokenizer with a tokenizer.json (load it with use_fast=True)."
        )
    return backend


def _component_spec(component) -> dict[str, Any] | None:
    """The JSON of one tokenizer component (decoder, pre-tokenizer), without
    serialising the whole tokenizer (12 MB for a 262k vocabulary)."""
    if component is None:
        return None
    return json.loads(component.__getstate__())


def tokenizer_name(tokenizer) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def build_token_table(tokenizer, vocab_size: int | None = None) -> TokenTable:
    """Replay ``tokenizer``'s decoder on every id, ``vocab_size`` ids in all."""
    backend = _backend(tokenizer)
    steps = _flatten(_component_spec(backend.decoder))
    if not steps:  # no decoder: fall back to the pre-tokenizer's convention
        steps = [s for s in _flatten(_component_spec(backend.pre_tokenizer))
                 if s.get("type") in ("ByteLevel", "Metaspace")]
    n_tok = backend.get_vocab_size(with_added_tokens=True)
    n = n_tok if vocab_size is None else vocab_size

    special: set[int] = set()
    for tid, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", True):
            special.add(int(tid))
    roles: dict[str, int] = {}
    for role in ROLES:
        tid = getattr(tokenizer, f"{role}_token_id", None)
        if isinstance(tid, int) and 0 <= tid < n:
            roles[role] = tid
            special.add(tid)
    special.update(int(t) for t in getattr(tokenizer, "all_special_ids", []) if t is not None)

    out: list[bytes] = []
    fallback: set[int] = set()
    for i in range(n):
        tok = backend.id_to_token(i) if i < n_tok else None
        if tok is None or i in special:
            out.append(b"")
            continue
        pieces: _Pieces = [tok]
        fused = False
        for step in steps:
            before = pieces
            pieces = _decode_step(step, pieces, fused)
            if step.get("type") == "ByteFallback" and pieces != before:
                fallback.add(i)
            fused = fused or step.get("type") == "Fuse"
        out.append(b"".join(p.encode("utf-8") if isinstance(p, str) else p for p in pieces))

    return TokenTable(
        name=tokenizer_name(tokenizer),
        token_bytes=tuple(out),
        special_ids=frozenset(i for i in special if i < n),
        fallback_ids=frozenset(fallback),
        roles=roles,
    )
