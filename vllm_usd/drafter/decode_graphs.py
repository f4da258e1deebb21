"""Captured one-token decode steps of the transformers drafter, one per (batch bucket, table width).

A CUDA graph replays fixed kernels on fixed buffers, so the captured step has
fixed shapes: the rows padded up to the bucket, and block tables padded to a
fixed width (a power of two of blocks), with the causal mask hiding what is
past each row's position. Padding rows point every entry at the scratch block,
so what they write and read is nobody's. The KV pool is allocated once and
never moves, so a capture stays valid for the runtime's life.

Capturing runs the step on the real inputs of the call that needs it: the
warm-up runs and the capture write the same KV the call would write, so
nothing is left that the call does not also produce.

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
    # thread_local: only this thread is barred from unsafe calls while it captures, so vLLM's own threads
    # (output copies, say) keep working; the capture happens mid-serving, not at start-up
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = step(*inputs)
    return graph.replay, out


class DecodeGraphs:
    """Fixed-shape decode steps, captured lazily per ``(bucket, width)`` and replayed after."""

    def __init__(self, step: Callable[..., torch.Tensor], device: torch.device, *, max_rows: int,
                 capture: Capture = capture_cuda_graph, agree: Callable[[bool], bool] = lambda failed: failed) -> None:
        """``agree(failed)``: whether a capture failed on any tensor-parallel rank (every rank captures the same
        shape at the same step and must go on alike: a rank that ran eagerly would compute other logits)."""
        # step(tokens [R, 1], pos [R, 1], table [R, NB], sel_rows [R], sel_cols [R]) -> [R, V] float32
        self._step = step
        self._device = device
        self._capture = capture
        self._agree = agree
        # past the largest bucket the step runs eagerly
        self.buckets = tuple(b for b in BUCKETS if b < max_rows) + ((max_rows,) if max_rows <= BUCKETS[-1] else ())
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self._captured: dict[tuple[int, int], tuple[Callable[[], None], torch.Tensor, tuple[torch.Tensor, ...]]] = {}
        self.failed = False
        self.captures = 0
        self.failure: BaseException | None = None  # why capture failed (counted by the proposer)

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket that holds ``rows`` slot rows; None past the largest."""
        for b in self.buckets:
            if b >= rows:
                return b
        return None

    def run(self, bucket: int, width: int, tokens: torch.Tensor, pos: torch.Tensor,
            table: torch.Tensor) -> torch.Tensor | None:
        """Logits of rows ``0..bucket-1`` ([bucket, V], valid until the next call), or None when capture
        failed (the caller then runs the eager step, now and from then on).

        tokens, pos: [bucket, 1]; table: [bucket, width]; all on the device.
        """
        if self.failed:
            return None
        entry = self._captured.get((bucket, width))
        if entry is None:
            entry = self._capture_bucket(bucket, width, (tokens, pos, table))
            if self._agree(entry is None):
                if entry is not None:
                    self._give_up(RuntimeError("capturing the drafter's decode step failed on another rank"))
                return None
            replay, out, _ = entry
            replay()  # the capture recorded kernels; with a real graph nothing has run on these inputs yet
            return out
        replay, out, static = entry
        for buffer, value in zip(static, (tokens, pos, table)):
            buffer.copy_(value)
        replay()
        return out

    def _capture_bucket(self, bucket: int, width: int, inputs: tuple[torch.Tensor, ...]):
        # every tensor the step reads is a static input, kept with the entry: a graph holds no reference to
        # what it read, so a tensor only the step's closure knew would be freed and its memory reused
        rows = torch.arange(bucket, device=self._device)
        cols = torch.zeros(bucket, dtype=torch.long, device=self._device)
        static = tuple(t.clone() for t in inputs) + (rows, cols)
        try:
            replay, out = self._capture(self._step, static, self._pool)
        except Exception as exc:  # noqa: BLE001 - a drafter that cannot be captured still drafts, eagerly
            self._give_up(exc)
            return None
        self.captures += 1
        entry = (replay, out, static)
        self._captured[(bucket, width)] = entry
        return entry

    def _give_up(self, exc: BaseException) -> None:
        self.failed = True
        self.failure = exc
        self._captured.clear()
        logger.warning("vllm-usd: capturing the drafter's decode step failed (%s: %s); it runs eagerly from "
                       "now on. Start vLLM with enforce_eager=True to skip the attempt.", type(exc).__name__, exc)
