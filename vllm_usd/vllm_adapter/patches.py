"""Every change vllm-usd makes to vLLM, listed in ``PATCHES`` and applied by ``apply``.

Each patch is idempotent, and names the vLLM functions it relies on (keys of
``fingerprints.FUNCTIONS``). It applies only when each of them matches the
fingerprint of a vLLM release vllm-usd was checked against; otherwise
``apply`` raises one line naming the function that changed.

- ``runner_hook``: wraps ``GPUModelRunner.propose_draft_token_ids`` (the CPU
  runner inherits it). Before the call it hands the runner and the scheduler
  output to a vllm-usd proposer; after it, it copies the proposer's draft
  probabilities into ``runner._draft_probs`` / ``_draft_prob_req_ids``, which
  vLLM 0.32 only fills for its own draft-model methods. Other proposers are
  untouched.
- ``cpu_expand_fix``: on CPU, ``rejection_sampler.expand_batch_to_tokens``
  returns uninitialised memory for float and int32 inputs (the CPU kernel
  writes into an int64 copy that is never copied back). It is replaced by a
  ``torch.repeat_interleave`` equivalent. See docs/cpu-expand-bug.md.
- ``cpu_empty_topk_fix``: on CPU, the rejection sampler's top-k path
  (``apply_top_k_only``, reached from ``apply_sampling_constraints``) calls
  ``k.max()`` on an empty tensor when a step verifies no drafts at all (every
  request got an empty list, as adaptive lengths often choose) and the batch
  samples with top-k but no top-p: the engine dies. The rejection sampler's
  ``apply_top_k_top_p`` is wrapped to return an empty input unchanged.
- ``cpu_drafted_rows_recovery``: on CPU, ``sample_recovered_tokens`` draws one
  exponential per vocabulary entry for every request of a sampled batch, also
  those without drafts, with torch's ``exponential_`` (3.5-3.9 ms per 262k
  entries on a core: 40 ms of a Gemma-3 batch-8 step). The replacement draws
  for requests with drafts only, ``-log(1 - u)`` of float64 uniforms (1.2 ms;
  seeded requests from their generators, as vLLM does), for vLLM's kernel.
- ``no_draft_plain_sampling``: with a speculative config, vLLM samples every
  step through the rejection sampler, also a step in which no request got a
  draft (which the draft-length policy often chooses at batch 8 and more). On
  the CPU that costs about 40 ms of a batch-32 step with Gemma-3's 262k
  vocabulary: the rejection sampler copies the bonus logits, and its bonus
  sampler clones them again for logprobs it does not return. The wrapper of
  ``GPUModelRunner._sample`` hands such a step to vLLM's plain sampler, the path
  vLLM takes without speculation: the same tokens, from the same generators.
  Only for a vllm-usd proposer.
- ``drafts_with_sampled_tokens``: with speculation configured and async
  scheduling off (vLLM turns it off for ``custom_class`` proposers), the engine
  core asks the workers for each step's sampled tokens and then, in
  ``post_step``, for the drafts in a second round trip. With a vllm-usd
  proposer, ``MultiprocExecutor.sample_tokens`` gets both in one reply (a worker
  method that calls the same two) and ``take_draft_token_ids`` hands out what
  came with it. The second call cost a tiny target 14% of its speed here
  (0.86x against 0.99x the target alone at batch 1, with nothing drafted).
  Other engines, non-blocking calls and KV / EC connectors keep vLLM's calls.
- ``frontend_check``: wraps ``EngineArgs.create_engine_config`` so that, in the
  user's own process and before any engine process starts, a vllm-usd
  ``speculative_config`` is checked (``engine_config_check``: ``plugin.register``
  sets it to ``frontend.check_engine_config``).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from vllm_usd import envs
from vllm_usd.vllm_adapter import fingerprints
from vllm_usd.vllm_adapter import compat
from vllm_usd.vllm_adapter.compat import UnsupportedVllmVersion

logger = logging.getLogger("vllm.usd")

_applied: set[str] = set()


def _install_wrapper(cls, attr: str, wrap) -> bool:
    """Replace ``cls.attr`` by ``wrap(original)`` once; a wrapper carries its original as ``__vllm_usd_wrapped__``."""
    current = getattr(cls, attr)
    if not hasattr(current, "__vllm_usd_wrapped__"):
        wrapped = wrap(current)
        wrapped.__vllm_usd_wrapped__ = current
        setattr(cls, attr, wrapped)
    return True


# --- runner_hook -------------------------------------------------------------------------------
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


def install_runner_hook() -> bool:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return _install_wrapper(GPUModelRunner, "propose_draft_token_ids", _wrap_propose)


# --- cpu_expand_fix ------------------------------------------------------------------------------
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
    """Replace the broken expand on the CPU platform. False where it does not apply (not CPU)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.v1.sample import rejection_sampler as rs

    original = rs.expand_batch_to_tokens
    if hasattr(original, "__vllm_usd_wrapped__"):
        return True
    fixed = functools.wraps(original)(expand_batch_to_tokens)
    fixed.__vllm_usd_wrapped__ = original  # type: ignore[attr-defined]
    rs.expand_batch_to_tokens = fixed
    return True


