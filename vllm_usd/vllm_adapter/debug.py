"""Read the proposer's state from outside the worker process.

    llm.collective_rpc(vllm_usd.vllm_adapter.debug.proposer_stats)   # one dict per worker
    llm.collective_rpc(vllm_usd.vllm_adapter.debug.draft_digests)    # one list per worker

vLLM sends the function to each worker (set VLLM_ALLOW_INSECURE_SERIALIZATION=1
where vLLM asks for it); it reads the runner's drafter if it is a vllm-usd one.
"""

from __future__ import annotations

from typing import Any

from vllm_usd.vllm_adapter.compat import worker_drafter


def _ours(worker: Any) -> Any:
    drafter = worker_drafter(worker)
    return drafter if getattr(drafter, "is_vllm_usd_proposer", False) else None


def proposer_stats(worker: Any) -> dict[str, Any] | None:
    drafter = _ours(worker)
    return drafter.stats() if drafter is not None else None


def draft_digests(worker: Any) -> list[str] | None:
    """Per-step digests of the drafts and q on this worker (needs usd.debug_digests).

    Under tensor parallelism every rank must return the same list.
    """
    drafter = _ours(worker)
    return drafter.digests if drafter is not None else None


class ProposerStatsExtension:
    """A vLLM worker extension that makes the readers above callable by name.

    Start vLLM with ``--worker-extension-cls vllm_usd.vllm_adapter.debug.ProposerStatsExtension``;
    then ``collective_rpc("usd_proposer_stats")`` works where functions cannot be
    sent, for example through the API server's ``POST /collective_rpc``
    (``VLLM_SERVER_DEV_MODE=1``, development only).
    """

    def usd_proposer_stats(self) -> dict[str, Any] | None:
        return proposer_stats(self)

    def usd_draft_digests(self) -> list[str] | None:
        return draft_digests(self)
