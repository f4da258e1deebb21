"""A drafter runtime on a Hugging Face transformers model, with a paged KV cache.

The drafter keeps its own KV cache, apart from vLLM's: per layer, one pool of
``BLOCK_SIZE``-token blocks (``[blocks, BLOCK_SIZE, kv_heads, head_dim]``),
allocated once (``allocate``: the proposer's ``load_model``, before vLLM sizes
its own cache) and never grown. Each request holds a list of blocks, its block
table, taken from the pool as its context grows (``reserve``) and returned when
it is freed, so memory follows the live tokens. A request that cannot get
blocks goes undrafted alone. Block 0 is scratch: padding writes there, and
nobody's table points at it for a real token.

A forward writes each new token's KV into its block and attends over the
request's blocks gathered in position order (``attention.paged_attention``,
torch SDPA). Because the cache is private, the drafter may have any attention
layout (Gemma-3's sliding-window layers, say), unlike a drafter that shares the
target's KV cache groups.

Between the positions of one drafting step, the ids, positions and block
tables stay on the device (``_DecodeRows``): ``forward_next`` reads the ids
where they were sampled, and copies nothing to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from vllm_usd.core.device import to_device
from vllm_usd.drafter.attention import BATCH_KWARG, PagedBatch
from vllm_usd.drafter.base import DrafterRuntime
from vllm_usd.drafter.decode_graphs import Capture, DecodeGraphs

BLOCK_SIZE = 16  # tokens per KV block
# Requests with more new tokens than this in one step (a prompt) are run in
# their own forward, so they do not pad everyone else's batch.
PREFILL_SPLIT = 16
# Such a request catches up in chunks of this many tokens, so that one forward's attention masks and
# intermediates are bounded by a chunk ([group x CATCH_UP_CHUNK, max_len] per layer), whatever the
# prompt's length; allocate() runs the largest forward once, so that its memory is taken at start-up.
CATCH_UP_CHUNK = 256
SCRATCH = 0  # the block padding writes to


class _PagedCacheView:
    """What the model sees as ``past_key_values`` during one forward."""

    is_compileable = False

    def __init__(self, runtime: "HFDrafterRuntime", table: torch.Tensor, slots: torch.Tensor) -> None:
        self._rt, self._table, self._slots = runtime, table, slots

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """key/value_states [R, Hkv, T, D] -> written at their slots; returns the rows' keys and values
        gathered block by block, [R, Hkv, L, D] with key i at position i."""
        rows = self._table.shape[0]
        out = []
        for pool, states in ((self._rt._k[layer_idx], key_states), (self._rt._v[layer_idx], value_states)):
            heads, dim = pool.shape[2], pool.shape[3]
            flat = pool.view(-1, heads, dim)  # [blocks * BLOCK_SIZE, Hkv, D]
            flat.index_copy_(0, self._slots, states.transpose(1, 2).reshape(-1, heads, dim).to(pool.dtype))
            gathered = pool.index_select(0, self._table.reshape(-1))  # [R * NB, BLOCK_SIZE, Hkv, D]
            out.append(gathered.view(rows, -1, heads, dim).transpose(1, 2))
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._table.shape[1] * BLOCK_SIZE

    def __len__(self) -> int:
        return len(self._rt._k)


@dataclass
class _DecodeRows:
    """The rows of the last forward, kept on the device for the next position's forward."""

    req_ids: tuple[str, ...]
    lengths: list[int]  # host: each row's cached tokens after that forward
    table: torch.Tensor  # [B, NB] block ids (SCRATCH past a row's blocks)
    pos: torch.Tensor  # [B] each row's next position (= lengths)
    version: int  # the block tables' version they were read at


