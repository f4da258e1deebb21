"""Start and stop vLLM engines for tests (about 30-40 s each on 2 cores)."""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any, Iterator

ENGINE_DEFAULTS: dict[str, Any] = dict(
    dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=64,
    disable_log_stats=False, seed=0,
)


@contextlib.contextmanager
def engine(model: str, *, drafter: str | None = None, k: int = 3, env: dict[str, str] | None = None,
           usd: dict[str, Any] | None = None, **kwargs: Any) -> Iterator[Any]:
    """An ``LLM`` for ``model``, with vllm-usd drafting from ``drafter`` if given."""
    from vllm import LLM

    import vllm_usd

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # lets llm.collective_rpc(vllm_usd.debug.proposer_stats) send a function to the worker
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    saved = {key: os.environ.get(key) for key in (env or {})}
    os.environ.update(env or {})
    args = {**ENGINE_DEFAULTS, **kwargs}
    if drafter is not None:
        args.update(vllm_usd.speculative_args(drafter=drafter, k=k, **(usd or {})))
    llm = LLM(model=model, **args)
    try:
        yield llm
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def spec_counts(llm: Any) -> dict[str, Any]:
    """vLLM's own spec-decode counters: drafts, draft tokens, accepted, per position."""
    from vllm_usd.bench import spec_counters

    out = spec_counters(llm)
    out["acceptance_length"] = 1 + out["accepted"] / out["drafts"] if out["drafts"] else 1.0
    return out


def token_ids(outputs: Any) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def proposer_stats(llm: Any) -> dict[str, Any]:
    """The vllm-usd proposer's counters and live state, from the (single) worker."""
    from vllm_usd.debug import proposer_stats as read

    (stats,) = llm.collective_rpc(read)
    return stats
