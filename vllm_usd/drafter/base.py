"""The interface the proposer drafts through."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch


Points = tuple[tuple[int, float], ...]  # (size, seconds) timings


class DrafterRuntime(ABC):
    """A drafter model with a KV cache per request.

    Requests are keyed by vLLM's req_id. For each request the runtime keeps
    the drafter tokens whose KV it holds; ``forward`` rolls that back to a
    given length, appends new tokens and returns the logits after the last one.
    """

    #: logits columns that ``forward`` returns (the intersection after
    #: ``set_output_rows``, otherwise the drafter's full vocabulary).
    num_outputs: int
    #: the longest drafter sequence a request may reach.
    max_len: int
    #: where ``forward`` returns its logits (the drafter's weights and KV live there too).
    device: torch.device = torch.device("cpu")

    @abstractmethod
    def set_output_rows(self, rows: torch.Tensor) -> None:
        """Return logits only for these drafter ids ([n], ascending) from now on."""

    def add(self, req_id: str) -> bool:
        """Make room for a request. False when the memory budget is full."""
        if req_id in self._tokens:
            return True
        if not self._claim(req_id):
            return False
        self._tokens[req_id] = []
        return True

    def free(self, req_id: str) -> None:
        """Forget a request and release its KV (no-op if unknown)."""
        if self._tokens.pop(req_id, None) is not None:
            self._release(req_id)

    @abstractmethod
    def _claim(self, req_id: str) -> bool:
        """Take a new request; False when the runtime holds as many as it may."""

    def reserve(self, req_id: str, length: int) -> bool:
        """KV room for ``length`` tokens of a request it holds; False (and nothing taken) when there is none.
        A runtime whose requests each get their whole room up front has nothing to do."""
        return True

    def allocate(self) -> None:
        """Allocate the KV cache now, once (the proposer's ``load_model``, before vLLM sizes its own).
        A runtime that allocated it on construction has nothing to do."""

    @property
    def planned_kv_bytes(self) -> int:
        """What the KV cache holds once allocated."""
        return self.kv_bytes

    @abstractmethod
    def _release(self, req_id: str) -> None:
        """Give a forgotten request's KV room back."""

    #: per request, the drafter tokens whose KV is held (kept by ``add``, ``free`` and ``forward``)
    _tokens: dict[str, list[int]]

    def has(self, req_id: str) -> bool:
        return req_id in self._tokens

    @property
    def num_requests(self) -> int:
        return len(self._tokens)

    @property
    @abstractmethod
    def kv_bytes(self) -> int:
        """Memory held for the drafter's KV cache."""

    @property
    @abstractmethod
    def param_bytes(self) -> int:
        """The drafter's weights in memory (a full copy on every tensor-parallel rank)."""

    def cached_tokens(self, req_id: str) -> list[int]:
        """The drafter tokens whose KV is held for ``req_id``."""
        return self._tokens[req_id]

    @abstractmethod
    def forward(
        self,
        req_ids: Sequence[str],
        keep: Sequence[int],
        new_tokens: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """For each request: keep its first ``keep[i]`` cached tokens, append
        ``new_tokens[i]`` (non-empty), and return the logits after the last
        one. Returns [len(req_ids), num_outputs] float32, valid until the next forward (a
        captured step returns its own output buffer).
        """

    def forward_next(
        self,
        req_ids: Sequence[str],
        keep: Sequence[int],
        tokens: torch.Tensor,  # [len(req_ids)] one new drafter id per request, on ``self.device``
        host_ids: Sequence[int] | None = None,  # the same ids, where the caller has them on the host
    ) -> torch.Tensor:
        """``forward`` with one new token per request, handed over where it was sampled.

        A runtime on an accelerator reads ``tokens`` in place, so a draft loop makes no host copy
        per position; it learns those ids later from ``settle_from_host``, or else copies them in
        one go when next asked for its tokens. This default copies them to the host first (right
        for a runtime that runs on the host anyway).
        """
        ids = host_ids if host_ids is not None else tokens.tolist()
        return self.forward(req_ids, keep, [[t] for t in ids])

    def one_at_a_time_where_faster(self, steps: Points, prompts: Points) -> tuple[Points, Points]:
        """Given the start-up timings (``drafting.drafter_timing``: one-token forwards at batch sizes, a new
        request's first forward at prompt lengths), run forwards of a few tokens one token at a time from now
        on, where the runtime can and that is faster; returns both timings as forwards then cost. This default
        batches every forward: the timings stand."""
        return tuple(steps), tuple(prompts)

    def settle_from_host(self, ids: Sequence[int]) -> None:
        """The ids ``forward_next`` was given since the last call, in call order, from the caller's host copy."""

    def catch_up(
        self,
        req_ids: Sequence[str],
        wanted: Sequence[Sequence[int]],
        unchanged: Sequence[int],
    ) -> torch.Tensor:
        """Bring each request's cache to the sequence ``wanted[i]`` and return the
        logits after its last token. ``unchanged[i]`` tokens at the front are known
        to match what is cached; the rest is compared, so accepted drafts keep their
        KV and only what differs is run again (at least the last token).
        """
        keep: list[int] = []
        new: list[list[int]] = []
        for req_id, seq, known in zip(req_ids, wanted, unchanged):
            cached = self.cached_tokens(req_id)
            same = min(known, len(cached))
            limit = min(len(cached), len(seq))
            while same < limit and cached[same] == seq[same]:
                same += 1
            same = min(same, len(seq) - 1)
            keep.append(same)
            new.append(list(seq[same:]))
        return self.forward(req_ids, keep, new)
