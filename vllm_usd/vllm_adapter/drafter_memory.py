"""The drafter's memory, decided at start-up: checked against what the device has free, allocated, logged.

vLLM sizes its own KV cache from the memory left after ``load_model`` and its
profiling run. The proposer's ``load_model`` calls ``allocate_drafter_memory``,
so the drafter's KV pool and the q buffer are counted in that measurement, and
neither grows afterwards. A setting that cannot fit is refused here, with the
numbers and what to change, instead of failing mid-serving.
"""

from __future__ import annotations

import torch

from vllm_usd.drafter.base import DrafterRuntime
from vllm_usd.vllm_adapter.q_buffer import DraftProbsBuffer

_MIB = 1 << 20


def device_free_bytes(device: torch.device) -> int | None:
    """Memory free on ``device`` now; None where it cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        import psutil

        return int(psutil.virtual_memory().available)
    return None


def allocate_drafter_memory(runtime: DrafterRuntime, q_buffer: DraftProbsBuffer) -> str:
    """Allocate the drafter's KV cache and the q buffer in full, or refuse; returns the start-up log line."""
    kv, q = runtime.planned_kv_bytes, q_buffer.planned_bytes
    need = (kv - runtime.kv_bytes) + (q - q_buffer.nbytes)
    free = device_free_bytes(runtime.device)
    if free is not None and need > free:
        raise ValueError(
            f"vllm-usd: the drafter's memory does not fit on {runtime.device}: it needs {need / _MIB:.0f} MiB "
            f"(KV cache {kv / _MIB:.0f} MiB, q buffer {q / _MIB:.0f} MiB = max_num_seqs {q_buffer.max_rows} x "
            f"k {q_buffer.k} x target vocabulary {q_buffer.vocab} x 4 B) and {free / _MIB:.0f} MiB is free. Lower "
            f"additional_config.usd.drafter_kv_budget_gb, max_num_seqs or num_speculative_tokens.")
    runtime.allocate()
    q_buffer.allocate()
    return describe(runtime, q_buffer)


def describe(runtime: DrafterRuntime, q_buffer: DraftProbsBuffer) -> str:
    """One line: each allocation's size and what it holds."""
    from vllm_usd.drafter.attention import KERNEL
    from vllm_usd.drafter.hf_runtime import BLOCK_SIZE, HFDrafterRuntime

    kv = runtime.planned_kv_bytes
    if isinstance(runtime, HFDrafterRuntime):
        held = (f"{runtime.num_blocks} blocks of {BLOCK_SIZE} tokens, {runtime.num_blocks * BLOCK_SIZE} tokens "
                f"across requests; attention: {KERNEL}")
    else:
        held = "llama.cpp's own, fixed when it loaded"
    q = (f"q buffer {q_buffer.planned_bytes / _MIB:.1f} MiB (max_num_seqs {q_buffer.max_rows} x k {q_buffer.k} x "
         f"target vocabulary {q_buffer.vocab} x 4 B)" if q_buffer.needed else "no q buffer (no draft carries a q)")
    return (f"vllm-usd: drafter memory on {runtime.device}, fixed from start-up: KV cache {kv / _MIB:.1f} MiB "
            f"({held}); {q}")