# --- cpu_empty_topk_fix -------------------------------------------------------------------------
def _wrap_top_k_top_p(original):
    @functools.wraps(original)
    def apply_top_k_top_p(logits: torch.Tensor, k, p):  # logits: [num_draft_tokens, vocab]
        if logits.shape[0] == 0:  # no drafts this step: nothing to mask (vLLM's top-k path fails on it)
            return logits
        return original(logits, k, p)

    return apply_top_k_top_p


def _install_function_wrapper(module, name: str, wrap) -> bool:
    """Replace ``module.name`` by ``wrap(original)`` once (the wrapper carries ``__vllm_usd_wrapped__``)."""
    original = getattr(module, name)
    if not hasattr(original, "__vllm_usd_wrapped__"):
        wrapped = wrap(original)
        wrapped.__vllm_usd_wrapped__ = original  # type: ignore[attr-defined]
        setattr(module, name, wrapped)
    return True


def install_cpu_empty_topk_fix() -> bool:
    """Guard the rejection sampler's top-k/top-p masking against a step with no drafts. CPU only."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.v1.sample import rejection_sampler as rs

    return _install_function_wrapper(rs, "apply_top_k_top_p", _wrap_top_k_top_p)


# --- cpu_drafted_rows_recovery ---------------------------------------------------------------------
def _wrap_sample_recovered_tokens(original):
    @functools.wraps(original)
    def sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                target_probs, sampling_metadata, device, *args, **kwargs):
        drafted = [i for i, n in enumerate(num_draft_tokens) if n > 0]
        recovered = torch.empty_like(draft_token_ids)
        if not drafted:  # no drafts this step: no recovered tokens to sample
            return recovered
        index, vocab = torch.tensor(drafted, device=cu_num_draft_tokens.device), target_probs.shape[-1]
        # [drafted requests, vocab]: 1 / E, E ~ Exp(1) as -log(1 - u), u float64 (a float32 u = 0 makes E = 0)
        inv_q = torch.rand(len(drafted), vocab, dtype=torch.float64).neg_().log1p_().neg_().reciprocal_().float()
        seeded_dtype = torch.float64 if (args[0] if args else kwargs.get("use_fp64_gumbel")) else torch.float32
        for row, i in enumerate(drafted):
            if (generator := sampling_metadata.generators.get(i)) is not None:  # as vLLM draws a seeded request's
                inv_q[row] = torch.empty(vocab, dtype=seeded_dtype).exponential_(generator=generator).reciprocal_()
        rs._sample_recovered_tokens(recovered, cu_num_draft_tokens[index], draft_token_ids, draft_probs,
                                    target_probs, inv_q, max_spec_len=max_spec_len)
        return recovered

    from vllm.v1.sample import rejection_sampler as rs

    return sample_recovered_tokens


def install_cpu_drafted_rows_recovery() -> bool:
    """Draw recovered-token noise faster, for requests with drafts only (rejection_sample reads the module global)."""
    from vllm.v1.sample import rejection_sampler as rs

    return _install_function_wrapper(rs, "sample_recovered_tokens", _wrap_sample_recovered_tokens)


# --- no_draft_plain_sampling ---------------------------------------------------------------------
def _wrap_sample(original):
    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata, *args, **kwargs):
        if (spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0
                and getattr(getattr(self, "drafter", None), "is_vllm_usd_proposer", False)):
            spec_decode_metadata = None  # no request has a draft: sample as vLLM does without speculation
        return original(self, logits, spec_decode_metadata, *args, **kwargs)

    return _sample


def install_no_draft_plain_sampling() -> bool:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return _install_wrapper(GPUModelRunner, "_sample", _wrap_sample)


# --- drafts_with_sampled_tokens ------------------------------------------------------------------
_SAMPLE_AND_TAKE = "vllm_usd_sample_tokens_and_take_drafts"


def _sample_tokens_and_take_drafts(self, grammar_output):
    """On vLLM's Worker: the step's sampled tokens and the drafts proposed after them, in one reply."""
    output = self.sample_tokens(grammar_output)
    return output, self.take_draft_token_ids()


def _wrap_executor_sample_tokens(original):
    @functools.wraps(original)
    def sample_tokens(self, grammar_output, non_block: bool = False):
        if (non_block or self.kv_output_aggregator is not None or self.ec_output_aggregator is not None
                or not _serves_vllm_usd(self)):
            return original(self, grammar_output, non_block)
        from vllm import envs as vllm_envs

        output, drafts = self.collective_rpc(_SAMPLE_AND_TAKE, args=(grammar_output,),
                                             unique_reply_rank=self.output_rank,
                                             timeout=vllm_envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)
        self._vllm_usd_drafts = (drafts,)  # what the engine's post_step takes next, without another call
        return output

    return sample_tokens


def _wrap_executor_take_draft_token_ids(original):
    @functools.wraps(original)
    def take_draft_token_ids(self):
        pending = getattr(self, "_vllm_usd_drafts", None)
        if pending is None:
            return original(self)
        self._vllm_usd_drafts = None
        return pending[0]

    return take_draft_token_ids


def _serves_vllm_usd(executor) -> bool:
    served = getattr(executor, "_vllm_usd_serves", None)
    if served is None:
        served = executor._vllm_usd_serves = compat.wants_vllm_usd(executor.vllm_config)
    return served


def install_drafts_with_sampled_tokens() -> bool:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.worker.gpu_worker import Worker

    if not hasattr(Worker, _SAMPLE_AND_TAKE):
        setattr(Worker, _SAMPLE_AND_TAKE, _sample_tokens_and_take_drafts)
    _install_wrapper(MultiprocExecutor, "sample_tokens", _wrap_executor_sample_tokens)
    return _install_wrapper(MultiprocExecutor, "take_draft_token_ids", _wrap_executor_take_draft_token_ids)


# --- frontend_check ---------------------------------------------------------------------------
# What the wrapper runs on each new VllmConfig; plugin.register sets it (frontend.check_engine_config),
# so that this list of patches knows nothing of the front end, nor, through it, of the proposer.
engine_config_check: Callable[[object], None] = lambda config: None


def _wrap_create_engine_config(original):
    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        engine_config_check(config)
        return config

    return create_engine_config


def install_frontend_check() -> bool:
    from vllm.engine.arg_utils import EngineArgs

    return _install_wrapper(EngineArgs, "create_engine_config", _wrap_create_engine_config)


# --- the list ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Patch:
    install: Callable[[], bool]  # True when in force, False where it does not apply
    needs: tuple[str, ...]  # the vLLM functions (fingerprints.FUNCTIONS keys) it relies on
    applies: Callable[[], bool] = lambda: True  # checked before the fingerprints


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


PATCHES: dict[str, Patch] = {
    # the hook wraps propose_draft_token_ids and fills what _get_spec_decode_draft_probs reads; the proposer
    # it serves is built by the custom-class loader, on the V1 runner, which vLLM picks because Model Runner V2
    # lists custom_class as unsupported
    "runner_hook": Patch(install_runner_hook, ("GPUModelRunner.propose_draft_token_ids",
                                               "GPUModelRunner._get_spec_decode_draft_probs",
                                               "create_custom_proposer",
                                               "VllmConfig._get_v2_model_runner_unsupported_features")),
    "cpu_expand_fix": Patch(install_cpu_expand_fix, ("expand_batch_to_tokens",), applies=_on_cpu),
    # apply_sampling_constraints calls apply_top_k_top_p through rejection_sampler's module global
    "cpu_empty_topk_fix": Patch(install_cpu_empty_topk_fix, ("apply_sampling_constraints",), applies=_on_cpu),
    "cpu_drafted_rows_recovery": Patch(install_cpu_drafted_rows_recovery,
                                       ("rejection_sample", "sample_recovered_tokens",
                                        "_sample_recovered_tokens"), applies=_on_cpu),
    # a step whose SpecDecodeMetadata has max_spec_len 0 samples one token per request, as without it; the
    # bookkeeping after _sample reads a [B, 1] output the same either way
    "no_draft_plain_sampling": Patch(install_no_draft_plain_sampling, ("GPUModelRunner._sample",)),
    "frontend_check": Patch(install_frontend_check, ("EngineArgs.create_engine_config",)),
    # the engine core calls sample_tokens, then (post_step) take_draft_token_ids, each a round trip to the
    # workers; with a vllm-usd proposer the first brings both back (the worker method calls the same two)
    "drafts_with_sampled_tokens": Patch(install_drafts_with_sampled_tokens, (
        "EngineCore.step", "EngineCore.post_step", "MultiprocExecutor.sample_tokens",
        "MultiprocExecutor.take_draft_token_ids", "Worker.sample_tokens", "Worker.take_draft_token_ids")),
}


def _root(root=None):
    root = fingerprints.installed_root() if root is None else root
    if root is None:
        raise UnsupportedVllmVersion("vllm-usd: vLLM is not installed. Install `vllm-usd[cpu]` or `vllm-usd[cuda]`.")
    return root


def check(name: str, root=None) -> list[fingerprints.FunctionCheck]:
    """The fingerprint check of every function patch ``name`` needs, in the installed vLLM or ``root``."""
    return fingerprints.check(_root(root), PATCHES[name].needs)


def refusal(name: str, root=None) -> str | None:
    """Why patch ``name`` may not be applied (one line), or None when it may."""
    root = _root(root)
    line = fingerprints.refusal(check(name, root), f"patch {name} (vLLM {fingerprints.source_version(root)})")
    if line is not None and envs.skip_fingerprints():
        logger.warning("vllm-usd: %s=1: applying patch %s to code vllm-usd was not checked against. %s",
                       envs.SKIP_FINGERPRINTS, name, line)
        return None
    return line


def apply(names: Iterable[str]) -> frozenset[str]:
    """Apply the named patches (each once) where their fingerprints match; returns the ones in force.

    Raises UnsupportedVllmVersion, one line naming the changed function, when one does not match.
    """
    for name in names:
        if name in _applied:
            continue
        patch = PATCHES[name]
        if not patch.applies():
            continue
        line = refusal(name)
        if line is not None:
            raise UnsupportedVllmVersion(line)
        if patch.install():
            _applied.add(name)
    return applied()


def applied() -> frozenset[str]:
    return frozenset(_applied)
