"""The start-up check in the user's own process: a bad ``usd`` section fails before any engine process starts.

``patches.frontend_check`` calls ``check_engine_config`` (wired in by ``plugin.register``) on the ``VllmConfig``
that ``EngineArgs.create_engine_config`` returns (``LLM(...)``, ``vllm serve``
and ``vllm-usd serve`` all build their config there). It does what the
proposer's ``__init__`` does in the worker, short of loading the drafter's
weights: the fingerprints of the proposer's patches, the ``usd`` settings, k,
the drafter's config and tokenizer, and the shared vocabulary. Each failure is
one ``ValueError`` line, the last thing the user sees. The proposer repeats
every check in the worker, as the backstop.
"""

from __future__ import annotations

import logging
import time

from vllm_usd.config import PROPOSER_CLASS, check_no_sleep_mode, check_num_speculative_tokens, parse_usd_config
from vllm_usd.core.pair import DraftPair
from vllm_usd.drafter.loading import read_drafter
from vllm_usd.drafter.select import choose
from vllm_usd.vllm_adapter import compat

logger = logging.getLogger("vllm.usd")


def _check_class_path(class_path: str | None) -> None:
    """A misspelled vllm_usd class fails here, in vLLM's own words, rather than in the worker."""
    if not class_path or not class_path.startswith("vllm_usd.") or class_path.count(".") != 1:
        return
    import vllm_usd

    name = class_path.split(".", 1)[1]
    if getattr(vllm_usd, name, None) is None:
        raise ValueError(f"vllm-usd: Module 'vllm_usd' has no attribute '{name}' "
                         f"(speculative_config.model='{class_path}'); the proposer is {PROPOSER_CLASS}.")


def _proposer_patches_refusal() -> str | None:
    from vllm_usd.vllm_adapter import patches
    from vllm_usd.vllm_adapter.proposer import UniversalProposer

    for name in UniversalProposer.patches:
        if patches.PATCHES[name].applies():
            line = patches.refusal(name)
            if line is not None:
                return line
    return None


def _check(vllm_config) -> None:
    line = _proposer_patches_refusal()
    if line is not None:
        raise ValueError(line)
    _check_class_path(compat.speculative_method_and_class(vllm_config)[1])
    if compat.uses_v2_model_runner(vllm_config):
        raise ValueError("vllm-usd: vLLM chose Model Runner V2, which has no custom_class proposers; vllm-usd needs "
                         "the V1 runner (unset VLLM_USE_V2_MODEL_RUNNER, or set it to 0).")
    cfg = parse_usd_config(compat.additional_config(vllm_config))
    check_num_speculative_tokens(compat.num_speculative_tokens(vllm_config))
    check_no_sleep_mode(compat.sleep_mode(vllm_config))
    trust = cfg.trust_remote_code
    if trust is None:
        trust = compat.target_trusts_remote_code(vllm_config)
    draft_config, draft_tokenizer = read_drafter(
        cfg.drafter, revision=cfg.drafter_revision, trust_remote_code=trust)
    choose(cfg.drafter, runtime=cfg.drafter_runtime, dtype=cfg.drafter_dtype, gguf=cfg.drafter_gguf,
           device=compat.device_type(vllm_config))
    text_config = draft_config.get_text_config() if hasattr(draft_config, "get_text_config") else draft_config
    draft_vocab = getattr(text_config, "vocab_size", None)
    DraftPair.build(compat.load_target_tokenizer(vllm_config), draft_tokenizer,
                    target_vocab_size=compat.target_vocab_size(vllm_config),
                    draft_vocab_size=int(draft_vocab) if isinstance(draft_vocab, int) else None,
                    min_share=cfg.min_intersection)


def check_engine_config(vllm_config) -> None:
    """Raise one ``ValueError`` line when a vllm-usd ``speculative_config`` would fail in the worker."""
    if not compat.wants_vllm_usd(vllm_config):
        return
    from vllm_usd.vllm_adapter.failures import install_collector

    install_collector()  # before the engine's processes start: they inherit where to leave their counts
    started = time.perf_counter()
    try:
        _check(vllm_config)
    except ValueError as exc:
        raise ValueError(str(exc)) from None  # already vllm-usd's one line; the chain would only bury it
    method = compat.rejection_sample_method(vllm_config)
    if method != "standard":
        logger.warning("vllm-usd: rejection_sample_method=%r is not vLLM's lossless verification: the output is no "
                       "longer the target's own distribution (greedy text may differ from the target alone).", method)
    logger.info("vllm-usd: the usd settings, the drafter's tokenizer and the shared vocabulary check out "
                "(%.1fs, before the engine starts)", time.perf_counter() - started)
