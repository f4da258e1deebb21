"""Start and stop vLLM engines for tests (about 30-40 s each on 2 cores)."""

from __future__ import annotations

import contextlib
import gc
import glob
import os
from pathlib import Path
from typing import Any, Iterator

REPO = str(Path(__file__).resolve().parents[1])

ENGINE_DEFAULTS: dict[str, Any] = dict(
    dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=64,
    disable_log_stats=False, seed=0,
)


@contextlib.contextmanager
def engine(model: str, *, drafter: str | None = None, k: int = 3, env: dict[str, str] | None = None,
           usd: dict[str, Any] | None = None, proposer: type | None = None, **kwargs: Any) -> Iterator[Any]:
    """An ``LLM`` for ``model``, with vllm-usd drafting from ``drafter`` if given.

    ``proposer``: a class from tests.faults to use instead of vllm_usd.UniversalProposer.
    Drafting is at a fixed k (``adaptive_length: false``), for up to ``max_num_seqs`` rows, unless ``usd`` says otherwise:
    most engine tests check the drafting machinery and count drafts at every batch size;
    the tests with ``adaptive_length`` on say so.
    """
    from vllm import LLM

    import vllm_usd
    from vllm_usd.vllm_adapter.compat import shutdown_engine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # lets llm.collective_rpc(vllm_usd.vllm_adapter.debug.proposer_stats) send a function to the worker
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    args = {**ENGINE_DEFAULTS, **kwargs}
    if drafter is not None:
        # a folder without a GGUF stays on transformers, as before conversion existed (tests/test_hf_to_gguf.py
        # covers the conversion): these tests check the drafting machinery, not the drafter's format
        pinned = {} if glob.glob(os.path.join(drafter, "*.gguf")) or "drafter_gguf" in (usd or {}) else \
            {"drafter_runtime": "transformers"}
        # drafter_max_num_seqs as vLLM's: these tests draft at every batch size they run (the default bound, 64
        # rows, is tested in test_proposer_lifecycle)
        pinned["drafter_max_num_seqs"] = args["max_num_seqs"]
        args.update(vllm_usd.speculative_args(drafter=drafter, k=k, **{"adaptive_length": False, **pinned,
                                                                      **(usd or {})}))
    if proposer is not None:  # the engine's processes import it by name
        args["speculative_config"]["model"] = f"{proposer.__module__}.{proposer.__qualname__}"
    # the workers import tests.faults: a proposer class named above, or a fault planted later (tests.faults.planted)
    env = {**(env or {}), "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    saved = {key: os.environ.get(key) for key in (env or {})}
    os.environ.update(env or {})
    llm = LLM(model=model, **args)
    try:
        yield llm
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutdown_engine(llm)
        del llm
        gc.collect()


def spec_counts(llm: Any) -> dict[str, Any]:
    """vLLM's own spec-decode counters: drafts, draft tokens, accepted, per position."""
    from vllm_usd.bench.vllm_systems import spec_counters

    out = spec_counters(llm)
    out["acceptance_length"] = 1 + out["accepted"] / out["drafts"] if out["drafts"] else 1.0
    return out


def token_ids(outputs: Any) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def proposer_stats(llm: Any) -> dict[str, Any]:
    """The vllm-usd proposer's counters and live state, from the (single) worker."""
    from vllm_usd.vllm_adapter.debug import proposer_stats as read

    (stats,) = llm.collective_rpc(read)
    return stats
