"""UniversalProposer: vLLM's ``custom_class`` proposer for a drafter with another tokenizer.

vLLM builds it as ``UniversalProposer(vllm_config)`` in each worker and calls
``propose(...)`` once per step. The runner hook in ``_vllm_compat`` hands it
the runner and scheduler output just before, and takes its draft
probabilities just after.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_usd import _vllm_compat as compat
from vllm_usd.config import UsdConfig, check_num_speculative_tokens, parse_usd_config
from vllm_usd.drafter import HFDrafterRuntime, load_drafter
from vllm_usd.vocab import (
    ContextTranslator,
    DraftProbsBuffer,
    DraftSamplingParams,
    FragmentEncoder,
    VocabMapping,
    sample_drafts,
)
from vllm_usd.vocab.sampling import mix_seed, position_generators, text_key

logger = logging.getLogger("vllm.usd")

_SAMPLING_EPS = 1e-5  # vLLM treats temperature below this as greedy
_MAX_DIGESTS = 1 << 17


def _tp_rank() -> int:
    """This worker's global rank, for logs and the planted ``rank_rng`` fault only."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


@dataclass
class _RequestState:
    translator: ContextTranslator
    committed: int  # target tokens already given to the translator
    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    key: int  # stable per request, the same on every rank: drafting seeds derive from it
    seeded: bool  # the request has its own seed
    last_token: int  # target tokens at which the request reaches max_tokens


def _adds_bos(tokenizer) -> int | None:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a").input_ids
    return bos if ids and ids[0] == bos else None


