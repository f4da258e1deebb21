"""Catching drafters up ahead, on the CPUs vLLM left idle, while the target steps.

Before a request drafts, its drafter must have read its context: a new request's whole prompt, and every
token emitted while it drafted nothing. That read costs about as much as several target steps, and it
is what made trying a length at batch 1 dear. On a CPU host vLLM binds the target's threads to some
CPUs and may leave others idle (on two CPUs by default: one each). After a step that drafts nothing,
``start`` feeds the rows' drafters a bounded part of what they lack, in one thread on those idle CPUs,
while vLLM runs the next target step; the next ``propose`` calls ``wait`` before anything else touches the
drafter. The controller reads the drafters as caught up (``RequestTable.catch_up_outlook``) and no longer
prices the catch-up.

The idle CPUs are the user's process's (``VLLM_USD_CPUS``, which vLLM's processes inherit) that the
worker is not bound to. It runs only where nothing another rank does can differ: one worker (several are
bound to CPUs of their own, which would look idle to each other), a drafter that can run in a given
thread (llama.cpp), the draft-length controller's start-up timings, and a batch size at which some length
``could_pay``. It feeds in one thread (libgomp would bind a team's other threads to the target's CPUs), at
most the tokens that the drafter's prompt timing, scaled to one thread, fits into half a plain target step.
Every row it syncs it feeds (``RequestTable.sync``'s hint of unchanged tokens holds only for a drafter
fed after every sync).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from vllm_usd import envs
from vllm_usd.drafter.base import DrafterRuntime
from vllm_usd.drafting import DraftLengthController, RequestSampling, RequestTable

logger = logging.getLogger("vllm.usd")


def idle_cpus(runtime: DrafterRuntime) -> frozenset[int]:
    """The user's process's CPUs (``VLLM_USD_CPUS``) that this thread (vLLM's worker, bound to the target's
    CPUs) is not bound to, where the drafter can run on given CPUs; empty otherwise."""
    if not hasattr(runtime, "catch_up_on") or not hasattr(os, "sched_getaffinity"):
        return frozenset()
    return (envs.cpus() or frozenset()) - frozenset(os.sched_getaffinity(0))


def _bind_low(cpus: frozenset[int]) -> None:
    """This thread onto ``cpus``, at the lowest priority: vLLM's engine-core process, whose CPU they are,
    schedules every step and takes its CPU back at once."""
    os.sched_setaffinity(0, cpus)
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only


class CatchUpAhead:
    """Feeds drafters what they lack on idle CPUs between one ``propose`` and the next."""

    def __init__(self, runtime: DrafterRuntime, requests: RequestTable, alone: bool) -> None:
        """``alone``: the engine's only worker (others would be bound to the CPUs this one finds idle)."""
        self._runtime = runtime
        self._requests = requests
        self._idle = None if alone else frozenset()  # found at the first step (vLLM binds its worker by then)
        self._pool: ThreadPoolExecutor | None = None
        self._job: Future | None = None

    def wait(self) -> Exception | None:
        """Wait for the feed started after the last step. Returns its failure (the step then fails, and its
        rows, the feed's among them, start afresh), or None."""
        job, self._job = self._job, None
        if job is None:
            return None
        exc = job.exception()
        if exc is None:
            return None
        self._stop()
        return exc if isinstance(exc, Exception) else RuntimeError(repr(exc))

    def _stop(self) -> None:
        """After a failure (counted by the caller, as the step's), feeding ahead stays off."""
        logger.warning("vllm-usd: feeding drafters on idle CPUs failed; it stays off from now on")
        self._idle = frozenset()

    def start(self, controller: object, batch: int, req_ids: list[str], sampled_token_ids: list[list[int]],
              num_tokens: np.ndarray, token_ids: np.ndarray, sampling: Callable[[str], RequestSampling]) -> int:
        """After a step of ``batch`` decoding rows that drafts nothing: feed its rows' drafters, at most a
        plain step's worth of tokens, in the background. Returns the tokens it feeds."""
        budget = self._budget(controller, batch) if self._usable(controller, batch) else 0
        rows, wanted, held = [], [], []
        for i, sampled in enumerate(sampled_token_ids):
            if budget <= 0:
                break  # the rows left are not synced: a synced row must be fed
            if not sampled:
                continue
            req_id = req_ids[i]
            synced = self._requests.sync(req_id, int(num_tokens[i]), token_ids[i], lambda: sampling(req_id))
            if synced is None:
                continue
            _, seq, unchanged = synced
            same = self._runtime.cached_prefix(req_id, seq, unchanged)
            end = min(len(seq), same + budget)
            if end > same:  # else the drafter holds all of it (and perhaps drafts past it)
                budget -= end - same
                rows.append(req_id)
                wanted.append(seq[:end])
                held.append(same)
        if not rows:
            return 0
        fed = sum(len(seq) - same for seq, same in zip(wanted, held))
        try:
            self._job = self._pool.submit(self._runtime.catch_up_on, self._idle, rows, wanted, held)
        except Exception:
            self._stop()
            raise
        self._requests.counters["fed_ahead_tokens"] += fed
        return fed

    def feeds_first(self, controller: object, batch: int, missed: int) -> bool:
        """Whether a step about to draft should wait instead: its rows' drafters lack ``missed`` tokens, more than
        one step feeds ahead, and the next steps feed them at no cost to the target, where drafting now would
        first read them on the target's CPUs."""
        return self._usable(controller, batch) and missed > self._budget(controller, batch)

    def _usable(self, controller: object, batch: int) -> bool:
        timings = getattr(controller, "timings", None)
        if not isinstance(controller, DraftLengthController) or not (timings.target and timings.drafter_prefill):
            return False
        if self._idle is None:
            self._idle = idle_cpus(self._runtime)
            if self._idle:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="vllm-usd-catch-up", initializer=_bind_low,
                                                initargs=(self._idle,))
        return bool(self._idle) and any(controller.could_pay(batch, n) for n in range(1, controller.k + 1))

    def _budget(self, controller: DraftLengthController, batch: int) -> int:
        """Tokens one thread feeds in half the time the target takes a plain step (the other half is left to
        vLLM's engine core, which shares the CPU and goes first), both as timed at start-up (not as measured: a
        cycle includes any wait for this feed): the drafter's longest timed prompt per token, on its threads,
        taken as proportionally slower on one."""
        tokens, seconds = controller.timings.drafter_prefill[-1]
        per_token = seconds / tokens * len(self._runtime.cpus)
        return int(controller.timings.estimate(batch, 0) / 2 / per_token)
