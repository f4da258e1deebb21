"""UniversalProposer: vLLM's ``custom_class`` proposer for a drafter with another tokenizer.

vLLM builds it as ``UniversalProposer(vllm_config)`` in each worker and calls
``propose(...)`` once per step. The runner hook (``patches.py``) hands it the
runner and scheduler output just before, and takes its draft probabilities
just after. A step is three named parts: sync requests, draft, hand over; then
the tensor-parallel ranks keep the step's drafts, or all drop them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np
import torch

from vllm_usd.config import (DEFAULT_DRAFTER_MAX_NUM_SEQS, UsdConfig, check_no_sleep_mode,
                             check_num_speculative_tokens, parse_usd_config)
from vllm_usd.core.pair import DraftPair
from vllm_usd.core.retokenize import TargetRetokenizer
from vllm_usd.drafter.llama_cpp_runtime import drafter_cpus
from vllm_usd.drafter.select import choose, open_drafter
from vllm_usd.drafting import (DraftBatch, DraftLengthController, DraftRows, FixedLength, IntersectionDrafting,
                               PhaseTimer, RequestTable, StartupTimings)
from vllm_usd.drafting.controller import SHARE_EVERY
from vllm_usd.drafting.drafter_timing import CONTEXT_TOKENS, time_drafter, time_drafter_prefill
from vllm_usd.drafting.requests import SAMPLING_EPS
from vllm_usd.drafting.string_level import StringDrafting, default_budget
from vllm_usd.vllm_adapter import compat, patches
from vllm_usd.vllm_adapter.digests import StepDigests
from vllm_usd.vllm_adapter.drafter_memory import allocate_drafter_memory
from vllm_usd.vllm_adapter.failures import PEER_FAILED, FailureCounts
from vllm_usd.vllm_adapter.q_buffer import DraftProbsBuffer
from vllm_usd.vllm_adapter.target_timing import MAX_TIMED_TOKENS, TARGET_REPEATS, time_target, token_counts

logger = logging.getLogger("vllm.usd")


class UniversalProposer:
    """Drafts with a small model whose vocabulary differs from the target's."""

    is_vllm_usd_proposer = True
    #: the patches this proposer needs in its worker process (see patches.PATCHES)
    patches: tuple[str, ...] = ("runner_hook", "cpu_expand_fix", "cpu_empty_topk_fix", "cpu_drafted_rows_recovery",
                                "no_draft_plain_sampling")
    #: the native probe's time limit per child process, and the child's module (tests plant faults there)
    probe_timeout_s: float = 120.0
    probe_child: str | None = None

    def __init__(self, vllm_config: Any) -> None:
        patches.apply(self.patches)
        self.config: UsdConfig = parse_usd_config(getattr(vllm_config, "additional_config", None))
        self.k = compat.num_speculative_tokens(vllm_config)
        check_num_speculative_tokens(self.k)
        check_no_sleep_mode(compat.sleep_mode(vllm_config))
        self.target_vocab_size = compat.target_vocab_size(vllm_config)
        trust = self.config.trust_remote_code
        if trust is None:
            trust = compat.target_trusts_remote_code(vllm_config)

        started = time.perf_counter()
        cfg = self.config
        self.choice = choose(cfg.drafter, runtime=cfg.drafter_runtime, dtype=cfg.drafter_dtype,
                             gguf=cfg.drafter_gguf, device=compat.worker_device(vllm_config),
                             gguf_type=cfg.drafter_gguf_type)
        opened = open_drafter(
            cfg.drafter, self.choice, max_len=self._drafter_max_len(vllm_config),
            max_requests=self._max_draft_rows(vllm_config),
            kv_budget_bytes=int(cfg.drafter_kv_budget_gb * (1 << 30)),
            revision=cfg.drafter_revision, trust_remote_code=trust,
            cuda_graphs=not compat.enforce_eager(vllm_config), cpus=drafter_cpus(),
            probe_on=compat.computed_on_tp_rank0, probe_timeout_s=self.probe_timeout_s, probe_child=self.probe_child,
            agree=compat.tp_any, catch_up_tokens=self.k + 1,
        )
        self.runtime, self.draft_tokenizer = opened.runtime, opened.tokenizer
        self.choice = opened.choice  # with the GGUF type resolved
        target_tokenizer = compat.load_target_tokenizer(vllm_config)
        self.pair = DraftPair.build(
            target_tokenizer, self.draft_tokenizer,
            target_vocab_size=self.target_vocab_size, draft_vocab_size=opened.vocab_size,
            min_share=cfg.min_intersection,
        )
        self.mapping = self.pair.mapping
        self.timer = PhaseTimer(self.config.profile)
        drafts_text = cfg.draft_mode != "tli"  # string drafting reads the drafter's whole head
        string_budget = cfg.string_draft_tokens or default_budget(self.k)
        # room a step may need past a request's drafter context: k drafts, or the string budget
        self.requests = RequestTable(self.pair, self.runtime, k=max(self.k, string_budget) if drafts_text else self.k,
                                     always_greedy=self.config.draft_sampling == "greedy", seed=self.config.seed,
                                     drafts_text=self._drafts_text if drafts_text else None,
                                     waits_after_prefill=cfg.adaptive_length)
        self.strategy = IntersectionDrafting(self.mapping, self.runtime, k=self.k,
                                             pruned_head=cfg.pruned_head and not drafts_text, timer=self.timer,
                                             confidence_stop=cfg.confidence_stop)
        self.strings = StringDrafting(
            self.mapping, TargetRetokenizer(target_tokenizer, self.mapping.target_table), self.runtime,
            budget=string_budget, timer=self.timer,
            counters=self.requests.counters,
        ) if drafts_text else None
        self.vllm_config = vllm_config
        # timed in load_model; until then (and without adaptive_length) the controller prices nothing
        self.controller: DraftLengthController | FixedLength = (
            DraftLengthController(self.k) if cfg.adaptive_length else FixedLength(self.k))
        self.startup_line = ""  # load_model's one line (stats()["startup"])
        self._length = 0  # the length the current step's rows got (the next cycle's key)
        self.rank = compat.tp_rank()
        self.failures = FailureCounts(self.rank)
        self._digests = StepDigests()
        self._q_buffer = DraftProbsBuffer(self.k, self.target_vocab_size, self.mapping.target_ids, self.runtime.device,
                                          max_rows=self._max_draft_rows(vllm_config),
                                          needed=cfg.draft_mode != "string" and cfg.draft_sampling != "greedy")
        self._last_q: torch.Tensor | None = None
        self._runner = None
        self._scheduler_output = None
        self._last_end: float | None = None
        self._last_start: float | None = None
        logger.info(
            "vllm-usd: drafter %s ready in %.1fs (%s, %s, on %s): %d shared tokens (%.1f%% of the drafter's %d, "
            "%d matched by bytes only), k=%d, draft_mode=%s, draft_sampling=%s, adaptive_length=%s",
            self.config.drafter, time.perf_counter() - started, self.choice.runtime, self.choice.dtype,
            self.choice.device, self.mapping.size,
            100 * self.mapping.size / max(self.mapping.draft_table.size, 1), self.mapping.draft_table.size,
            self.mapping.byte_only_matches, self.k, cfg.draft_mode, cfg.draft_sampling, cfg.adaptive_length,
        )

    def _max_draft_rows(self, vllm_config: Any) -> int:
        """usd.drafter_max_num_seqs: the q buffer's rows and the drafter's requests; a step with more rows
        drafts nothing."""
        return self.config.drafter_max_num_seqs or min(compat.max_num_seqs(vllm_config), DEFAULT_DRAFTER_MAX_NUM_SEQS)

    def _drafter_max_len(self, vllm_config: Any) -> int:
        """The longest drafter context to hold: the setting, else twice the target's (tokenizers differ)."""
        target = compat.target_max_model_len(vllm_config)
        return self.config.drafter_max_model_len or (2 * target + self.k if target else 1 << 30)

    def _startup_timings(self, target_model: Any | None) -> StartupTimings:
        """The drafter timed on rank 0 (its prompts as often as the target: they run long), the target (where given) on
        every rank (its collectives must meet); rank 0's figures taken by every rank, which also decide how the drafter runs."""
        def drafter_points() -> tuple[tuple[tuple[int, float], ...], tuple[tuple[int, float], ...]]:
            ids = self.mapping.draft_ids.tolist()
            middle = len(ids) // 2  # ordinary tokens (the lowest ids are often specials and bytes)
            ordinary = ids[middle:middle + 4 * CONTEXT_TOKENS] or ids
            try:
                return time_drafter(self.runtime, ordinary), time_drafter_prefill(self.runtime, ordinary, repeats=TARGET_REPEATS)
            except Exception as exc:  # noqa: BLE001 - the controller then measures while serving only
                logger.warning("vllm-usd: timing the drafter failed (%s); drafts are priced as measured", exc)
                return (), ()

        drafter, prefill = compat.computed_on_tp_rank0(drafter_points)
        drafter, prefill = self.runtime.one_at_a_time_where_faster(drafter, prefill)  # alike on every rank
        target, verify = (), ()  # (tokens, seconds) points: none where the target is compiled
        if target_model is not None and compat.enforce_eager(self.vllm_config):  # compiled: vLLM's warm-up runs it
            try:
                target, verify = time_target(target_model, self.vllm_config, token_counts(min(
                    compat.max_num_seqs(self.vllm_config) * (1 + self.k),
                    compat.max_num_batched_tokens(self.vllm_config), MAX_TIMED_TOKENS)))
            except Exception as exc:  # noqa: BLE001 - the controller then prices steps as measured
                logger.warning("vllm-usd: timing the target at start-up failed (%s); steps are priced as measured",
                               exc)
        if compat.tp_any(not target):  # every rank goes on alike
            target, verify = (), ()
        target, verify = compat.tp_broadcast_from_rank0((target, verify))
        return StartupTimings(target=target, drafter=drafter, drafter_prefill=prefill, verify=verify)

    # -- vLLM hooks ----------------------------------------------------------------------------
    def load_model(self, target_model: Any) -> None:
        """vLLM calls this after loading the target, before it sizes its KV cache: the drafter's memory
        is allocated here in full (``drafter_memory.py``), the drafter is timed (how it runs forwards), and
        with adaptive_length the target too, for the draft-length controller."""
        logger.info("%s", allocate_drafter_memory(self.runtime, self._q_buffer,
                                                  compat.gpu_memory_utilization(self.vllm_config)))
        timings = self._startup_timings(target_model if self.config.adaptive_length else None)
        if self.config.adaptive_length:
            # alone, the costs and losses are taken at every step (nothing to send); under TP, every SHARE_EVERY
            self.controller = DraftLengthController(self.k, timings, share_every=SHARE_EVERY if compat.tp_size() > 1 else 1)
        self.startup_line = self._startup_line()
        logger.info("%s", self.startup_line)

    def _startup_line(self) -> str:
        """What the user reads at start-up (and ``doctor --target`` prints): the drafter's runtime, format
        and batch-1 step, a batch-1 cycle with and without drafts, and where drafting is expected to pay."""
        drafter = f"vllm-usd: drafter on {self.choice.runtime} ({self.choice.dtype})"
        timings = getattr(self.controller, "timings", None)
        if timings is None:  # adaptive_length false: nothing was timed
            return f"{drafter}; {self.controller.outlook(())}"
        drafter_ms = f"{timings.drafter[0][1] * 1e3:.1f} ms" if timings.drafter else "not timed"
        cycle_ms = [f"{timings.estimate(1, n) * 1e3:.1f} ms" if timings.target else "not timed" for n in (0, self.k)]
        batches = [1 << b for b in range(compat.max_num_seqs(self.vllm_config).bit_length())]
        return (f"{drafter}, a step at batch 1: {drafter_ms}; a cycle at batch 1: {cycle_ms[0]} without drafts, "
                f"{cycle_ms[1]} with {self.k} (start-up timing); at acceptance "
                + "/".join(f"{a:.2f}" for a in self.controller.acceptance(False))
                + f" until measured, {self.controller.outlook(batches)}")

    def bind_step(self, runner: Any, scheduler_output: Any) -> None:
        self._runner = runner
        self._scheduler_output = scheduler_output

    def take_last_draft_probs(self) -> torch.Tensor | None:
        q, self._last_q = self._last_q, None
        return q

    # -- state, for tests, benchmarks and the debug readers -------------------------------------
    @property
    def counters(self) -> dict[str, int]:
        return self.requests.counters

    @property
    def num_request_states(self) -> int:
        return len(self.requests)

    @property
    def digests(self) -> list[str]:
        """With usd.debug_digests: one SHA-256 per drafting step of (rows, requests, drafts, q)."""
        return self._digests.all()

    def stats(self) -> dict[str, Any]:
        """Counters, phase timings (with usd.profile) and live state."""
        return {
            "counters": dict(self.counters), "timings": dict(self.timer.timings),
            "request_states": len(self.requests), "drafter_requests": self.runtime.num_requests,
            "drafter_kv_bytes": self.runtime.kv_bytes, "q_buffer_bytes": self._q_buffer.nbytes,
            "drafter_kv_blocks": getattr(self.runtime, "num_blocks", None),
            "drafter_kv_free_blocks": getattr(self.runtime, "free_blocks", None),
            "drafter_forwards": dict(getattr(self.runtime, "forwards", {})),
            "decode_graphs": getattr(getattr(self.runtime, "graphs", None), "captures", 0),
            "drafter_param_bytes": self.runtime.param_bytes, "rank": self.rank,
            "drafter_runtime": self.choice.runtime, "drafter_dtype": self.choice.dtype,
            "drafter_device": self.choice.device, "drafter_probe": self.choice.probe,
            "failures": dict(self.failures.by_reason),
            "native_settings": dataclasses.asdict(self.choice.native) if self.choice.native else None,
            "startup": self.startup_line,
            "controller": self.controller.state(),
            "controller_summary": self.controller.summary(),
        }

    # -- one step ------------------------------------------------------------------------------
    def propose(
        self,
        sampled_token_ids: list[list[int]],  # per batch row: the tokens this step emitted
        num_tokens_no_spec: np.ndarray,  # [num_rows] committed target tokens
        token_ids_cpu: np.ndarray,  # [max_num_seqs, max_model_len] target ids
        **kwargs: Any,
    ) -> list[list[int]]:
        self._last_q = None
        num_rows = len(sampled_token_ids)
        # rows whose target step emitted tokens: tokens per row-step = generated tokens / this count
        self.counters["emitting_rows"] += sum(1 for s in sampled_token_ids if s)
        started = time.perf_counter()
        if self._last_end is not None:  # the rest of the engine step: target forward, sampling, scheduling
            self.timer.add("outside_proposer", started - self._last_end)
        batch = num_rows - sampled_token_ids.count([])  # decoding rows
        length, failure = self._choose_length(started, sampled_token_ids, num_tokens_no_spec, batch,
                                              num_rows <= self._q_buffer.max_rows)
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        parts, qs = [], None
        try:
            if failure is not None:
                raise failure
            if self._runner is None:
                raise RuntimeError("vllm-usd: the runner hook is not installed (was vllm_usd's register() disabled?)")
            rows, lengths = self._sync_requests(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, length)
            if len(rows):
                parts, batch = self._draft(rows, lengths)
                qs = self._hand_over(parts, batch, drafts)
        except Exception as exc:  # noqa: BLE001 - a drafting failure must not stop the engine
            failure = exc
        # the step's one collective: every rank takes the same action (all drop the drafts, or none), and
        # every SHARE_EVERY steps takes rank 0's measured costs for the next step's choice
        failed, shared = compat.tp_vote(failure is not None, self.controller.share_due())
        if shared is not None:
            self.controller.take_shared(shared)
        if failed:
            self._recover(failure, num_rows)
            drafts = [[] for _ in range(num_rows)]
        elif parts:
            self._record(parts, qs)
        if not any(drafts):  # the cycle this step opens is a plain one, whatever length it was given
            self._length = 0
        self.failures.check_graph_capture(self.runtime)
        self._last_end = time.perf_counter()
        self.timer.add("propose_total", self._last_end - started)
        return drafts

    def _choose_length(self, started: float, sampled_token_ids: list[list[int]], num_tokens: np.ndarray,
                       batch: int, fits: bool) -> tuple[int, Exception | None]:
        """Tell the controller what the step that just ran did (the cycle it closed, its acceptance), and
        return this step's length (and what failed, if anything: the step then drafts nothing, on every
        rank). Every rank chooses alike: from what every rank sees, and rank 0's costs as last shared. A
        step whose rows do not ``fit`` the q buffer (usd.drafter_max_num_seqs) drafts nothing."""
        so, controller, failure = self._scheduler_output, self.controller, None
        try:
            if self._last_start is not None and compat.decode_step_tokens(so) is not None:
                emitted = [len(s) for s in sampled_token_ids if s]
                controller.record_cycle(batch, self._length, started - self._last_start,
                                        sum(emitted) / len(emitted) if emitted else None)
            greedy = compat.runner_greedy_rows(self._runner, len(sampled_token_ids)) if self._runner is not None else []
            if self._runner is not None:
                controller.observe(compat.scheduled_drafts(so, compat.runner_req_ids(self._runner)),
                                   sampled_token_ids, greedy)
        except Exception as exc:  # noqa: BLE001 - counted as the step's failure; the vote must still happen
            failure = exc
        self._last_start = started
        self._length = 0
        if failure is None and batch and fits:
            try:
                runner = self._runner
                self._length = controller.length(batch, lambda: self.requests.catch_up_outlook(
                    compat.runner_req_ids(runner), sampled_token_ids, num_tokens,
                    lambda req_id: compat.request_sampling(runner, req_id)) if runner is not None else (0, 0.0),
                    greedy=int(np.count_nonzero(greedy[[i for i, s in enumerate(sampled_token_ids) if s]])))
                self.failures.set_lengths(controller.lengths())
            except Exception as exc:  # noqa: BLE001 - as above
                failure = exc
        return self._length, failure

    def _sync_requests(self, sampled_token_ids: list[list[int]], num_tokens: np.ndarray,
                       token_ids: np.ndarray, length: int) -> tuple[DraftRows, list[int]]:
        """Forget requests vLLM dropped; bring the rows that draft ``length`` (0: none) up to date.
        Returns those rows, longest first, and their lengths."""
        runner = self._runner
        for req_id in compat.scheduler_gone_req_ids(self._scheduler_output):
            self.requests.forget(req_id)
        self.requests.keep_only(compat.runner_live_req_ids(runner))
        if length == 0:  # no length pays at this batch size: no per-row work
            self.counters["length_0"] += sum(1 for s in sampled_token_ids if s)
            return DraftRows(), []
        with self.timer.phase("translate"):
            rows, lengths = self.requests.collect(compat.runner_req_ids(runner), sampled_token_ids, num_tokens,
                                                  token_ids, lambda req_id: compat.request_sampling(runner, req_id),
                                                  length)
        self.counters[f"length_{length}"] += len(lengths)
        return rows.longest_first(lengths)

    def _draft_salt(self) -> int:
        """Mixed into every unseeded draw: equal on every rank (usd.seed)."""
        return self.config.seed

    def _q_for_sampler(self, batch: DraftBatch) -> list[torch.Tensor] | None:
        """q per draft position ([B, n], intersection order), or None when no row sampled."""
        return batch.q

    def _drafts_text(self, temperature: float) -> bool:
        """usd.draft_mode: string-level drafting for this request, or TLI with q."""
        mode = self.config.draft_mode
        return mode == "string" or (mode == "auto" and temperature < SAMPLING_EPS)

    def _draft(self, rows: DraftRows, lengths: list[int]) -> tuple[list[tuple[DraftRows, list[list[int]]]], DraftBatch | None]:
        """Each row with its strategy, one batched pass per strategy: (rows, target ids) per strategy,
        and the TLI batch (its q) if any row used TLI."""
        by_text = [i for i, s in enumerate(rows.states) if self.strings is not None and self._drafts_text(s.temperature)]
        parts: list[tuple[DraftRows, list[list[int]]]] = []
        batch = None
        if by_text:
            text_rows = rows.subset(by_text) if len(by_text) < len(rows) else rows
            parts.append((text_rows, self.strings.draft(text_rows, [lengths[i] for i in by_text])))  # no q
        if len(by_text) < len(rows):
            chosen = set(by_text)
            tli = [i for i in range(len(rows)) if i not in chosen]
            tli_rows, tli_lengths = (rows.subset(tli), [lengths[i] for i in tli]) if by_text else (rows, lengths)
            batch = self.strategy.draft(tli_rows, self._draft_salt(), tli_lengths)
            parts.append((tli_rows, batch.target_ids))
            cut = sum(len(ids) < n for ids, n in zip(batch.target_ids, tli_lengths))  # by the confidence stop
            self.counters["confidence_cut_rows"] += cut
        return parts, batch

    def _hand_over(self, parts: list[tuple[DraftRows, list[list[int]]]], batch: DraftBatch | None,
                   drafts: list[list[int]]) -> list[torch.Tensor] | None:
        """Drafts into vLLM's per-row lists; the TLI rows' q into the buffer the runner hook passes on
        (vLLM reads no q for greedy rows, and string drafts are point masses). Returns q per position."""
        qs = None
        with self.timer.phase("map_and_q"):
            for part_rows, target in parts:
                for row, ids in zip(part_rows.rows, target):
                    drafts[row] = ids
            if batch is not None:
                qs = self._q_for_sampler(batch)
                if qs is not None:
                    self._last_q = self._q_buffer.fill(parts[-1][0].rows, qs, len(drafts))  # TLI rows: last
        return qs

    def _record(self, parts: list[tuple[DraftRows, list[list[int]]]], qs: list[torch.Tensor] | None) -> None:
        """Once every rank kept the step's drafts: the policy's, the digests' and the counters' record of them."""
        if self.config.debug_digests:
            self._digests.record([r for p, _ in parts for r in p.rows], [r for p, _ in parts for r in p.req_ids],
                                 [ids for _, t in parts for ids in t], qs)
        self.counters["steps"] += 1
        self.counters["drafted_rows"] += sum(len(p) for p, _ in parts)

    def _recover(self, exc: Exception | None, num_rows: int) -> None:
        """Count a step that failed here (``exc``) or on another rank (None); drop its requests' drafting state."""
        self.failures.record(type(exc).__name__ if exc is not None else PEER_FAILED, exc)
        self.counters["failed_steps"] += 1
        if self._runner is not None:
            for req_id in list(compat.runner_req_ids(self._runner))[:num_rows]:
                self.requests.free(req_id)
        self._last_q = None

