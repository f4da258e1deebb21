"""A drafter runtime on a Hugging Face transformers model.

The drafter keeps its own KV cache, apart from vLLM's: one slot per request
in per-layer buffers ``[slots, kv_heads, max_len, head_dim]``. Active requests
occupy slots ``0..n-1`` (a freed slot is refilled from the last one), so a
batched forward reads the cache as a strided view with no gather. Attention is
a small registered transformers attention function that folds the GQA group
into the query length and applies a per-row causal (and sliding-window) mask.
Because the cache is private, the drafter may have any attention layout
(e.g. Gemma-3's sliding-window layers), unlike a drafter that shares the
target's KV cache groups.
"""

from __future__ import annotations

from typing import Sequence

import torch

from vllm_usd.drafter.attention import BATCH_KWARG, SlotBatch
from vllm_usd.drafter.base import DrafterRuntime
from vllm_usd.drafter.decode_graphs import Capture, DecodeGraphs

# Requests with more new tokens than this in one step (a prompt) are run in
# their own forward, so they do not pad everyone else's batch.
PREFILL_SPLIT = 16


class _SlotCacheView:
    """What the model sees as ``past_key_values`` during one forward."""

    is_compileable = False

    def __init__(self, runtime: "HFDrafterRuntime", lo: int, hi: int, rows: torch.Tensor,
                 pos: torch.Tensor, key_len: int) -> None:
        self._rt, self._lo, self._hi = runtime, lo, hi
        self._rows, self._pos, self._key_len = rows, pos, key_len

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        kbuf, vbuf = self._rt._k[layer_idx], self._rt._v[layer_idx]
        # key_states [R, Hkv, T, D] -> written at [slot, :, pos]
        kbuf[self._rows, :, self._pos] = key_states.transpose(1, 2).to(kbuf.dtype)
        vbuf[self._rows, :, self._pos] = value_states.transpose(1, 2).to(vbuf.dtype)
        return (kbuf[self._lo:self._hi, :, : self._key_len],
                vbuf[self._lo:self._hi, :, : self._key_len])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._key_len

    def __len__(self) -> int:
        return len(self._rt._k)


