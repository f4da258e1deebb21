"""The q tensor vLLM's rejection sampler reads: ``[num_rows, k, target_vocab]`` float32."""

from __future__ import annotations

import torch

from vllm_usd.core.device import to_device


class DraftProbsBuffer:
    """q for vLLM's rejection sampler: ``[max_rows, k, target_vocab]`` float32, allocated once.

    ``max_rows`` is vLLM's max_num_seqs, the most rows a step can have, so the
    buffer never grows. Only the intersection's columns are ever written, so the
    rest stay zero from allocation on: each step costs O(rows * k * n), not
    O(rows * k * V). A proposer whose drafts never carry a q (every request
    greedy, or string drafting only) allocates none.
    """

    def __init__(self, k: int, target_vocab_size: int, target_ids: torch.Tensor, device: torch.device | str = "cpu",
                 *, max_rows: int, needed: bool = True) -> None:
        self.k = k
        self.vocab = target_vocab_size
        self.max_rows = max_rows
        self.needed = needed
        self.device = torch.device(device)
        self._cols = target_ids.to(self.device).unsqueeze(0)  # [1, n]
        self._buf: torch.Tensor | None = None

    @property
    def planned_bytes(self) -> int:
        return self.max_rows * self.k * self.vocab * 4 if self.needed else 0

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel() * self._buf.element_size()

    def allocate(self) -> None:
        """All of it, now (the proposer's ``load_model``); the first ``fill`` does it if nobody did."""
        if self._buf is None and self.needed:
            self._buf = torch.zeros(self.max_rows, self.k, self.vocab, dtype=torch.float32, device=self.device)

    def fill(self, rows: list[int], qs: list[torch.Tensor], num_rows: int) -> torch.Tensor:
        """rows[b] is the batch row of q[b]; qs[j] is [B_j, n] for draft position j, its rows ``rows[:B_j]``.

        Positions past a row's length keep whatever they held: vLLM reads q[row, :num_drafts] only.
        """
        if num_rows > self.max_rows or not self.needed:
            raise ValueError(f"q for {num_rows} rows: the buffer holds {self.max_rows if self.needed else 0}")
        self.allocate()
        buf = self._buf
        cols = self._cols[0]
        first = rows[0]
        if rows == list(range(first, first + len(rows))):  # the usual case: contiguous rows
            for j, q in enumerate(qs):
                buf[first:first + q.shape[0], j].index_copy_(1, cols, q)
        else:
            row_idx = to_device(rows, torch.long, buf.device).unsqueeze(-1)  # [B, 1]
            for j, q in enumerate(qs):
                buf[:, j].index_put_((row_idx[:q.shape[0]], self._cols), q)
        return buf[:num_rows]
