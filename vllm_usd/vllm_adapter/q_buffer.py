"""The q tensor vLLM's rejection sampler reads: ``[num_rows, k, target_vocab]`` float32."""

from __future__ import annotations

import torch


class DraftProbsBuffer:
    """q for vLLM's rejection sampler: ``[num_rows, k, target_vocab]`` float32, reused.

    Only the intersection's columns are ever written, so the rest stay zero
    from allocation on: each step costs O(rows * k * n), not O(rows * k * V).
    """

    def __init__(self, k: int, target_vocab_size: int, target_ids: torch.Tensor,
                 device: torch.device | str = "cpu") -> None:
        self.k = k
        self.vocab = target_vocab_size
        self.device = torch.device(device)
        self._cols = target_ids.to(self.device).unsqueeze(0)  # [1, n]
        self._buf: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel() * self._buf.element_size()

    def fill(self, rows: list[int], qs: list[torch.Tensor], num_rows: int) -> torch.Tensor:
        """rows[b] is the batch row of q[b]; qs[j] is [B_j, n] for draft position j, its rows ``rows[:B_j]``.

        Positions past a row's length keep whatever they held: vLLM reads q[row, :num_drafts] only.
        """
        buf = self._buf
        if buf is None or buf.shape[0] < num_rows:
            cap = max(num_rows, 2 * (buf.shape[0] if buf is not None else 4))
            buf = torch.zeros(cap, self.k, self.vocab, dtype=torch.float32, device=self.device)
            self._buf = buf
        cols = self._cols[0]
        first = rows[0]
        if rows == list(range(first, first + len(rows))):  # the usual case: contiguous rows
            for j, q in enumerate(qs):
                buf[first:first + q.shape[0], j].index_copy_(1, cols, q)
        else:
            row_idx = torch.tensor(rows, dtype=torch.long, device=buf.device).unsqueeze(-1)  # [B, 1]
            for j, q in enumerate(qs):
                buf[:, j].index_put_((row_idx[:q.shape[0]], self._cols), q)
        return buf[:num_rows]