class HFDrafterRuntime(DrafterRuntime):
    """A transformers causal LM with a private paged KV cache."""

    def __init__(self, model, *, max_len: int, max_requests: int, kv_budget_bytes: int,
                 capture: Capture | None = None, agree: Callable[[bool], bool] = lambda failed: failed,
                 catch_up_tokens: int = 1) -> None:
        """``capture``: how to capture the fixed-shape steps (``decode_graphs.capture_cuda_graph`` on a
        GPU); None runs every step eagerly. ``catch_up_tokens``: the most new tokens per row of the
        captured catch-up (k + 1: the accepted drafts and the bonus token). ``agree``: whether a capture failed on any tensor-parallel rank. The KV pool holds ``kv_budget_bytes``, or what
        ``max_requests`` requests of ``max_len`` tokens need if that is less."""
        self.model = model
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self._num_layers = cfg.num_hidden_layers
        self._kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self._head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self.max_len = min(max_len, int(getattr(cfg, "max_position_embeddings", max_len) or max_len))
        self._max_requests = max_requests
        first = next(model.parameters())
        self._dtype, self.device = first.dtype, first.device
        # int8 bodies keep float activations; their pruned head runs in bfloat16 (half the bytes to read)
        self._head_dtype = torch.bfloat16 if getattr(model, "vllm_usd_int8", None) else self._dtype
        self.block_bytes = BLOCK_SIZE * self._num_layers * 2 * self._kv_heads * self._head_dim * self._dtype.itemsize
        self._max_blocks = -(-self.max_len // BLOCK_SIZE)  # per request
        self.num_blocks = int(min(kv_budget_bytes // self.block_bytes, max_requests * self._max_blocks))
        self._base = getattr(model, model.base_model_prefix)
        head = model.get_output_embeddings()
        self._head_weight = head.weight.to(self._head_dtype)
        self._head_bias = getattr(head, "bias", None)
        self.num_outputs = self._head_weight.shape[0]

        self._k: list[torch.Tensor] = []  # per layer [num_blocks + 1, BLOCK_SIZE, Hkv, D], block 0 scratch
        self._v: list[torch.Tensor] = []
        self._free: list[int] = []
        self._blocks: dict[str, list[int]] = {}
        self._version = 0  # bumped whenever a block table changes
        self._rows: _DecodeRows | None = None
        self._tokens: dict[str, list[int]] = {}
        # ids appended by forward_next and not yet known on the host: (ids [B] on device, [(req_id, index)])
        self._unsettled: list[tuple[torch.Tensor, list[tuple[str, int]]]] = []
        self.workspace_bytes = 0  # what the largest catch-up took beside the KV pool (read on a GPU)
        # forwards by path: a graph replay; eager where a captured step would hold its shape (no graph:
        # off, failed, or past the largest bucket); "long" for more new tokens per row than any graph's
        self.forwards = {"replayed": 0, "eager": 0, "long": 0}
        self._graph_tokens = (1, catch_up_tokens)
        self.graphs = DecodeGraphs(self._step, self.device, max_rows=max_requests, max_blocks=self._max_blocks,
                                   token_counts=self._graph_tokens, capture=capture, agree=agree) \
            if capture is not None else None

    # -- memory ---------------------------------------------------------------------------
    @property
    def param_bytes(self) -> int:
        """The drafter's weights in memory (every tensor-parallel rank holds a full copy)."""
        from vllm_usd.drafter.weight_formats import weight_bytes

        return weight_bytes(self.model)

    @property
    def planned_kv_bytes(self) -> int:
        return (self.num_blocks + 1) * self.block_bytes

    @property
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._k, *self._v))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self) -> None:
        """Allocate the whole KV pool now (once; the first request does it if nobody did)."""
        if self._k:
            return
        if self.num_blocks < 1:
            raise ValueError(f"vllm-usd: the drafter's KV budget holds no {BLOCK_SIZE}-token block of "
                             f"{self.block_bytes} bytes; raise additional_config.usd.drafter_kv_budget_gb")
        shape = (self._num_layers, 2, self.num_blocks + 1, BLOCK_SIZE, self._kv_heads, self._head_dim)
        pool = torch.zeros(shape, dtype=self._dtype, device=self.device)  # zeros: padding reads only finite values
        self._k = [pool[i, 0] for i in range(self._num_layers)]
        self._v = [pool[i, 1] for i in range(self._num_layers)]
        self._free = list(range(self.num_blocks, SCRATCH, -1))
        if self.graphs is not None:
            self.graphs.capture_all(self.num_outputs)
        reserved = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        self._reserve_workspace()  # with the graphs' memory held, as it is while serving
        if self.device.type == "cuda":
            self.workspace_bytes = torch.cuda.memory_reserved(self.device) - reserved

    @torch.inference_mode()
    def _reserve_workspace(self) -> None:
        """Run the two largest forwards serving can ask for, on the scratch block: one request catching up
        a chunk, and every request catching up ``PREFILL_SPLIT`` tokens, each attending over ``max_len``. On
        a GPU the caching allocator keeps what they took, so vLLM's profiling counts it before it sizes its
        KV cache, and a catch-up while serving takes nothing new."""
        dev = self.device
        for rows, t in ((1, min(CATCH_UP_CHUNK, self.max_len)), (self._max_requests, min(PREFILL_SPLIT, self.max_len))):
            pos = torch.arange(self.max_len - t, self.max_len, device=dev).expand(rows, t)  # [rows, t]
            table = torch.full((rows, self._max_blocks), SCRATCH, dtype=torch.long, device=dev)
            self._step(torch.zeros(rows, t, dtype=torch.long, device=dev), pos, table,
                       torch.full((rows,), t - 1, dtype=torch.long, device=dev))

    def reserve(self, req_id: str, length: int) -> bool:
        """Blocks for ``length`` tokens of ``req_id``; False (nothing taken) when the pool has too few."""
        blocks = self._blocks[req_id]
        need = -(-length // BLOCK_SIZE) - len(blocks)
        if need <= 0:
            return True
        if need > len(self._free) or length > self.max_len:
            return False
        blocks.extend(self._free.pop() for _ in range(need))
        self._version += 1
        return True

    # -- requests ------------------------------------------------------------------
    def set_output_rows(self, rows: torch.Tensor) -> None:
        if self._k:  # the workspace was sized, and graphs captured, on the head as it was
            raise RuntimeError("set_output_rows after allocate(): call it before the drafter's memory is taken")
        full = self.model.get_output_embeddings()
        rows = rows.to(self.device)
        self._head_weight = full.weight.index_select(0, rows).to(self._head_dtype).contiguous()
        bias = getattr(full, "bias", None)
        self._head_bias = bias.index_select(0, rows).to(self._head_dtype) if bias is not None else None
        self.num_outputs = int(rows.numel())

    def _claim(self, req_id: str) -> bool:
        self.allocate()
        if len(self._blocks) >= self._max_requests:
            return False
        self._blocks[req_id] = []
        return True

    def _release(self, req_id: str) -> None:
        self._free.extend(reversed(self._blocks.pop(req_id)))
        self._version += 1
        self._rows = None  # stale now (the tables changed): nothing held for it

    def cached_tokens(self, req_id: str) -> list[int]:
        self._settle()
        return self._tokens[req_id]

    def free(self, req_id: str) -> None:
        self._settle()  # a request id used again must not receive the old one's ids
        super().free(req_id)

    def settle_from_host(self, ids: Sequence[int]) -> None:
        """The ids ``forward_next`` appended since the last settle, in call order, from a host copy the
        caller made anyway: no copy of the runtime's own. Nothing to do where it was given them already."""
        if not self._unsettled:
            return
        places = [place for _, where in self._unsettled for place in where]
        if len(places) != len(ids):
            raise ValueError(f"settle_from_host: {len(ids)} ids for {len(places)} placeholders")
        self._unsettled = []
        self._fill(places, ids)

    def _settle(self) -> None:
        """Copy the ids forward_next appended to the host: one copy for every call since the last."""
        if not self._unsettled:
            return
        flat = torch.cat([ids for ids, _ in self._unsettled]).tolist()
        places = [place for _, where in self._unsettled for place in where]
        self._unsettled = []
        self._fill(places, flat)

    def _fill(self, places: list[tuple[str, int]], ids: Sequence[int]) -> None:
        for (req_id, index), tid in zip(places, ids):  # in call order: a later write to a place wins
            toks = self._tokens.get(req_id)
            if toks is not None and index < len(toks):
                toks[index] = tid

    def _make_room(self, req_ids: Sequence[str], ends: Sequence[int]) -> None:
        for r, end in zip(req_ids, ends):
            if end > self.max_len:
                raise ValueError("drafter context full")
            if not self.reserve(r, end):
                raise MemoryError("drafter KV pool exhausted")

    # -- forward ---------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, req_ids: Sequence[str], keep: Sequence[int],
                new_tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        self._settle()
        self._make_room(req_ids, [k + len(t) for k, t in zip(keep, new_tokens)])
        long_rows = [i for i, t in enumerate(new_tokens) if len(t) > PREFILL_SPLIT]
        if not long_rows:  # the steady case: one forward, a replay where a captured step holds it
            return self._run_host(req_ids, keep, new_tokens)
        short_rows = [i for i, t in enumerate(new_tokens) if len(t) <= PREFILL_SPLIT]
        out = torch.empty(len(req_ids), self.num_outputs, dtype=torch.float32, device=self.device)
        for i in long_rows:
            tokens = new_tokens[i]
            for start in range(0, len(tokens), CATCH_UP_CHUNK):
                logits = self._run_host([req_ids[i]], [keep[i] + start], [tokens[start:start + CATCH_UP_CHUNK]])
            out[i] = logits[0]
        if short_rows:
            out[to_device(short_rows, torch.long, self.device)] = self._run_host(
                [req_ids[i] for i in short_rows], [keep[i] for i in short_rows], [new_tokens[i] for i in short_rows])
        return out

    @torch.inference_mode()
    def forward_next(self, req_ids: Sequence[str], keep: Sequence[int], tokens: torch.Tensor,
                     host_ids: Sequence[int] | None = None) -> torch.Tensor:
        """One token per request from a device tensor. Rows that continue the last forward's (a prefix of
        them, each right after its last token) reuse its block tables and positions on the device."""
        self._make_room(req_ids, [k + 1 for k in keep])
        table, pos = self._decode_rows(req_ids, keep)
        rows = len(req_ids)
        tokens_d, pos_d = tokens.to(self.device).view(rows, 1), pos.view(rows, 1)
        logits = self._replay(tokens_d, pos_d, table, None) if self.graphs is not None else None
        if logits is None:
            self.forwards["eager"] += 1
            logits = self._step(tokens_d, pos_d, table, torch.zeros(rows, dtype=torch.long, device=self.device))
        where = []
        for r, k in zip(req_ids, keep):
            toks = self._tokens[r]
            del toks[k:]
            where.append((r, len(toks)))
            toks.append(-1)
        if host_ids is not None:
            self._fill(where, host_ids)
        else:  # placeholders until the ids are settled
            self._unsettled.append((tokens.reshape(-1), where))
        self._rows = _DecodeRows(tuple(req_ids), [k + 1 for k in keep], table, pos + 1, self._version)
        return logits

    def _decode_rows(self, req_ids: Sequence[str], keep: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables [B, NB] and positions [B] on the device: the last forward's, where these rows
        continue it, else copied from the host (asynchronously: not a sync)."""
        last, n = self._rows, len(req_ids)
        if (last is not None and last.version == self._version and tuple(req_ids) == last.req_ids[:n]
                and list(keep) == last.lengths[:n]):
            return last.table[:n], last.pos[:n]
        width = max(len(self._blocks[r]) for r in req_ids)
        return self._table(req_ids, width), to_device(list(keep), torch.long, self.device)

    def _table(self, req_ids: Sequence[str], width: int) -> torch.Tensor:
        table = [self._blocks[r] + [SCRATCH] * (width - len(self._blocks[r])) for r in req_ids]
        return to_device(table, torch.long, self.device)  # [B, width]

    def _step(self, tokens: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """The forward: tensors in, logits out, no host reads and no global state, so it traces whole
        (tests/test_drafter_runtime.py compiles it with fullgraph=True).

        tokens, pos: [R, T] new ids and their positions; table: [R, NB] each row's blocks, covering every
        real position in ``pos``; last: [R] each row's last real new token. Tokens past ``last`` are
        padding: their keys and values go to the scratch block, and their outputs are not read.
        Returns [R, num_outputs] float32, the logits after each row's last real token.
        """
        real = torch.arange(tokens.shape[1], device=tokens.device) <= last.unsqueeze(1)  # [R, T]
        block = table.gather(1, torch.where(real, torch.div(pos, BLOCK_SIZE, rounding_mode="floor"), 0))  # [R, T]
        slots = torch.where(real, block * BLOCK_SIZE + pos % BLOCK_SIZE, SCRATCH).reshape(-1)  # [R * T]
        batch = PagedBatch.build(pos, table.shape[1] * BLOCK_SIZE)
        hidden = self._base(
            input_ids=tokens, position_ids=pos, attention_mask=batch.causal,
            past_key_values=_PagedCacheView(self, table, slots), use_cache=True, **{BATCH_KWARG: batch},
        ).last_hidden_state  # [R, T, hidden]
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        final = hidden[rows, last].to(self._head_dtype)  # [R, hidden]
        logits = torch.nn.functional.linear(final, self._head_weight, self._head_bias).float()  # [R, num_outputs]
        if self._final_softcap:
            logits = torch.tanh(logits / self._final_softcap) * self._final_softcap
        return logits

    def _run_host(self, req_ids: Sequence[str], keep: Sequence[int],
                  new_tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """One batched forward of host ids (a catch-up, a prompt): a replay where a captured step holds its
        shape, else eager. Its rows then stay on the device for the next position's forward."""
        rows_n, t_max = len(req_ids), max(len(t) for t in new_tokens)
        dev = self.device
        t_graph = self.graphs.tokens_for(t_max) if self.graphs is not None else None
        t_pad = t_graph or t_max
        # padding repeats each row's last token and position: it writes to the scratch block, read by nobody
        tokens = [list(t) + [t[-1]] * (t_pad - len(t)) for t in new_tokens]
        positions = [[k + min(j, len(t) - 1) for j in range(t_pad)] for k, t in zip(keep, new_tokens)]
        table = self._table(req_ids, max(len(self._blocks[r]) for r in req_ids))  # [R, blocks]
        tokens_d, pos_d = to_device(tokens, torch.long, dev), to_device(positions, torch.long, dev)
        last = to_device([len(t) - 1 for t in new_tokens], torch.long, dev)
        logits = self._replay(tokens_d, pos_d, table, last) if t_graph is not None else None
        if logits is None:
            self.forwards["eager" if t_max <= max(self._graph_tokens) else "long"] += 1
            logits = self._step(tokens_d, pos_d, table, last)
        for r, k, new in zip(req_ids, keep, new_tokens):
            toks = self._tokens[r]
            del toks[k:]
            toks.extend(new)
        ends = [k + len(t) for k, t in zip(keep, new_tokens)]
        self._rows = _DecodeRows(tuple(req_ids), ends, table, to_device(ends, torch.long, dev), self._version)
        return logits

    def _replay(self, tokens: torch.Tensor, pos: torch.Tensor, table: torch.Tensor,
                last: torch.Tensor | None) -> torch.Tensor | None:
        """The step through the graph captured for the bucket holding these rows, their padded token count
        and a table wide enough; None where no graph holds them (the eager step runs instead).
        tokens, pos: [R, T] (T a captured count); table: [R, w]; last: [R] (None: every row uses all T)."""
        rows = table.shape[0]
        bucket = self.graphs.bucket(rows)
        if bucket is None:
            return None
        # the captured widths: powers of two; the table covers every real position (padding writes to scratch)
        width = min(1 << (table.shape[1] - 1).bit_length(), self._max_blocks)
        out = self.graphs.run(bucket, width, tokens, pos, table, last)  # [bucket, V]
        if out is None:
            return None
        self.forwards["replayed"] += 1
        return out[:rows]  # the graph's own output: read before the next forward