class HFDrafterRuntime(DrafterRuntime):
    """A transformers causal LM with a private slot KV cache."""

    def __init__(self, model, *, max_len: int, max_requests: int, kv_budget_bytes: int,
                 capture: Capture | None = None) -> None:
        """``capture``: how to capture the one-token decode step (``decode_graphs.capture_cuda_graph`` on a
        GPU); None runs every step eagerly."""
        self.model = model
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self._num_layers = cfg.num_hidden_layers
        self._kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self._head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self.max_len = min(max_len, int(getattr(cfg, "max_position_embeddings", max_len) or max_len))
        self._max_requests = max_requests
        self._budget = kv_budget_bytes
        first = next(model.parameters())
        self._dtype, self.device = first.dtype, first.device
        # int8 bodies keep float activations; their pruned head runs in bfloat16 (half the bytes to read)
        self._head_dtype = torch.bfloat16 if getattr(model, "vllm_usd_int8", None) else self._dtype
        self._bytes_per_token = self._num_layers * 2 * self._kv_heads * self._head_dim * self._dtype.itemsize
        self._base = getattr(model, model.base_model_prefix)
        head = model.get_output_embeddings()
        self._head_weight = head.weight.to(self._head_dtype)
        self._head_bias = getattr(head, "bias", None)
        self.num_outputs = self._head_weight.shape[0]

        self._slot_cap, self._len_cap = 0, 0
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._slot_of: dict[str, int] = {}
        self._req_at: list[str] = []  # slot -> req_id, slots 0..n-1 in use
        self._tokens: dict[str, list[int]] = {}
        # ids appended by forward_next and not yet copied to the host: (ids [B] on device, [(req_id, index)])
        self._unsettled: list[tuple[torch.Tensor, list[tuple[str, int]]]] = []
        self.graphs = DecodeGraphs(self._step, self.device, max_rows=max_requests, capture=capture) \
            if capture is not None else None

    # -- capacity -----------------------------------------------------------------
    @property
    def param_bytes(self) -> int:
        """The drafter's weights in memory (every tensor-parallel rank holds a full copy)."""
        from vllm_usd.drafter.weight_formats import weight_bytes

        return weight_bytes(self.model)

    @property
    def kv_bytes(self) -> int:
        return self._slot_cap * self._len_cap * self._bytes_per_token

    def _grow(self, slots: int, length: int) -> bool:
        slots = max(slots, self._slot_cap)
        length = min(max(length, self._len_cap), self.max_len)
        if slots <= self._slot_cap and length <= self._len_cap:
            return True
        # grow geometrically, but never past the budget
        new_slots = min(max(slots, 2 * self._slot_cap if slots > self._slot_cap else self._slot_cap, 4), self._max_requests)
        new_len = min(max(length, 2 * self._len_cap if length > self._len_cap else self._len_cap, 256), self.max_len)
        if new_slots < slots or new_len < length:
            return False
        while new_slots * new_len * self._bytes_per_token > self._budget:
            if new_len > length:
                new_len = max(length, new_len // 2)
            elif new_slots > slots:
                new_slots = max(slots, new_slots // 2)
            else:
                return False
        shape = (new_slots, self._kv_heads, new_len, self._head_dim)
        k = [torch.zeros(shape, dtype=self._dtype, device=self.device) for _ in range(self._num_layers)]
        v = [torch.zeros(shape, dtype=self._dtype, device=self.device) for _ in range(self._num_layers)]
        n, m = len(self._req_at), min(self._len_cap, new_len)
        for layer in range(len(self._k)):
            k[layer][:n, :, :m] = self._k[layer][:n, :, :m]
            v[layer][:n, :, :m] = self._v[layer][:n, :, :m]
        self._k, self._v = k, v
        self._slot_cap, self._len_cap = new_slots, new_len
        return True

    # -- requests ------------------------------------------------------------------
    def set_output_rows(self, rows: torch.Tensor) -> None:
        full = self.model.get_output_embeddings()
        rows = rows.to(self.device)
        self._head_weight = full.weight.index_select(0, rows).to(self._head_dtype).contiguous()
        bias = getattr(full, "bias", None)
        self._head_bias = bias.index_select(0, rows).to(self._head_dtype) if bias is not None else None
        self.num_outputs = int(rows.numel())

    def _claim(self, req_id: str) -> bool:
        n = len(self._req_at)
        if n >= self._max_requests or not self._grow(n + 1, max(self._len_cap, 1)):
            return False
        self._slot_of[req_id] = n
        self._req_at.append(req_id)
        return True

    def cached_tokens(self, req_id: str) -> list[int]:
        self._settle()
        return self._tokens[req_id]

    def free(self, req_id: str) -> None:
        self._settle()
        super().free(req_id)

    def _settle(self) -> None:
        """Copy the ids forward_next appended to the host: one copy for every call since the last."""
        if not self._unsettled:
            return
        flat = torch.cat([ids for ids, _ in self._unsettled]).tolist()
        places = [place for _, where in self._unsettled for place in where]
        self._unsettled = []
        for (req_id, index), tid in zip(places, flat):  # in call order: a later write to a place wins
            toks = self._tokens.get(req_id)
            if toks is not None and index < len(toks):
                toks[index] = tid

    def _release(self, req_id: str) -> None:
        slot = self._slot_of.pop(req_id)
        last = len(self._req_at) - 1
        moved = self._req_at.pop()
        if slot != last:  # keep slots 0..n-1 dense: move the last one into the hole
            length = len(self._tokens[moved])
            for layer in range(self._num_layers):
                self._k[layer][slot, :, :length] = self._k[layer][last, :, :length]
                self._v[layer][slot, :, :length] = self._v[layer][last, :, :length]
            self._req_at[slot] = moved
            self._slot_of[moved] = slot

    # -- forward ---------------------------------------------------------------------
    @torch.inference_mode()
    def forward_next(self, req_ids: Sequence[str], keep: Sequence[int], tokens: torch.Tensor) -> torch.Tensor:
        """One token per request from a device tensor: no host copy (``_settle`` makes one later)."""
        return self._run(req_ids, keep, [1] * len(req_ids), device_tokens=tokens)

    @torch.inference_mode()
    def forward(self, req_ids: Sequence[str], keep: Sequence[int],
                new_tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        self._settle()
        out = torch.empty(len(req_ids), self.num_outputs, dtype=torch.float32, device=self.device)
        long_rows = [i for i, t in enumerate(new_tokens) if len(t) > PREFILL_SPLIT]
        short_rows = [i for i, t in enumerate(new_tokens) if len(t) <= PREFILL_SPLIT]
        for i in long_rows:
            out[i] = self._run([req_ids[i]], [keep[i]], [len(new_tokens[i])], host_tokens=[new_tokens[i]])[0]
        if short_rows:
            if len(short_rows) == len(req_ids):
                out[:] = self._run(req_ids, keep, [len(t) for t in new_tokens], host_tokens=new_tokens)
            else:
                out[torch.tensor(short_rows, device=self.device)] = self._run(
                    [req_ids[i] for i in short_rows], [keep[i] for i in short_rows],
                    [len(new_tokens[i]) for i in short_rows], host_tokens=[new_tokens[i] for i in short_rows])
        return out

    def _step(self, tokens: torch.Tensor, pos: torch.Tensor, sel_rows: torch.Tensor, sel_cols: torch.Tensor,
              lo: int, hi: int, key_len: int) -> torch.Tensor:
        """The forward on slots lo..hi-1: tensors in, logits out, no host reads and no global state, so it
        traces whole (tests/test_drafter_runtime.py compiles it with fullgraph=True).

        tokens, pos: [R, T] new ids and their positions; sel_rows, sel_cols: [B] where each
        requested row's last new token is. Returns [B, num_outputs] float32.
        """
        rows_n, t_max = tokens.shape
        kpos = torch.arange(key_len, device=tokens.device)
        allowed = kpos.view(1, 1, 1, -1) <= pos.view(rows_n, 1, t_max, 1)  # causal within each row
        full = torch.zeros(allowed.shape, dtype=self._dtype, device=tokens.device).masked_fill_(
            ~allowed, torch.finfo(self._dtype).min)  # [R, 1, T, Lk] additive
        batch = SlotBatch(full=full, qpos=pos, kpos=kpos, sliding={})
        rows = torch.arange(lo, hi, device=tokens.device).unsqueeze(1).expand(rows_n, t_max)
        cache = _SlotCacheView(self, lo, hi, rows, pos, key_len)
        hidden = self._base(
            input_ids=tokens, position_ids=pos, attention_mask=full,
            past_key_values=cache, use_cache=True, **{BATCH_KWARG: batch},
        ).last_hidden_state  # [R, T, hidden]
        last = hidden[sel_rows, sel_cols].to(self._head_dtype)  # [B, hidden]
        logits = torch.nn.functional.linear(last, self._head_weight, self._head_bias).float()  # [B, num_outputs]
        if self._final_softcap:
            logits = torch.tanh(logits / self._final_softcap) * self._final_softcap
        return logits

    def _run(self, req_ids: Sequence[str], keep: Sequence[int], num_new: Sequence[int], *,
             host_tokens: Sequence[Sequence[int]] | None = None,
             device_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One batched forward; the new ids are ``host_tokens`` (lists) or ``device_tokens`` ([B], one each)."""
        slots = [self._slot_of[r] for r in req_ids]
        lo, hi = min(slots), max(slots) + 1
        t_max = max(num_new)
        # Rows of the slot range that are not in this call keep their length and
        # compute one throw-away query at their next free position.
        starts = [len(self._tokens[self._req_at[s]]) for s in range(lo, hi)]
        for s, k in zip(slots, keep):
            starts[s - lo] = k
        if max(st + t_max for st in starts) > self.max_len:
            raise ValueError("drafter context full")
        if not self._grow(self._slot_cap, max(st + t_max for st in starts)):
            raise MemoryError("drafter KV budget exhausted")

        logits = self._replay_decode(slots, keep, device_tokens) if device_tokens is not None else None
        if logits is None:
            logits = self._eager(slots, lo, hi, starts, num_new, host_tokens, device_tokens)

        if device_tokens is None:
            for r, k, new in zip(req_ids, keep, host_tokens):
                toks = self._tokens[r]
                del toks[k:]
                toks.extend(new)
        else:  # placeholders until _settle copies the ids over
            where = []
            for r, k in zip(req_ids, keep):
                toks = self._tokens[r]
                del toks[k:]
                where.append((r, len(toks)))
                toks.append(-1)
            self._unsettled.append((device_tokens.reshape(-1), where))
        return logits

    def _eager(self, slots: list[int], lo: int, hi: int, starts: list[int], num_new: Sequence[int],
               host_tokens: Sequence[Sequence[int]] | None, device_tokens: torch.Tensor | None) -> torch.Tensor:
        """The step on exactly the slot range and key length the call needs."""
        rows_n, t_max = hi - lo, max(num_new)
        dev = self.device
        key_len = max(starts) + t_max
        sel_rows = torch.tensor([s - lo for s in slots], dtype=torch.long, device=dev)
        if device_tokens is None:
            tokens = torch.zeros(rows_n, t_max, dtype=torch.long)
            for s, new in zip(slots, host_tokens):
                tokens[s - lo, : len(new)] = torch.tensor(new, dtype=torch.long)
            tokens = tokens.to(dev, non_blocking=True)
        else:  # [B] on the device, one per request: scattered into its row, not read on the host here
            tokens = torch.zeros(rows_n, 1, dtype=torch.long, device=dev)
            tokens[sel_rows, 0] = device_tokens.to(dev)
        pos = torch.tensor(starts, dtype=torch.long, device=dev).unsqueeze(1) + torch.arange(t_max, device=dev)  # [R, T]
        # the last new token of each requested row
        sel_cols = torch.tensor([n - 1 for n in num_new], dtype=torch.long, device=dev)
        return self._step(tokens, pos, sel_rows, sel_cols, lo, hi, key_len)

    def _replay_decode(self, slots: list[int], keep: Sequence[int], device_tokens: torch.Tensor) -> torch.Tensor | None:
        """One token for each of ``slots`` through the captured fixed-shape step; None where it does not
        apply (no bucket holds the batch, or a row would outgrow the KV) and the eager step runs instead."""
        if self.graphs is None:
            return None
        n = len(self._req_at)
        bucket = self.graphs.bucket(n)
        if bucket is None or bucket > self._slot_cap:
            return None
        # every slot row of the bucket runs: the idle ones at their next free position, the unused at 0
        starts = [len(self._tokens[r]) for r in self._req_at] + [0] * (bucket - n)
        for s, k in zip(slots, keep):
            starts[s] = k
        if max(starts) + 1 > self.max_len or not self._grow(self._slot_cap, max(starts) + 1):
            return None
        dev = self.device
        sel = torch.tensor(slots, dtype=torch.long, device=dev)
        tokens = torch.zeros(bucket, 1, dtype=torch.long, device=dev)
        tokens[sel, 0] = device_tokens.to(dev)
        pos = torch.tensor(starts, dtype=torch.long, device=dev).unsqueeze(1)  # [bucket, 1]
        out = self.graphs.run(self._k, bucket, self._len_cap, tokens, pos)  # [bucket, V]
        return out[sel] if out is not None else None
