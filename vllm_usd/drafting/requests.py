"""Per-request drafting state: the drafter-side context of every request being drafted for.

Keyed by the engine's request id, never by batch row (rows move as requests
finish). The drafter's KV for a request lives in the ``DrafterRuntime`` and is
created and freed together with the state here.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

import numpy as np

from vllm_usd.core.pair import DraftPair
from vllm_usd.core.seeding import mix_seed, text_key
from vllm_usd.core.translate import ContextTranslator
from vllm_usd.drafter.base import DrafterRuntime

SAMPLING_EPS = 1e-5  # vLLM treats a temperature below this as greedy
TAIL_TOKENS = 16  # committed target ids each row carries for string drafting's re-encoding window


@dataclass(frozen=True)
class RequestSampling:
    """How a request samples, and where it ends (read from the engine's request once)."""

    temperature: float = 0.0
    top_k: int = 0  # <= 0: off
    top_p: float = 1.0
    seed: int | None = None
    last_token: int = sys.maxsize  # target tokens (prompt included) at which max_tokens is reached
    prompt_tokens: int = 0  # 0: not known


@dataclass
class RequestState:
    translator: ContextTranslator
    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    key: int  # stable per request and the same on every rank: drafting seeds derive from it
    seeded: bool  # the request has its own seed
    last_token: int
    committed: int = 0  # target tokens already given to the translator (it lags while the request drafts nothing)


@dataclass
class DraftRows:
    """The requests drafted for in one step, in batch order."""

    rows: list[int] = field(default_factory=list)  # batch row of each drafted request
    req_ids: list[str] = field(default_factory=list)
    states: list[RequestState] = field(default_factory=list)
    sequences: list[list[int]] = field(default_factory=list)  # drafter context, read-only this step
    unchanged: list[int] = field(default_factory=list)  # leading tokens known to match the drafter's cache
    positions: list[int] = field(default_factory=list)  # target position of the first draft
    target_tails: list[list[int]] = field(default_factory=list)  # the last committed target ids (string drafting)

    def __len__(self) -> int:
        return len(self.rows)

    def subset(self, indices: Sequence[int]) -> "DraftRows":
        """These rows only, in the order of ``indices``."""
        return DraftRows(*([column[i] for i in indices] for column in (
            self.rows, self.req_ids, self.states, self.sequences, self.unchanged, self.positions,
            self.target_tails)))

    def longest_first(self, lengths: list[int]) -> tuple["DraftRows", list[int]]:
        """These rows and their lengths, sorted by length, longest first (stable)."""
        order = sorted(range(len(self)), key=lambda i: -lengths[i])
        if order == list(range(len(self))):
            return self, lengths
        return self.subset(order), [lengths[i] for i in order]


class RequestTable:
    """The drafting state of every live request, and the rules for which get drafts this step."""

    def __init__(self, pair: DraftPair, runtime: DrafterRuntime, *, k: int, always_greedy: bool, seed: int,
                 drafts_text: Callable[[float], bool] | None = None, waits_after_prefill: bool = False) -> None:
        """``drafts_text(temperature)``: the request drafts text (string-level), so its drafter context is
        its text as the drafter's tokenizer cuts it (``ContextTranslator`` ``by_text``). ``waits_after_prefill``
        (adaptive_length): a request drafts from the step after its prefill ended (``catch_up_outlook``)."""
        self._waits_after_prefill = waits_after_prefill
        self._pair = pair
        self._drafts_text = drafts_text
        self._runtime = runtime
        self._k = k
        self._always_greedy = always_greedy
        self._seed = seed
        self._states: dict[str, RequestState] = {}
        self._undraftable: set[str] = set()  # past the drafter's context: no drafts for the rest of it
        self.counters: dict[str, int] = defaultdict(int)

    def __len__(self) -> int:
        return len(self._states)

    def get(self, req_id: str) -> RequestState | None:
        return self._states.get(req_id)

    # -- lifecycle -------------------------------------------------------------------------
    def free(self, req_id: str) -> None:
        """Drop the request's drafting state and drafter KV (it may come back later)."""
        self._states.pop(req_id, None)
        self._runtime.free(req_id)

    def forget(self, req_id: str) -> None:
        """The engine no longer holds the request (finished, aborted or preempted)."""
        self.free(req_id)
        self._undraftable.discard(req_id)

    def keep_only(self, live: Collection[str]) -> None:
        """Forget every request the engine no longer holds (``live``: a set or mapping). Checked one by
        one every step: a finish can pass unseen (vLLM calls no propose in a step without scheduled
        tokens), and a new request taking the finished one's place leaves the counts equal."""
        for req_id in [r for r in (*self._states, *self._undraftable) if r not in live]:
            self.forget(req_id)

    def _new_state(self, req_id: str, sampling: RequestSampling) -> RequestState | None:
        if not self._runtime.add(req_id):
            self.counters["skipped_no_memory"] += 1
            return None
        seed = sampling.seed
        # Never a global or rank-local RNG: every rank must draw the same drafts and q.
        key = mix_seed(int(seed), self._seed) if seed is not None else text_key(req_id)
        state = RequestState(
            translator=self._pair.translator(
                by_text=self._drafts_text is not None and self._drafts_text(sampling.temperature)),
            greedy=sampling.temperature < SAMPLING_EPS or self._always_greedy,
            temperature=sampling.temperature, top_k=max(sampling.top_k, 0), top_p=sampling.top_p,
            key=key, seeded=seed is not None, last_token=sampling.last_token,
        )
        self._states[req_id] = state
        return state

    # -- one step ---------------------------------------------------------------------------
    def sync(self, req_id: str, num_tokens: int, history: np.ndarray,
             sampling: Callable[[], RequestSampling]) -> tuple[RequestState, list[int], int] | None:
        """Bring the request's drafter context up to its ``num_tokens`` committed target tokens.

        ``history`` holds the request's target ids (at least ``num_tokens`` of them);
        ``sampling`` is called only for a request seen for the first time.
        Returns (state, drafter sequence, leading tokens unchanged since the last step),
        or None when the request gets no draft this step.
        """
        if req_id in self._undraftable:
            return None
        state = self._states.get(req_id)
        if state is None:
            first = sampling()
            if self._waits_after_prefill and num_tokens == first.prompt_tokens + 1:
                return None  # its prefill just ended: see ``catch_up_outlook``
            state = self._new_state(req_id, first)
        if state is None:
            return None
        if num_tokens >= state.last_token:  # max_tokens reached: the request ends with this step
            self.free(req_id)
            return None
        if num_tokens < state.committed:  # history shrank: rebuild from scratch
            self.free(req_id)
            state = self._new_state(req_id, sampling())
            if state is None:
                return None
        new_ids = history[state.committed:num_tokens].tolist()
        if state.committed == 0:
            state.translator.start(new_ids)
            known = 0
        else:
            _, appended = state.translator.feed(new_ids)
            known = len(state.translator.draft_ids) - len(appended)
        state.committed = num_tokens
        seq = state.translator.draft_ids
        if not seq:
            return None
        if len(seq) + self._k > self._runtime.max_len:
            self.counters["skipped_context_full"] += 1
            self.free(req_id)
            self._undraftable.add(req_id)
            return None
        if not self._runtime.reserve(req_id, len(seq) + self._k):  # the KV pool is full: this request waits
            self.counters["skipped_no_memory"] += 1
            self.free(req_id)  # its blocks go back; its context is rebuilt when it drafts again
            return None
        return state, seq, known

    def catch_up_outlook(self, req_ids: list[str], sampled_token_ids: list[list[int]], num_tokens: np.ndarray,
                         sampling: Callable[[str], RequestSampling]) -> tuple[int, float]:
        """(target tokens the decoding rows' drafter contexts lack beyond the k + 1 a drafted step feeds anyway,
        a new request's whole context; the tokens those rows have left, on average, as far as max_tokens says).
        A row whose prefill just ended is left out: it drafts from its next step, once its batch is known
        (requests sent together reach the engine one by one: the first would catch up alone)."""
        missed, left, rows = 0, 0, 0
        for i, sampled in enumerate(sampled_token_ids):
            if sampled and req_ids[i] not in self._undraftable:
                state, n = self._states.get(req_ids[i]), int(num_tokens[i])
                first = state or sampling(req_ids[i])
                if state is None and self._waits_after_prefill and n == first.prompt_tokens + 1:
                    continue
                missed += max(n - (state.committed if state else 0) - (self._k + 1), 0)
                left += max(first.last_token - n, 0)
                rows += 1
        return missed, left / rows if rows else 0.0

    def collect(self, req_ids: list[str], sampled_token_ids: list[list[int]], num_tokens: np.ndarray,
                token_ids: np.ndarray, sampling: Callable[[str], RequestSampling],
                length: int) -> tuple[DraftRows, list[int]]:
        """The rows that get ``length`` (1..k) drafts this step, their contexts brought up to date,
        and their lengths. A request left out of a step (the step's length 0) is left as it is: its
        context catches up, in one feed, the next time it drafts (the drafter's cache is compared
        from the first token that may differ, so nothing else needs keeping)."""
        out, lengths = DraftRows(), []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                continue  # a prefill chunk in progress: no draft this step
            req_id = req_ids[i]
            n = int(num_tokens[i])
            synced = self.sync(req_id, n, token_ids[i], lambda: sampling(req_id))
            if synced is None:
                continue
            state, seq, known = synced
            lengths.append(length)
            out.rows.append(i)
            out.req_ids.append(req_id)
            out.states.append(state)
            out.sequences.append(seq)
            out.unchanged.append(known)
            out.positions.append(n)
            out.target_tails.append(token_ids[i][max(n - TAIL_TOKENS, 0):n].tolist())
        return out, lengths
