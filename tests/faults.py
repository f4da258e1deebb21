"""Planted bugs: proposers that each break one invariant, for the tests that must catch them.

The shipped package has no fault switch. A test either names one of these classes as
vLLM's ``custom_class`` proposer (``tests.engines.engine(..., proposer=ScrambleQProposer)``
names the class; the repository is on the engine processes' ``PYTHONPATH``), or, for a
fault that changes only what a step does, plants it in a running engine of the shipped
proposer (``with planted(llm, ScrambleQProposer):``): every worker's live proposer takes the
fault's class for the block, so one engine checks the sound proposer and then shows that the
same check catches the fault, without a second start-up.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from vllm_usd.drafting import DraftBatch
from vllm_usd.vllm_adapter.proposer import UniversalProposer


class ScrambleQProposer(UniversalProposer):
    """Hands q shifted by one column: the sampler sees the wrong distribution for every draft."""

    def _q_for_sampler(self, batch: DraftBatch) -> list[torch.Tensor] | None:
        qs = super()._q_for_sampler(batch)
        return None if qs is None else [q.roll(1, dims=-1) for q in qs]


class OmitQProposer(UniversalProposer):
    """Hands no q for sampled drafts: vLLM then treats them as point masses (lossless, accepts less)."""

    def _q_for_sampler(self, batch: DraftBatch) -> list[torch.Tensor] | None:
        return None


class NoCpuFixProposer(UniversalProposer):
    """Leaves vLLM's broken CPU expand_batch_to_tokens in place (docs/cpu-expand-bug.md). Planted in a
    running engine, vLLM's own function is put back for the block (``_swap_class``)."""

    patches = ("runner_hook",)


class RankRngProposer(UniversalProposer):
    """Seeds drafting with the tensor-parallel rank: what TP must never have."""

    def _draft_salt(self) -> int:
        return super()._draft_salt() + 1 + self.rank



class StringWithQProposer(UniversalProposer):
    """Hands a q for string drafts, which were not sampled from any (uniform over the intersection):
    vLLM then accepts them far too often."""

    def _hand_over(self, parts, batch, drafts) -> None:
        super()._hand_over(parts, batch, drafts)
        self._q_buffer.needed = True  # string drafting alone allocates no q buffer: this bug needs one
        if batch is None and parts:
            rows = [r for part, _ in parts for r in part.rows]
            n = self.mapping.size
            q = torch.full((len(rows), n), 1.0 / n, device=self.runtime.device)
            self._last_q = self._q_buffer.fill(rows, [q] * self.k, len(drafts))


class HangThenCrashProbeProposer(UniversalProposer):
    """Its native probe's child hangs on the best llama.cpp setting and segfaults on the next one
    (tests/native_faults/hang_then_crash.py); the third setting (no extra buffer types) is sound."""

    probe_child = "tests.native_faults.hang_then_crash"
    probe_timeout_s = 20.0


class CrashWithExtraBuffersProbeProposer(UniversalProposer):
    """Its native probe's child segfaults on every llama.cpp setting with extra buffer types
    (tests/native_faults/crash_with_extra_buffers.py): the worker drafts without them."""

    probe_child = "tests.native_faults.crash_with_extra_buffers"


class FailOnRankOneProposer(UniversalProposer):
    """Drafting raises on tensor-parallel rank 1, every third drafting step (all ranks draft in step)."""

    def _draft(self, rows, lengths):
        self._draft_calls = getattr(self, "_draft_calls", 0) + 1
        if self.rank == 1 and self._draft_calls % 3 == 0:
            raise RuntimeError("planted failure on rank 1")
        return super()._draft(rows, lengths)


class TliForEveryRequest(UniversalProposer):
    """Not a bug: intersection drafting with q (TLI) for greedy requests too, as usd.draft_mode "tli" does,
    planted in an engine started in "auto" (whose drafter head is whole: TLI then selects the intersection)."""

    def _drafts_text(self, temperature: float) -> bool:
        return False


class SlowTargetProposer(UniversalProposer):
    """Not a bug: the target looks 20 ms slower per forward, to the start-up timing and to the measured
    cycles alike (the wait comes before propose starts its clock), so that drafting the tiny pair pays
    from the first step on any host, as on a real pair. (Slower only in the measured cycles, the start-up
    estimate is off by a factor that the controller applies to the drafter's share of an unmeasured
    length too: on a host where the tiny target is fast, that kept every step at length 0.)"""

    SLOWER = 0.02  # seconds

    def propose(self, *args, **kwargs):
        import time

        time.sleep(self.SLOWER)
        return super().propose(*args, **kwargs)

    def _startup_timings(self, target_model):
        import dataclasses

        timings = super()._startup_timings(target_model)
        return dataclasses.replace(timings, target=tuple((n, s + self.SLOWER) for n, s in timings.target))


_FIXED_EXPAND: list[Any] = []  # a worker's fixed expand_batch_to_tokens while NoCpuFixProposer is planted


def _swap_class(worker: Any, name: str | None) -> str:
    """In a worker (``llm.collective_rpc``): its proposer becomes this module's class ``name``, or
    UniversalProposer again for None. NoCpuFixProposer also puts vLLM's broken expand back."""
    from vllm.v1.sample import rejection_sampler as rs

    from vllm_usd.vllm_adapter.compat import worker_drafter

    cls = UniversalProposer if name is None else globals()[name]
    if cls is NoCpuFixProposer:
        _FIXED_EXPAND.append(rs.expand_batch_to_tokens)
        rs.expand_batch_to_tokens = rs.expand_batch_to_tokens.__vllm_usd_wrapped__
    elif _FIXED_EXPAND:
        rs.expand_batch_to_tokens = _FIXED_EXPAND.pop()
    proposer = worker_drafter(worker)
    proposer.__class__ = cls
    return type(proposer).__name__


@contextlib.contextmanager
def planted(llm: Any, fault: type[UniversalProposer]) -> Iterator[None]:
    """Every worker's proposer runs as ``fault`` inside the block. Only faults that change what a step
    does can be planted this way: not those that act at start-up (``__init__``, the native probe)."""
    assert not {"__init__", "probe_child", "_startup_timings"} & set(vars(fault)), f"{fault.__name__} acts at start-up"
    assert llm.collective_rpc(_swap_class, args=(fault.__name__,))[0] == fault.__name__
    try:
        yield
    finally:
        llm.collective_rpc(_swap_class, args=(None,))
