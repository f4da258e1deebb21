"""String-level drafting (SLEM, Timor et al., ICML 2025): draft text, not shared tokens.

The drafter drafts greedily in its whole vocabulary, batched across requests. After each drafter token,
each request's drafted bytes are re-encoded by the target tokenizer over a short window
(``TargetRetokenizer``); a request stops drafting once its text determines its length of target tokens,
when the re-encoding would rewrite committed tokens, at a special token, or at the drafter-token budget.
Each forward's drafted ids are read back once (their bytes are needed); the next forward takes them where
they are, as TLI's does, so it replays the same captured decode step. The drafts carry no q: vLLM verifies
them as point masses, which is exact for greedy requests and lossless (if less accepting) for sampled ones.
"""

from __future__ import annotations

from collections import defaultdict
from typing import MutableMapping

import torch

from vllm_usd.core.device import to_device
from vllm_usd.core.mapping import VocabMapping
from vllm_usd.core.retokenize import TargetRetokenizer
from vllm_usd.core.translate import complete_utf8_prefix
from vllm_usd.drafter.base import DrafterRuntime
from vllm_usd.drafting.requests import DraftRows
from vllm_usd.drafting.timing import PhaseTimer


def default_budget(k: int) -> int:
    """Drafter tokens per request and step when usd.string_draft_tokens is null: k target tokens,
    one more held back, and room for a drafter that cuts text finer than the target."""
    return 2 * k + 1


class _RowText:
    """One request's draft in progress: its drafted bytes, and what they determine so far."""

    __slots__ = ("window", "pending", "text", "proposed", "length")

    def __init__(self, window: list[int], pending: bytes, length: int) -> None:
        self.window = window
        self.pending = pending  # target bytes the drafter's context lacks (an incomplete character)
        self.text = bytearray()
        self.proposed: list[int] = []
        self.length = length

    def new_text(self) -> bytes | None:
        """The drafted bytes past the target's text; None while they disagree with its pending bytes."""
        n = min(len(self.text), len(self.pending))
        if bytes(self.text[:n]) != self.pending[:n]:
            return None
        return bytes(self.text[len(self.pending):])


class StringDrafting:
    """Drafts text with the drafter's full vocabulary and proposes the target tokens it determines."""

    def __init__(self, mapping: VocabMapping, retokenizer: TargetRetokenizer, runtime: DrafterRuntime, *,
                 budget: int, timer: PhaseTimer, counters: MutableMapping[str, int] | None = None) -> None:
        self.runtime = runtime
        self.retokenizer = retokenizer
        self.budget = max(int(budget), 1)
        self.timer = timer
        self.counters: MutableMapping[str, int] = counters if counters is not None else defaultdict(int)
        self._draft_bytes = mapping.draft_table.token_bytes
        self._draft_to_target: list[int] = mapping.draft_to_target.tolist()

    def draft(self, rows: DraftRows, lengths: list[int]) -> list[list[int]]:
        """Target ids for each row, at most ``lengths[i]`` (1..k) of them, possibly none."""
        texts = [_RowText(self.retokenizer.window(tail), state.translator.pending_bytes, n)
                 for tail, state, n in zip(rows.target_tails, rows.states, lengths)]
        context = [len(seq) for seq in rows.sequences]
        active = list(range(len(rows)))
        forwards = len(rows)  # drafter forwards, counted per row: the catch-up's last, then one per token
        with self.timer.phase("drafter_forward"):
            logits = self.runtime.catch_up(rows.req_ids, rows.sequences, rows.unchanged)  # [B, V_draft]
        for step in range(self.budget):
            picked = logits.argmax(-1)  # [len(active)] on the device
            tokens = picked.tolist()  # the drafted bytes are needed on the host: one copy per forward
            with self.timer.phase("retokenize"):
                kept = [i for i, (a, tok) in enumerate(zip(active, tokens)) if self._extend(texts[a], tok)]
            if not kept or step + 1 == self.budget:
                break
            go_on = [active[i] for i in kept]
            if len(kept) < len(active):
                picked = picked[to_device(kept, torch.long, picked.device)]
            with self.timer.phase("drafter_forward"):
                logits = self.runtime.forward_next([rows.req_ids[a] for a in go_on], [context[a] for a in go_on],
                                                   picked, host_ids=[tokens[i] for i in kept])
            forwards += len(go_on)
            for a in go_on:
                context[a] += 1
            active = go_on
        out = [t.proposed for t in texts]
        self.counters["string_rows"] += len(out)
        self.counters["string_row_forwards"] += forwards
        self.counters["string_proposed"] += sum(len(p) for p in out)
        return out

    def _extend(self, row: _RowText, token: int) -> bool:
        """Add one drafter token to the row's text; True while the row should keep drafting."""
        data = self._draft_bytes[token] if 0 <= token < len(self._draft_bytes) else b""
        final = not data  # a special token ends the text: whatever it determines is final
        row.text += data
        new = row.new_text()
        if new is None:
            self.counters["string_pending_mismatch"] += 1
            return False
        if not new and not final:
            return True  # still inside the target's pending bytes
        ids = self.retokenizer.continuation(row.window, new, final) if new else []
        if ids is None:
            self.counters["string_rewrites"] += 1
            row.proposed = []
            return False
        if final and complete_utf8_prefix(new) == len(new):
            special = self._draft_to_target[token] if 0 <= token < len(self._draft_to_target) else -1
            if special >= 0:  # a special both tokenizers give the same role (end of text, say)
                ids = ids + [special]
        row.proposed = ids[:row.length]
        return not final and len(ids) < row.length
