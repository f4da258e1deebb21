"""A drafter runtime on llama.cpp (``llama-cpp-python``): the CPU fast path for quantized GGUF drafters.

Batch-1 decoding of a small drafter on a CPU is bound by reading its weights;
llama.cpp reads them at 4-8 bits with hand-written kernels. Every request is
a llama.cpp sequence with its own KV stream (``kv_unified=False``), so one
``llama_decode`` call drafts for the whole batch, a rejected draft is rolled
back with ``llama_memory_seq_rm``, and attention never spans other requests.
Only the logits columns the caller asked for (the intersection) are copied out.

The drafter's ids are the GGUF vocabulary's, which must be the vocabulary of
the Hugging Face tokenizer used for the mapping (checked at load).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from vllm_usd.drafter.base import DrafterRuntime, Points

logger = logging.getLogger("vllm.usd")

# tokens per llama_decode call; a longer call (a prompt) is split into chunks of this size
BATCH_TOKENS = 512
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ
KV_BYTES_PER_ELEMENT = 2  # llama.cpp's default f16 KV cache
_backend_ready = False


@dataclass(frozen=True)
class NativeSettings:
    """How llama.cpp runs on this host: which CPU kernels, and whether weights may go to its extra
    buffer types (repacked, or AMX, layouts). The native probe (``native_probe.py``) chooses them."""

    cpu_variant: str | None  # a portable build's ``libggml-cpu-<variant>.so``; None: a native build's one
    extra_buffer_types: bool

    def describe(self, buffer_types: list[str] | None = None) -> str:
        from vllm_usd.drafter.ggml_library import variant_name

        bufts = ("extra buffer types " + (", ".join(buffer_types) if buffer_types else "on")
                 if self.extra_buffer_types else "no extra buffer types")
        return f"llama.cpp ({variant_name(self.cpu_variant)} kernels, {bufts})"


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def drafter_cpus() -> frozenset[int]:
    """The CPUs llama.cpp drafts on, a thread each: the calling thread's. In vLLM's CPU worker those are the
    target's (the worker and its drafter take turns on them), and no more can serve: llama.cpp's threads are
    OpenMP's, and libgomp binds every one of a worker's to the target's CPUs (``GOMP_CPU_AFFINITY``, applied
    when torch is imported, before any plugin runs; docs/cpu.md, "Correction")."""
    if not hasattr(os, "sched_getaffinity"):  # not Linux
        return frozenset(range(os.cpu_count() or 1))
    return frozenset(os.sched_getaffinity(0))


def step_ms(runtime: "LlamaCppDrafterRuntime", steps: int = 40) -> float:
    """Median milliseconds of a one-token batch-1 forward, as drafting runs them: ``steps`` forwards each
    appending a token to a 64-token context, after 4 warm-up ones."""
    import statistics
    import time

    runtime.add("__vllm_usd_timed__")
    runtime.forward(["__vllm_usd_timed__"], [0], [[100 + i for i in range(64)]])
    times = []
    for step in range(steps + 4):
        start = time.perf_counter()
        runtime.forward(["__vllm_usd_timed__"], [64 + step], [[200 + step]])
        times.append(time.perf_counter() - start)
    runtime.free("__vllm_usd_timed__")
    return round(1000 * statistics.median(times[4:]), 3)


def fastest_here(candidates: list[tuple[str, NativeSettings]], vocab_size: int, cpus: frozenset[int],
                 rounds: int = 4) -> list[float]:
    """Batch-1 step milliseconds of each (GGUF, settings), timed in this process on ``cpus`` (a worker's
    conditions: its binding, its OpenMP), in ``rounds`` interleaved rounds so that drift hits each alike."""
    import statistics

    if len({settings.cpu_variant for _, settings in candidates}) > 1:
        raise ValueError("the candidates run on different CPU kernel variants; a process loads one")
    runtimes: list[LlamaCppDrafterRuntime] = []
    try:
        for gguf, settings in candidates:
            runtimes.append(LlamaCppDrafterRuntime(gguf, settings=settings, vocab_size=vocab_size,
                                                   kv_bytes_per_token=1, max_len=256, max_requests=1,
                                                   kv_budget_bytes=1 << 28, cpus=cpus))
        times = [[step_ms(runtime, steps=10) for runtime in runtimes] for _ in range(rounds)]
    finally:
        for runtime in runtimes:
            runtime.close()
    return [statistics.median(column) for column in zip(*times)]


class LlamaCppDrafterRuntime(DrafterRuntime):
    """A GGUF drafter in llama.cpp, one KV stream per request."""

    def __init__(self, gguf_path: str, *, settings: NativeSettings, vocab_size: int, kv_bytes_per_token: int,
                 max_len: int, max_requests: int, kv_budget_bytes: int, cpus: frozenset[int] | None = None) -> None:
        import llama_cpp
        from llama_cpp import _logger

        from vllm_usd.drafter.ggml_library import load_cpu_backend

        _logger.set_verbose(False)  # before the backend loads: ggml logs that too ("load_backend: ...")
        load_cpu_backend(settings.cpu_variant)
        global _backend_ready
        if not _backend_ready:
            llama_cpp.llama_backend_init()
            _backend_ready = True
        self._ll = llama_cpp
        self.settings = settings
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.use_extra_bufts = settings.extra_buffer_types
        model = llama_cpp.llama_model_load_from_file(gguf_path.encode(), mparams)
        if not model:
            raise ValueError(f"vllm-usd: llama.cpp cannot load the drafter GGUF {gguf_path!r}")
        self._model = model
        vocab = llama_cpp.llama_model_get_vocab(model)
        self._n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        if self._n_vocab > vocab_size:
            raise ValueError(
                f"vllm-usd: the drafter GGUF {gguf_path!r} has {self._n_vocab} tokens but the drafter's tokenizer "
                f"and config have {vocab_size}: they are not the same model. Point usd.drafter_gguf at the GGUF "
                "the drafter folder was converted from, or set usd.drafter_runtime = \"transformers\"."
            )
        # sequences and the length each may reach, within the KV budget
        n_seq = max(1, min(max_requests, MAX_SEQUENCES))
        per_seq = max(256, min(max_len, int(llama_cpp.llama_model_n_ctx_train(model)) or max_len))
        per_seq = -(-per_seq // 256) * 256  # llama.cpp pads its context to 256: each sequence keeps an equal share
        while n_seq * per_seq * kv_bytes_per_token > kv_budget_bytes and per_seq > 256:
            per_seq = max(256, per_seq // 512 * 256)  # halved, in multiples of 256
        while n_seq * per_seq * kv_bytes_per_token > kv_budget_bytes and n_seq > 1:
            n_seq //= 2
        self.max_len = min(per_seq, max_len)  # the cells per sequence may exceed a smaller configured cap
        self._max_requests = n_seq
        self._kv_bytes = n_seq * per_seq * kv_bytes_per_token
        self.cpus = cpus or drafter_cpus()
        threads = len(self.cpus)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_seq * per_seq
        cparams.n_batch = cparams.n_ubatch = BATCH_TOKENS
        cparams.n_seq_max = n_seq
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = False  # one KV stream per sequence
        cparams.swa_full = True  # sliding-window layers keep every position, so rollback works
        cparams.no_perf = True
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            llama_cpp.llama_model_free(model)
            raise ValueError(f"vllm-usd: llama.cpp cannot make a context for {n_seq} sequences x {per_seq} tokens")
        self._ctx = ctx
        self._mem = llama_cpp.llama_get_memory(ctx)
        self._batch = llama_cpp.llama_batch_init(BATCH_TOKENS, 0, 1)
        self._param_bytes = int(llama_cpp.llama_model_size(model))
        self._cols: np.ndarray | None = None  # logits columns to return (None: all, padded to vocab_size)
        self.num_outputs = vocab_size
        self._vocab_size = vocab_size
        self._seq_of: dict[str, int] = {}
        self._free_seqs = list(range(n_seq - 1, -1, -1))
        self._tokens: dict[str, list[int]] = {}
        self.threads = threads
        self._one_at_a_time_up_to = 0  # a forward of at most this many tokens runs them one per llama_decode

    def close(self) -> None:
        """Free the llama.cpp batch, context and model (also on garbage collection)."""
        ll = getattr(self, "_ll", None)
        if ll is None or getattr(ll, "llama_free", None) is None:  # interpreter shutting down
            return
        if getattr(self, "_batch", None) is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            ll.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            ll.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing to do about it at collection time
            pass

    # -- capacity and requests -----------------------------------------------------------------
    @property
    def param_bytes(self) -> int:
        return self._param_bytes

    @property
    def kv_bytes(self) -> int:
        return self._kv_bytes

    def set_output_rows(self, rows: torch.Tensor) -> None:
        self._cols = rows.to(torch.long).cpu().numpy()
        self.num_outputs = int(rows.numel())

    def _claim(self, req_id: str) -> bool:
        if not self._free_seqs:
            return False
        seq = self._free_seqs.pop()
        self._ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._seq_of[req_id] = seq
        return True

    def _release(self, req_id: str) -> None:
        seq = self._seq_of.pop(req_id)
        self._ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._free_seqs.append(seq)

    # -- forward -------------------------------------------------------------------------------
    def forward(self, req_ids: Sequence[str], keep: Sequence[int],
                new_tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Roll each request back to ``keep[i]`` tokens, append ``new_tokens[i]``; logits after the last."""
        ll = self._ll
        entries: list[tuple[int, int, int, int]] = []  # (token, position, sequence, output row or -1)
        for row, (req_id, k, new) in enumerate(zip(req_ids, keep, new_tokens)):
            seq = self._seq_of[req_id]
            toks = self._tokens[req_id]
            if k + len(new) > self.max_len:
                raise ValueError("drafter context full")
            if k < len(toks):
                if not ll.llama_memory_seq_rm(self._mem, seq, k, -1):
                    raise RuntimeError(f"vllm-usd: llama.cpp cannot roll sequence {seq} back to {k} tokens")
                del toks[k:]
            last = len(new) - 1
            entries += [(int(t), k + j, seq, row if j == last else -1) for j, t in enumerate(new)]
            toks.extend(int(t) for t in new)
        out = torch.full((len(req_ids), self.num_outputs), float("-inf"))  # [B, num_outputs]
        size = 1 if len(entries) <= self._one_at_a_time_up_to else BATCH_TOKENS
        for start in range(0, len(entries), size):
            self._decode(entries[start:start + size], out)
        return out

    def one_at_a_time_where_faster(self, steps: Points, prompts: Points) -> tuple[Points, Points]:
        """llama.cpp decodes a one-token batch on its matrix-vector kernels and a longer one on its matrix ones,
        which can cost far more for a few tokens (Q8_0 on an AVX-512 EPYC: 5.5 ms for one token, 20 ms for two;
        docs/cpu.md). Every forward of up to the most tokens that one-token calls in turn beat, of those timed in
        one call (B requests' one-token step, a prompt), runs as one-token calls: each request's tokens in
        order, the same KV, the same logits up to rounding."""
        single = dict(steps).get(1)
        if single is None:
            return tuple(steps), tuple(prompts)
        self._one_at_a_time_up_to = max((n for n, seconds in (*steps, *prompts) if n * single < seconds), default=0)

        def priced(points: Points) -> Points:  # what each size costs as it now runs
            return tuple((n, n * single if n <= self._one_at_a_time_up_to else seconds) for n, seconds in points)

        return priced(steps), priced(prompts)

    def _on_drafter_cpus(self, call, *args):
        """``call(*args)`` with this thread's affinity set to the drafter's CPUs, where a caller chose others
        than its own (the native probe's child, ``fastest_here``: a subset to time on). Where libgomp binds
        OpenMP's threads (vLLM's worker: ``GOMP_CPU_AFFINITY``) this cannot move the rest of llama.cpp's team."""
        saved = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else self.cpus
        if saved == self.cpus:
            return call(*args)
        try:
            os.sched_setaffinity(0, self.cpus)
        except OSError as exc:  # the CPUs are no longer ours (a cgroup changed): draft where we are
            logger.warning("vllm-usd: llama.cpp can no longer draft on CPUs %s (%s); it drafts on %s from now on",
                           sorted(self.cpus), exc, sorted(saved))
            self.cpus = frozenset(saved)
            return call(*args)
        try:
            return call(*args)
        finally:
            os.sched_setaffinity(0, saved)

    def _decode(self, chunk: list[tuple[int, int, int, int]], out: torch.Tensor) -> None:
        ll, batch = self._ll, self._batch
        n = len(chunk)
        arr = np.asarray(chunk, dtype=np.int64)  # [n, 4]
        np.ctypeslib.as_array(batch.token, shape=(BATCH_TOKENS,))[:n] = arr[:, 0]
        np.ctypeslib.as_array(batch.pos, shape=(BATCH_TOKENS,))[:n] = arr[:, 1]
        np.ctypeslib.as_array(batch.n_seq_id, shape=(BATCH_TOKENS,))[:n] = 1
        np.ctypeslib.as_array(batch.logits, shape=(BATCH_TOKENS,))[:n] = arr[:, 3] >= 0
        seq_ids = batch.seq_id
        for i, seq in enumerate(arr[:, 2].tolist()):
            seq_ids[i][0] = seq
        batch.n_tokens = n
        rc = self._on_drafter_cpus(ll.llama_decode, self._ctx, batch)
        if rc != 0:
            raise RuntimeError(f"vllm-usd: llama_decode failed ({rc}) on {n} tokens")
        rows = arr[arr[:, 3] >= 0, 3]
        if rows.size == 0:
            return
        logits = np.ctypeslib.as_array(ll.llama_get_logits(self._ctx), shape=(rows.size, self._n_vocab))
        picked = torch.from_numpy(np.ascontiguousarray(logits if self._cols is None else logits[:, self._cols]))
        out[torch.from_numpy(rows), : picked.shape[1]] = picked
