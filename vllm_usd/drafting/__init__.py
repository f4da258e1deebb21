"""vLLM-free drafting over a DrafterRuntime: per-request state, the intersection
strategy (TLI, with the exact q), the draft-length controller and phase timers."""

from vllm_usd.drafting.controller import DraftLengthController, FixedLength, StartupTimings
from vllm_usd.drafting.requests import DraftRows, RequestSampling, RequestTable
from vllm_usd.drafting.timing import PhaseTimer
from vllm_usd.drafting.tli import DraftBatch, IntersectionDrafting

__all__ = ["DraftBatch", "DraftLengthController", "DraftRows", "FixedLength", "IntersectionDrafting", "PhaseTimer",
           "RequestSampling", "RequestTable", "StartupTimings"]
