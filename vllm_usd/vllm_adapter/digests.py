"""One SHA-256 per drafting step over what the step drafted, for tensor-parallel checks.

Under tensor parallelism every rank must draft the same ids with the same q;
comparing the ranks' digest lists shows it (``usd.debug_digests``).
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

MAX_DIGESTS = 1 << 17


class StepDigests:
    def __init__(self) -> None:
        self._digests: list[str] = []

    def record(self, rows: Sequence[int], req_ids: Sequence[str], target: list[list[int]],
               qs: Sequence[torch.Tensor] | None) -> None:
        """rows, request ids and drafted target ids of one step, and q in intersection order (None: greedy)."""
        h = hashlib.sha256()
        h.update(repr((list(rows), list(req_ids), target)).encode())
        for q in qs or ():  # [B, n]: the same bytes as the scattered q
            h.update(q.detach().to("cpu").contiguous().numpy().tobytes())
        if len(self._digests) < MAX_DIGESTS:
            self._digests.append(h.hexdigest())

    def __len__(self) -> int:
        return len(self._digests)

    def all(self) -> list[str]:
        return list(self._digests)
