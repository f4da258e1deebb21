"""Captured steps of the transformers drafter, one per (new tokens per row, batch bucket, table width).

A CUDA graph replays fixed kernels on fixed buffers, so the captured step has
fixed shapes: the rows padded up to the bucket, each row's new tokens padded to
the step's count (1 for a draft position; k + 1 for the catch-up after
verification: the accepted drafts and the bonus token), and block tables padded
to a fixed width (a power of two of blocks), with the causal mask hiding what
is past each row's position. Padding rows and padding tokens write to the
scratch block (``last``: each row's last real token), so what they write and
read is nobody's. The KV pool is allocated once and never moves, so a capture
stays valid for the runtime's life.

Every graph is captured at start-up (``capture_all``, from the runtime's
``allocate``, before vLLM sizes its KV cache), for each token count, batch
bucket and table width in a fixed set (powers of two up to a row's most
blocks), on inputs that touch only the scratch block; serving only replays, and
a shape without a graph runs eagerly (a prompt's catch-up, say).

Lossless whatever the captured logits are: q is built from the logits the
drafts were sampled from. Every tensor-parallel rank sees the same batch sizes
and lengths, so every rank picks the same bucket and the same path.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger("vllm.usd")

#: batch buckets, as vLLM captures its own decode graphs: small ones dense, then every 8
BUCKETS: tuple[int, ...] = (1, 2, 4, 8) + tuple(range(16, 257, 8))

# (step, static inputs, graph memory pool) -> (replay, static output)
Capture = Callable[[Callable[..., torch.Tensor], tuple[torch.Tensor, ...], object],
                   tuple[Callable[[], None], torch.Tensor]]


def capture_cuda_graph(step: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
                       pool: object) -> tuple[Callable[[], None], torch.Tensor]:
    """Warm the step up on a side stream, then capture it into one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # lazy initialisation (cuBLAS handles, workspaces) stays out of the graph
            step(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: only this thread is barred from unsafe calls while it captures, so other threads of the
    # worker keep working
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = step(*inputs)
    return graph.replay, out


def widths(max_blocks: int) -> tuple[int, ...]:
    """The table widths graphs are captured at: powers of two, and ``max_blocks`` (a row's most blocks)."""
    return tuple(sorted({min(1 << i, max_blocks) for i in range(max(max_blocks - 1, 0).bit_length() + 1)}))


class DecodeGraphs:
    """Fixed-shape steps, captured at start-up for every ``(tokens, bucket, width)`` and only replayed after."""

    def __init__(self, step: Callable[..., torch.Tensor], device: torch.device, *, max_rows: int, max_blocks: int,
                 token_counts: tuple[int, ...] = (1,), capture: Capture = capture_cuda_graph,
                 agree: Callable[[bool], bool] = lambda failed: failed) -> None:
        """``token_counts``: the new tokens per row captured (1: a draft position; k + 1: the catch-up after
        verification). ``agree(failed)``: whether capturing failed on any tensor-parallel rank (every rank
        must run the same path: a rank that ran eagerly would compute other logits, and so other q)."""
        # step(tokens [R, T], pos [R, T], table [R, NB], last [R]) -> [R, V] float32
        self._step = step
        self.token_counts = tuple(sorted(set(token_counts)))
        self._device = device
        self._capture = capture
        self._agree = agree
        # past the largest bucket the step runs eagerly
        self.buckets = tuple(b for b in BUCKETS if b < max_rows) + ((max_rows,) if max_rows <= BUCKETS[-1] else ())
        self.widths = widths(max_blocks)
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self._captured: dict[tuple[int, int, int],
                             tuple[Callable[[], None], torch.Tensor, tuple[torch.Tensor, ...]]] = {}
        self.failed = False
        self.failure: BaseException | None = None  # why capture failed (counted by the proposer)
        self.nbytes = 0  # device memory the captures took (graph pool and outputs), where it can be read

    @property
    def captures(self) -> int:
        return len(self._captured)

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket that holds ``rows`` slot rows; None past the largest."""
        for b in self.buckets:
            if b >= rows:
                return b
        return None

    def tokens_for(self, t: int) -> int | None:
        """The smallest captured token count that holds ``t`` new tokens per row; None past the largest."""
        return next((n for n in self.token_counts if n >= t), None)

    def capture_all(self, num_outputs: int) -> None:
        """Capture every (tokens, bucket, width), at start-up, on inputs that write and read only the scratch
        block (block 0). Each bucket's graphs write their logits into one [bucket, num_outputs] buffer, so
        that they share it. A failure anywhere (any rank) leaves every step eager."""
        before = torch.cuda.memory_reserved(self._device) if self._device.type == "cuda" else 0
        failure = None
        for bucket in self.buckets:
            out = torch.empty(bucket, num_outputs, dtype=torch.float32, device=self._device)
            try:
                for tokens in self.token_counts:
                    for width in self.widths:
                        self._capture_shape(tokens, bucket, width, out)
            except Exception as exc:  # noqa: BLE001 - a drafter that cannot be captured still drafts, eagerly
                failure = exc
                break
        if self._agree(failure is not None):
            self._give_up(failure or RuntimeError("capturing the drafter's decode step failed on another rank"))
        elif self._device.type == "cuda":
            self.nbytes = torch.cuda.memory_reserved(self._device) - before

    def run(self, bucket: int, width: int, tokens: torch.Tensor, pos: torch.Tensor, table: torch.Tensor,
            last: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits ([bucket, V], rows past ``tokens``' padding; valid until the next call), or None where no
        graph was captured for this shape (the caller then runs the eager step).

        tokens, pos: [R, T] new tokens per row (T a captured count, padded past each row's ``last``) and
        their positions; table: [R, w <= width]; last: [R] each row's last real token (None: T - 1); on the
        device. They are written into the graph's own inputs in place: nothing is allocated on the device.
        """
        rows, t = tokens.shape
        entry = self._captured.get((t, bucket, width))
        if entry is None:
            return None
        replay, out, (st_tokens, st_pos, st_table, st_last, _) = entry
        st_tokens[:rows].copy_(tokens)
        st_pos[:rows].copy_(pos)
        st_pos[rows:].zero_()  # padding rows: position 0 on the scratch block, read by nobody
        st_table.zero_()  # SCRATCH (block 0) past each row's blocks
        st_table[:rows, :table.shape[1]].copy_(table)
        if last is None:
            st_last.fill_(t - 1)
        else:
            st_last[:rows].copy_(last)
            st_last[rows:].fill_(t - 1)
        replay()
        return out

    def _capture_shape(self, t: int, bucket: int, width: int, out: torch.Tensor) -> None:
        # every tensor the step reads is a static input, kept with the entry: a graph holds no reference to
        # what it read, so a tensor only the step's closure knew would be freed and its memory reused
        dev = self._device
        static = (torch.zeros(bucket, t, dtype=torch.long, device=dev), torch.zeros(bucket, t, dtype=torch.long, device=dev),
                  torch.zeros(bucket, width, dtype=torch.long, device=dev),  # every row on the scratch block
                  torch.full((bucket,), t - 1, dtype=torch.long, device=dev), out)
        step = self._step

        def into_out(tokens, pos, table, last, out):  # the step's logits land in the bucket's buffer
            return out.copy_(step(tokens, pos, table, last))

        replay, result = self._capture(into_out, static, self._pool)
        self._captured[(t, bucket, width)] = (replay, result, static)

    def _give_up(self, exc: BaseException) -> None:
        self.failed = True
        self.failure = exc
        self._captured.clear()
        logger.warning("vllm-usd: capturing the drafter's decode step failed (%s: %s); it runs eagerly. Start vLLM "
                       "with enforce_eager=True to skip the attempt.", type(exc).__name__, exc)