class UniversalProposer:
    """Drafts with a small model whose vocabulary differs from the target's."""

    is_vllm_usd_proposer = True

    def __init__(self, vllm_config: Any) -> None:
        compat.require_supported()
        compat.install_runner_hook()
        if os.environ.get("VLLM_USD_TEST_FAULT", "") != "no_cpu_fix":
            compat.install_cpu_expand_fix()
        self.config: UsdConfig = parse_usd_config(getattr(vllm_config, "additional_config", None))
        self.k = compat.num_speculative_tokens(vllm_config)
        check_num_speculative_tokens(self.k)
        model_config = vllm_config.model_config
        self.target_vocab_size = compat.target_vocab_size(vllm_config)
        trust = self.config.trust_remote_code
        if trust is None:
            trust = bool(model_config.trust_remote_code)

        started = time.perf_counter()
        model, self.draft_tokenizer = load_drafter(
            self.config.drafter, dtype=self.config.drafter_dtype,
            revision=self.config.drafter_revision, trust_remote_code=trust,
        )
        from transformers import AutoTokenizer

        target_tokenizer = AutoTokenizer.from_pretrained(
            model_config.tokenizer, revision=getattr(model_config, "tokenizer_revision", None),
            trust_remote_code=model_config.trust_remote_code,
        )
        draft_vocab = int(model.get_output_embeddings().weight.shape[0])
        self.mapping = VocabMapping.build(
            target_tokenizer, self.draft_tokenizer,
            target_vocab_size=self.target_vocab_size, draft_vocab_size=draft_vocab,
            min_share=self.config.min_intersection,
        )
        self._encoder = FragmentEncoder(self.draft_tokenizer, self.mapping.draft_table)
        self._draft_bos = _adds_bos(self.draft_tokenizer)
        max_len = self.config.drafter_max_model_len or 1 << 30
        max_seqs = self.config.drafter_max_num_seqs or int(vllm_config.scheduler_config.max_num_seqs)
        self.runtime = HFDrafterRuntime(
            model, max_len=max_len, max_requests=max_seqs,
            kv_budget_bytes=int(self.config.drafter_kv_budget_gb * (1 << 30)),
        )
        if self.config.pruned_head:
            self.runtime.set_output_rows(self.mapping.draft_ids)
        self._draft_ids = self.mapping.draft_ids
        self._target_ids = self.mapping.target_ids
        self._target_ids_list: list[int] = self._target_ids.tolist()
        self._draft_ids_list: list[int] = self._draft_ids.tolist()
        self._states: dict[str, _RequestState] = {}
        self._undraftable: set[str] = set()  # past the drafter's context
        self._rank = _tp_rank()
        self._digests: list[str] = []  # with usd.debug_digests: one per drafting step
        self._runner = None
        self._scheduler_output = None
        self._q_buffer = DraftProbsBuffer(self.k, self.target_vocab_size, self._target_ids)
        self._last_q: torch.Tensor | None = None
        self._warned: set[str] = set()
        # Test-only planted bugs, to show the statistical test catches them:
        # "scramble_q" hands q on the wrong ids, "omit_q" hands no q for sampled drafts,
        # "no_cpu_fix" leaves vLLM's broken CPU expand_batch_to_tokens in place.
        self._fault = os.environ.get("VLLM_USD_TEST_FAULT", "")
        if self._fault:
            logger.warning("vllm-usd: TEST FAULT %r planted: output is NOT lossless", self._fault)
        self.timings: dict[str, float] = defaultdict(float)  # seconds, with usd.profile
        self._last_end: float | None = None
        self.counters: dict[str, int] = defaultdict(int)
        logger.info(
            "vllm-usd: drafter %s ready in %.1fs: %d shared tokens (%.1f%% of the drafter's %d, "
            "%d matched by bytes only), k=%d, draft_sampling=%s",
            self.config.drafter, time.perf_counter() - started, self.mapping.size,
            100 * self.mapping.size / max(self.mapping.draft_table.size, 1), self.mapping.draft_table.size,
            self.mapping.byte_only_matches, self.k, self.config.draft_sampling,
        )

    # -- vLLM hooks ----------------------------------------------------------------
    def load_model(self, target_model: Any) -> None:
        """vLLM calls this after loading the target; the drafter is already loaded."""

    def bind_step(self, runner: Any, scheduler_output: Any) -> None:
        self._runner = runner
        self._scheduler_output = scheduler_output

    def take_last_draft_probs(self) -> torch.Tensor | None:
        q, self._last_q = self._last_q, None
        return q

    @property
    def num_request_states(self) -> int:
        return len(self._states)

    def stats(self) -> dict[str, Any]:
        """Counters, phase timings (with usd.profile) and live state, for benchmarks and tests."""
        return {
            "counters": dict(self.counters), "timings": dict(self.timings),
            "request_states": len(self._states), "drafter_requests": self.runtime.num_requests,
            "drafter_kv_bytes": self.runtime.kv_bytes, "q_buffer_bytes": self._q_buffer.nbytes,
            "drafter_param_bytes": self.runtime.param_bytes, "rank": self._rank,
        }

    @property
    def digests(self) -> list[str]:
        """With usd.debug_digests: one SHA-256 per drafting step of (rows, requests, drafts, q)."""
        return list(self._digests)

    def _record_digest(self, rows: list[int], row_req: list[str], target: list[list[int]],
                       qs: list[torch.Tensor], all_greedy: bool) -> None:
        h = hashlib.sha256()
        h.update(repr((rows, row_req, target)).encode())
        if not all_greedy:
            for q in qs:  # [B, n] in intersection order: the same bytes as the scattered q
                h.update(q.contiguous().numpy().tobytes())
        if len(self._digests) < _MAX_DIGESTS:
            self._digests.append(h.hexdigest())

    @contextmanager
    def _timed(self, name: str):
        if not self.config.profile:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] += time.perf_counter() - start

    # -- lifecycle -------------------------------------------------------------------
    def _free(self, req_id: str) -> None:
        self._states.pop(req_id, None)
        self.runtime.free(req_id)

    def _forget(self, req_id: str) -> None:
        """vLLM no longer holds the request (finished, aborted or preempted)."""
        self._free(req_id)
        self._undraftable.discard(req_id)

    def _forget_gone_requests(self) -> None:
        runner = self._runner
        gone = compat.scheduler_gone_req_ids(self._scheduler_output) if self._scheduler_output is not None else set()
        for req_id in gone:
            self._forget(req_id)
        if runner is not None and len(self._states) + len(self._undraftable) > len(runner.requests):
            for req_id in [r for r in (*self._states, *self._undraftable) if r not in runner.requests]:
                self._forget(req_id)

    def _new_state(self, req_id: str) -> _RequestState | None:
        if not self.runtime.add(req_id):
            self.counters["skipped_no_memory"] += 1
            return None
        params = request = None
        if self._runner is not None:
            request = compat.runner_request(self._runner, req_id)
            params = getattr(request, "sampling_params", None)
        max_tokens = getattr(params, "max_tokens", None)
        prompt_len = getattr(request, "num_prompt_tokens", None)
        last_token = prompt_len + max_tokens if isinstance(max_tokens, int) and isinstance(prompt_len, int) else 1 << 62
        temperature = float(getattr(params, "temperature", 0.0) or 0.0)
        greedy = temperature < _SAMPLING_EPS or self.config.draft_sampling == "greedy"
        seed = getattr(params, "seed", None)
        # Never a global or rank-local RNG: every rank must draw the same drafts and q.
        key = mix_seed(int(seed), self.config.seed) if seed is not None else text_key(req_id)
        top_k = int(getattr(params, "top_k", 0) or 0)
        state = _RequestState(
            translator=ContextTranslator(self.mapping, self._encoder, self._draft_bos),
            committed=0, greedy=greedy, temperature=temperature,
            top_k=top_k if top_k > 0 else 0, top_p=float(getattr(params, "top_p", 1.0) or 1.0),
            key=key, seeded=seed is not None, last_token=last_token,
        )
        self._states[req_id] = state
        return state

    # -- drafting -----------------------------------------------------------------------
    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        **kwargs: Any,
    ) -> list[list[int]]:
        self._last_q = None
        num_rows = len(sampled_token_ids)
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        started = time.perf_counter() if self.config.profile else 0.0
        if self.config.profile and self._last_end is not None:
            # the rest of the engine step: target forward, rejection sampling, scheduling
            self.timings["outside_proposer"] += started - self._last_end
        try:
            self._forget_gone_requests()
            self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, drafts)
            return drafts
        except Exception as exc:  # noqa: BLE001 - a drafting failure must not stop the engine
            key = type(exc).__name__
            if key not in self._warned:
                self._warned.add(key)
                logger.exception("vllm-usd: drafting failed this step (%s); the affected requests go on without drafts", exc)
            self.counters["failed_steps"] += 1
            req_ids = self._req_ids(num_rows)
            for req_id in req_ids:
                if req_id is not None:
                    self._free(req_id)
            self._last_q = None
            return [[] for _ in range(num_rows)]
        finally:
            if self.config.profile:
                self._last_end = time.perf_counter()
                self.timings["propose_total"] += self._last_end - started

    def _req_ids(self, num_rows: int) -> list[str | None]:
        if self._runner is None:
            return [None] * num_rows
        return list(compat.runner_req_ids(self._runner))[:num_rows]

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, drafts) -> None:
        if self._runner is None:
            raise RuntimeError(
                "vllm-usd: the runner hook is not installed (was vllm_usd.plugin.register disabled?)"
            )
        req_ids = compat.runner_req_ids(self._runner)
        rows: list[int] = []
        row_req: list[str] = []
        wanted: list[list[int]] = []
        unchanged: list[int] = []
        with self._timed("translate"):
            for i, sampled in enumerate(sampled_token_ids):
                if not sampled:
                    continue  # a prefill chunk in progress: no draft this step
                req_id = req_ids[i]
                if req_id in self._undraftable:
                    continue
                state = self._states.get(req_id) or self._new_state(req_id)
                if state is None:
                    continue
                n = int(num_tokens_no_spec[i])
                if n >= state.last_token:  # max_tokens reached: the request ends with this step
                    self._free(req_id)
                    continue
                if n < state.committed:  # history shrank: rebuild from scratch
                    self._free(req_id)
                    state = self._new_state(req_id)
                    if state is None:
                        continue
                history = token_ids_cpu[i, state.committed:n].tolist()
                if state.committed == 0:
                    state.translator.start(history)
                    known = 0
                else:
                    _, appended = state.translator.feed(history)
                    known = len(state.translator.draft_ids) - len(appended)
                state.committed = n
                seq = state.translator.draft_ids
                if not seq or len(seq) + self.k > self.runtime.max_len:
                    if seq:  # past the drafter's context: no drafts for the rest of it
                        self.counters["skipped_context_full"] += 1
                        self._free(req_id)
                        self._undraftable.add(req_id)
                    continue
                rows.append(i)
                row_req.append(req_id)
                wanted.append(seq)  # read-only until the next step: no copy
                unchanged.append(known)
        if not rows:
            return

        states = [self._states[r] for r in row_req]
        params = DraftSamplingParams.from_lists(
            temperature=[s.temperature for s in states], top_k=[s.top_k for s in states],
            top_p=[s.top_p for s in states], greedy=[s.greedy for s in states],
        )
        keys = [s.key for s in states]
        seeded = [s.seeded for s in states]
        positions = [int(num_tokens_no_spec[i]) for i in rows]  # target position of the first draft
        salt = self.config.seed
        if self._fault == "rank_rng":  # planted: rank-local randomness, what TP must never have
            salt += 1 + self._rank
        k = self.k
        index = torch.empty(len(rows), k, dtype=torch.long)
        qs: list[torch.Tensor] = []
        lengths = [len(seq) for seq in wanted]
        with self._timed("drafter_forward"):
            logits = self.runtime.catch_up(row_req, wanted, unchanged)
        for j in range(k):
            if not self.config.pruned_head:
                logits = self.mapping.restrict(logits)
            with self._timed("sample"):
                shared = None
                if not params.all_greedy:
                    params.generators, shared = position_generators(
                        keys, [pos + j for pos in positions], seeded, salt)
                idx, q = sample_drafts(logits, params, shared)
            index[:, j] = idx
            qs.append(q)
            if j + 1 < k:
                next_tokens = self._draft_ids[idx].tolist()
                with self._timed("drafter_forward"):
                    logits = self.runtime.forward(row_req, lengths, [[t] for t in next_tokens])
                lengths = [n + 1 for n in lengths]

        with self._timed("map_and_q"):
            target = self._target_ids[index].tolist()  # [B, k] target ids
            for row, ids in zip(rows, target):
                drafts[row] = ids
            if self._fault == "scramble_q":
                qs = [q.roll(1, dims=-1) for q in qs]
            if not params.all_greedy and self._fault != "omit_q":
                self._last_q = self._q_buffer.fill(rows, qs, len(sampled_token_ids))
        if self.config.debug_digests:
            self._record_digest(rows, row_req, target, qs, params.all_greedy)
        self.counters["steps"] += 1
        self.counters["drafted_rows"] += len(rows)
