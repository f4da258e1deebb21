"""vLLM's ``vllm.general_plugins`` entry point.

vLLM calls ``register()`` in every process it starts, for every user, whether
or not they asked for vllm-usd. So it is cheap, re-entrant, and never raises:
a patch whose vLLM functions do not match a known fingerprint is not applied
(one warning line naming the function), and without the runner hook the plugin
stays inactive. The patches it installs act only for vllm-usd: the runner hook
when the speculative proposer is a vllm-usd one, the front-end check
(``frontend.py``) when the ``speculative_config`` asks for one. The CPU
sampler fix is installed by the proposer itself (or here when
``VLLM_USD_FIX_CPU_SAMPLER=1``), so users who did not ask for it keep vLLM as
it is.
"""

from __future__ import annotations

import logging

from vllm_usd import envs

logger = logging.getLogger("vllm.usd")  # a child of vLLM's logger: same handler and format

_registered = False


def _check_engine_config(vllm_config) -> None:
    from vllm_usd.vllm_adapter.frontend import check_engine_config

    check_engine_config(vllm_config)


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    if envs.disabled():
        return
    try:
        from vllm_usd.vllm_adapter import compat, patches

        patches.engine_config_check = _check_engine_config
        wanted = ["runner_hook", "frontend_check", "drafts_with_sampled_tokens"] + (
            ["cpu_expand_fix"] if envs.fix_cpu_sampler() else [])
        for name in wanted:
            try:
                patches.apply([name])
            except compat.UnsupportedVllmVersion as exc:
                logger.warning("%s", exc)
        in_force = patches.applied()
        if "runner_hook" not in in_force:
            logger.warning("vllm-usd: the plugin stays inactive on vLLM %s (see `vllm-usd doctor`).",
                           compat.vllm_version())
            return
        logger.info("vllm-usd: active on vLLM %s (patches: %s)", compat.vllm_version(), ", ".join(sorted(in_force)))
    except Exception as exc:  # noqa: BLE001 - never break vLLM for other users
        logger.warning("vllm-usd: registration skipped: %s", exc)
