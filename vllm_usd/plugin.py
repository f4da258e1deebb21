"""vLLM's ``vllm.general_plugins`` entry point.

vLLM calls ``register()`` in every process it starts, for every user, whether
or not they asked for vllm-usd. So it is cheap, re-entrant, and never raises:
on an unsupported vLLM it logs one warning and does nothing. The only patch it
installs, the runner hook, acts only when the speculative proposer is a
vllm-usd one. The CPU sampler fix is installed by the proposer itself (or here
when ``VLLM_USD_FIX_CPU_SAMPLER=1``), so users who did not ask for it keep
vLLM as it is.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("vllm.usd")  # a child of vLLM's logger: same handler and format

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    if os.environ.get("VLLM_USD_DISABLE", "") == "1":
        return
    try:
        from vllm_usd import _vllm_compat

        if not _vllm_compat.is_supported():
            logger.warning(
                "vllm-usd: vLLM %s is not supported (needs %s); the plugin stays inactive.",
                _vllm_compat.vllm_version(), ", ".join(_vllm_compat.SUPPORTED_VLLM),
            )
            return
        _vllm_compat.install_runner_hook()
        if os.environ.get("VLLM_USD_FIX_CPU_SAMPLER", "") == "1":
            _vllm_compat.install_cpu_expand_fix()
        logger.info("vllm-usd: active on vLLM %s (patches: %s)", _vllm_compat.vllm_version(),
                    ", ".join(sorted(_vllm_compat.applied())))
    except Exception as exc:  # noqa: BLE001 - never break vLLM for other users
        logger.warning("vllm-usd: registration skipped: %s", exc)
